"""Pronunciations for words a model's lexicon lacks (grapheme to phoneme), for phrase boosting.

A letter model spells a new word by its letters. A phoneme model (its lexicon, ``lexicon.tsv.gz``, was
written with espeak-ng: ``training.phonemes``) gets the word's pronunciation from the same G2P, libespeak-ng's
text-to-phoneme conversion through ctypes (no audio is made), then espeak-ng's phoneme names mapped to the
model's one-character units. The map is not shipped: it is read off the lexicon itself, by pronouncing a
sample of its words and pairing names with units where the two have the same length
(:meth:`PhonemeSpeller.from_lexicon`), which also measures how often the G2P gives back the lexicon's own
entry (:attr:`PhonemeSpeller.agreement`).

The library comes from the ``espeakng-loader`` wheel when it is installed (espeak-ng 1.52 with its data, so a
fresh ``pip install`` needs no system package), else from the system (``libespeak-ng1``). Why espeak-ng
rather than a neural G2P: the default model's units are espeak-ng's phonemes, so any other G2P would need its
own phoneme set mapped onto them, and espeak-ng's rules pronounce made-up names too (no dictionary needed).
espeak-ng is not thread-safe: one lock guards it in a process.
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections import Counter
from collections.abc import Mapping

_SYNCHRONOUS = 0x02
_CHARS_UTF8 = 1
_MARKS = re.compile(r"[',%=;|!]")  # stress, syllable and pause marks
_VARIANT = re.compile(r"(?<=.)[2#5]$")
# Sounds that occur in a handful of (mostly foreign) words, merged into the nearest English one.
RARE = {"x": "k", "C": "h", "e": "E", "o": "oU", "a:": "A:", "a#:": "A:", "A~": "A:", "O~": "O:", "i::": "i:"}
SAMPLE_WORDS = 4000  # lexicon words pronounced to learn the name -> unit map


class G2PUnavailable(RuntimeError):
    """No libespeak-ng to pronounce new words with."""


def _load_library() -> tuple[ctypes.CDLL, bytes | None]:
    try:
        import espeakng_loader
    except ImportError:
        espeakng_loader = None
    if espeakng_loader is not None:
        return ctypes.CDLL(espeakng_loader.get_library_path()), espeakng_loader.get_data_path().encode()
    try:
        return ctypes.CDLL("libespeak-ng.so.1"), None
    except OSError:
        raise G2PUnavailable(
            "pronouncing new words needs espeak-ng: pip install 'cosystream[vocabulary]' (or apt install "
            "libespeak-ng1)"
        ) from None


class Espeak:
    """espeak-ng's text-to-phoneme conversion (no audio), for one voice. Every instance of a process shares
    the one library (its state is global), under :data:`_LOCK`."""

    def __init__(self, voice: str = "en-us") -> None:
        lib, data = _load_library()
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        with _LOCK:
            if lib.espeak_Initialize(_SYNCHRONOUS, 0, data, 0) < 0:
                raise G2PUnavailable("libespeak-ng failed to initialize")
            if lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise ValueError(f"espeak-ng has no voice {voice!r}")
        self._lib = lib

    def phonemes(self, text: str) -> list[str]:
        """espeak-ng's phoneme names for ``text``, stress and variant marks removed."""
        buf = ctypes.create_string_buffer(text.encode())
        ptr = ctypes.c_void_p(ctypes.addressof(buf))
        names: list[str] = []
        with _LOCK:
            while ptr.value:
                out = self._lib.espeak_TextToPhonemes(ctypes.byref(ptr), _CHARS_UTF8, ord("_") << 8)
                for chunk in (out or b"").decode().split():
                    for name in chunk.split("_"):
                        name = _VARIANT.sub("", _MARKS.sub("", name))
                        if name:
                            names.append(RARE.get(name, name))
        return names


_LOCK = threading.Lock()


class PhonemeSpeller:
    """A new word's spelling in a phoneme model's units: espeak-ng's phonemes through a name -> unit map.
    Spellings are cached per word."""

    def __init__(self, espeak: Espeak, units: dict[str, str], agreement: float = float("nan")) -> None:
        self._espeak = espeak
        self.units = units  # espeak-ng name -> the model's unit
        self.agreement = agreement  # of the sampled lexicon words, the share the G2P spells as the lexicon does
        self._cache: dict[str, str | None] = {}

    @classmethod
    def from_lexicon(
        cls, spellings: Mapping[str, str], espeak: Espeak | None = None, sample: int = SAMPLE_WORDS
    ) -> PhonemeSpeller:
        """The map read off a lexicon (word -> unit string) written by espeak-ng: a spread sample of its words
        pronounced again, each name paired with the unit at its position when both have the same length, the
        most frequent unit kept per name."""
        espeak = espeak or Espeak()
        words = sorted(spellings)
        step = max(1, len(words) // sample)
        sampled = [(w, spellings[w]) for w in words[::step] if w.isalpha()]
        pairs: dict[str, Counter] = {}
        prons = [(espeak.phonemes(w), units) for w, units in sampled]
        for names, units in prons:
            if len(names) == len(units):
                for name, unit in zip(names, units, strict=True):
                    pairs.setdefault(name, Counter())[unit] += 1
        table = {name: counts.most_common(1)[0][0] for name, counts in pairs.items()}
        same = sum("".join(table.get(n, "\0") for n in names) == units for names, units in prons)
        return cls(espeak, table, same / max(1, len(prons)))

    def spell(self, word: str) -> str | None:
        """``word``'s units, or None when espeak-ng gives nothing or a sound the model has no unit for."""
        if word not in self._cache:
            names = self._espeak.phonemes(word)
            spelled = "".join(self.units.get(n, "") for n in names)
            self._cache[word] = spelled if names and all(n in self.units for n in names) else None
        return self._cache[word]
