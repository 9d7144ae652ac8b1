"""Which CTC decoder a server's sessions use, and building one per utterance stream.

``greedy`` reads each frame's best token; ``beam`` runs a lexicon-constrained prefix beam search against a
word n-gram language model (ARPA). ``auto`` picks ``beam`` when the model directory ships a
``lm.arpa.gz`` (the default model does) or ``--lm`` names one, else ``greedy``. The beam search is the
Python :class:`~cosystream.decoding.beam.BeamCtcDecoder` by default; ``search="flashlight"`` (or ``auto``:
flashlight when installed) runs the compiled :class:`~cosystream.decoding.flashlight.FlashlightCtcDecoder`
(flashlight-text with KenLM: 3-5x less decoding time at the same WER offline, but served no cheaper than
the Python search so far, docs/PERFORMANCE.md); :attr:`DecoderConfig.search` chooses. A model whose tokens
are phonemes ships its pronunciation lexicon, ``lexicon.tsv.gz``: the beam search spells words by it, and
``greedy`` is refused (it would print phonemes; ``--beam-size`` is the way to a cheaper search). The
application resolves the choice once per served model and hands them to the frontends; the engine is only
told :attr:`DecoderConfig.top_k`, the token candidates per frame to send.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from cosystream.decoding import flashlight
from cosystream.decoding.beam import BeamConfig, BeamCtcDecoder
from cosystream.decoding.flashlight import FlashlightCtcDecoder, FlashlightLexicon
from cosystream.decoding.g2p import G2PUnavailable, PhonemeSpeller
from cosystream.decoding.greedy import CtcDecoder
from cosystream.decoding.lexicon import Lexicon, read_spellings
from cosystream.decoding.lm import NgramLm
from cosystream.decoding.phrases import Boosting, Phrase, PhraseError
from cosystream.frames import FRAME_MS
from cosystream.model_files import DEFAULT_MODEL_DIR, LEXICON_FILE

log = logging.getLogger(__name__)

LM_FILE = "lm.arpa.gz"
DECODERS = ("auto", "greedy", "beam")
SEARCHES = ("auto", "flashlight", "python")  # which beam search: auto is flashlight when it is installed
BEAM_TOP_K = 8  # token candidates per frame the engine sends for beam search
BOOSTINGS_CACHED = 256  # sessions' phrase lists kept built per model (sessions sending the same list share it)


def _installed_search() -> str:
    return "flashlight" if flashlight.available() else "python"


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    kind: str = "auto"  # auto | greedy | beam
    lm_path: str | None = None  # None: the model directory's lm.arpa.gz
    beam: BeamConfig = field(default_factory=BeamConfig)
    lexicon_path: str | None = None  # set by resolve(): the model's pronunciation lexicon, if it has one
    # auto | flashlight | python: the beam search's implementation. python until the compiled search is cheaper
    # served (docs/PERFORMANCE.md: 3-5x faster offline, but its memory is cold at every push of a served
    # session, and per push it still costs more than the Python search).
    search: str = "python"

    def __post_init__(self) -> None:
        if self.kind not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {self.kind!r}")
        if self.search not in SEARCHES:
            raise ValueError(f"beam search must be one of {', '.join(SEARCHES)}, got {self.search!r}")

    def resolve(self, model_path: str | None) -> DecoderConfig:
        """Settle ``auto`` (the kind and the search) and the language model path for the model at ``model_path``."""
        lm = self.lm_path
        if lm is None:
            candidate = Path(model_path or DEFAULT_MODEL_DIR) / LM_FILE
            lm = str(candidate) if candidate.is_file() else None
        elif not Path(lm).is_file():
            raise ValueError(f"language model {lm}: no such file")
        lexicon = Path(model_path or DEFAULT_MODEL_DIR) / LEXICON_FILE
        lexicon_path = str(lexicon) if lexicon.is_file() else None
        kind = self.kind
        if kind == "auto":
            kind = "beam" if lm else "greedy"
        if kind == "beam" and lm is None:
            raise ValueError("beam decoding needs a language model: pass --lm or add lm.arpa.gz to the model")
        if lexicon_path is not None and lm is None:
            raise ValueError(
                f"this model's tokens are phonemes ({LEXICON_FILE}): decoding them into words needs a language "
                "model: pass --lm or add lm.arpa.gz to the model"
            )
        if kind == "greedy" and lexicon_path is not None:
            raise ValueError(
                f"this model's tokens are phonemes ({LEXICON_FILE}): greedy decoding would print phonemes, not "
                "words; use --decoder beam (a smaller --beam-size is cheaper)"
            )
        search = self.search
        if search == "flashlight" and not flashlight.available():
            raise ValueError("the flashlight beam search needs flashlight-text: pip install flashlight-text")
        if search == "auto":
            search = _installed_search()
        return dataclasses.replace(
            self, kind=kind, lm_path=lm if kind == "beam" else None, lexicon_path=lexicon_path, search=search
        )

    @property
    def top_k(self) -> int:
        return BEAM_TOP_K if self.kind == "beam" else 1

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "lm_path": self.lm_path,
            "beam": dataclasses.asdict(self.beam),
            "lexicon_path": self.lexicon_path,
            "search": self.search,
        }

    @classmethod
    def from_dict(cls, data: dict) -> DecoderConfig:
        beam = BeamConfig(**data.get("beam", {}))
        given = {name: data[name] for name in ("lm_path", "lexicon_path", "search") if name in data}
        return cls(data["kind"], beam=beam, **given)  # (a field left out keeps its default)


class DecoderFactory:
    """Makes a fresh decoder for each stream; the language model and lexicon are loaded once and shared."""

    def __init__(self, config: DecoderConfig, vocabulary: list[str]) -> None:
        if config.kind == "auto":
            raise ValueError("resolve() the decoder config first")
        if config.search == "auto":
            config = dataclasses.replace(config, search=_installed_search())
        self.config = config
        self.vocabulary = list(vocabulary)
        self.lm: NgramLm | None = None
        self.lexicon: Lexicon | FlashlightLexicon | None = None
        self._speller: PhonemeSpeller | None = None
        self._speller_lock = threading.Lock()
        self._python: tuple[NgramLm, Lexicon] | None = None  # the Python search's, for boosted sessions
        self._python_lock = threading.Lock()
        self._named: dict[str, Boosting] = {}  # named vocabularies, built once (under their lock)
        self._named_lock = threading.Lock()
        # (vocabulary name, phrases) -> what they built: the last BOOSTINGS_CACHED asked
        self._built: OrderedDict[tuple, Boosting] = OrderedDict()
        self._built_lock = threading.Lock()
        if config.kind == "beam":
            started = time.perf_counter()
            spellings = read_spellings(config.lexicon_path) if config.lexicon_path else None
            if config.search == "flashlight":
                self.lexicon = FlashlightLexicon(config.lm_path, self.vocabulary, spellings)
            else:
                self.lm = NgramLm.load(config.lm_path)
                self.lexicon = Lexicon.from_lm(self.lm, self.vocabulary, spellings)
            log.info(
                "beam decoding (%s) with %s: %d words, loaded in %.1f s",
                config.search,
                config.lm_path,
                self.lexicon.size,
                time.perf_counter() - started,
            )

    @property
    def can_boost(self) -> bool:
        """Whether :meth:`boosting` can be asked (beam search: a boosted session runs the Python search, which
        has the phrases' lexicon and context graph, also where the others run flashlight's)."""
        return self.config.kind == "beam"

    def _cannot_boost(self) -> PhraseError:
        return PhraseError(
            "phrases need beam search: this server decodes this model greedily (serve --decoder beam)"
        )

    def _python_search(self) -> tuple[NgramLm, Lexicon]:
        """The Python search's language model and lexicon: this factory's, or, where it runs the flashlight
        search, loaded the first time a session boosts (seconds: the default model's in 3.6 s). Blocking."""
        if self._python is None:
            with self._python_lock:
                if self._python is None:
                    if isinstance(self.lexicon, Lexicon):
                        self._python = (self.lm, self.lexicon)
                    else:
                        started = time.perf_counter()
                        spellings = read_spellings(self.config.lexicon_path) if self.config.lexicon_path else None
                        lm = NgramLm.load(self.config.lm_path)
                        self._python = (lm, Lexicon.from_lm(lm, self.vocabulary, spellings))
                        log.info(
                            "the Python beam search for sessions with phrases (flashlight's has no phrase "
                            "boosting): %s loaded in %.1f s",
                            self.config.lm_path,
                            time.perf_counter() - started,
                        )
        return self._python

    def _spell(self):
        """The G2P's speller for a phoneme model (None for a model spelled by letters)."""
        lexicon = self._python_search()[1]
        if lexicon.spelled:
            return None
        with self._speller_lock:
            if self._speller is None:
                try:
                    self._speller = PhonemeSpeller.from_lexicon(lexicon.words)
                except G2PUnavailable as err:
                    raise PhraseError(f"phrases with words the model does not know: {err}") from None
                log.info(
                    "G2P (espeak-ng) for new words: %d phonemes mapped, %.1f%% of sampled lexicon words "
                    "pronounced as the lexicon has them",
                    len(self._speller.units),
                    100 * self._speller.agreement,
                )
        return self._speller.spell

    def named(self, name: str, phrases: tuple[Phrase, ...]) -> Boosting:
        """The named vocabulary ``name`` (its ``phrases``: ``serve --vocabulary``) built for this model, once;
        phrases whose words the model cannot spell are left out and logged. Blocking: call it off the event
        loop."""
        if not self.can_boost:
            raise self._cannot_boost()
        with self._named_lock:
            built = self._named.get(name)
            if built is None:
                started = time.perf_counter()
                lm, lexicon = self._python_search()
                built = Boosting.build(phrases, lexicon, lm, self.config.beam.alpha, self._spell(), skip=True)
                log.info(
                    "vocabulary %s: %d phrases built in %.2f s%s",
                    name,
                    len(built.phrases),
                    time.perf_counter() - started,
                    f"; {len(built.dropped)} left out, the model cannot spell them: "
                    + ", ".join(repr(p) for p in built.dropped[:10])
                    + (" ..." if len(built.dropped) > 10 else "")
                    if built.dropped
                    else "",
                )
                self._named[name] = built
        return built

    def cached(self, phrases: tuple[Phrase, ...], vocabulary: tuple[str, tuple[Phrase, ...]] | None = None):
        """What :meth:`boosting` built for these arguments, if it still holds it (never blocks); else None."""
        if not phrases:
            return None if vocabulary is None else self._named.get(vocabulary[0])
        return self._built.get((vocabulary[0] if vocabulary else None, phrases))

    def boosting(
        self, phrases: tuple[Phrase, ...], vocabulary: tuple[str, tuple[Phrase, ...]] | None = None
    ) -> Boosting:
        """A session's phrase boosting (its lexicon with the new words, pronounced by the G2P for a phoneme
        model, and its context graph), on the named ``vocabulary`` ((name, phrases)) if it names one; raises
        :class:`PhraseError` saying why not. Sessions asking for the same are given the same (it is read-only).
        Blocking (the G2P): call it off the event loop."""
        if not self.can_boost:
            raise self._cannot_boost()
        base = None if vocabulary is None else self.named(*vocabulary)
        if not phrases:
            return base
        key = (vocabulary[0] if vocabulary else None, phrases)
        with self._built_lock:
            built = self._built.get(key)
            if built is not None:
                self._built.move_to_end(key)
                return built
        # (built outside the lock: two sessions asking for the same at once may both build it, and one is kept)
        lm, lexicon = self._python_search()
        built = Boosting.build(phrases, lexicon, lm, self.config.beam.alpha, self._spell(), base)
        with self._built_lock:
            self._built[key] = built
            while len(self._built) > BOOSTINGS_CACHED:
                self._built.popitem(last=False)
        return built

    def __call__(self, boosting: Boosting | None = None) -> CtcDecoder | BeamCtcDecoder | FlashlightCtcDecoder:
        """A fresh decoder; ``boosting`` (from :meth:`boosting`): the session's phrases (the Python search)."""
        if boosting is not None:
            lm = self._python_search()[0]
            return BeamCtcDecoder(self.vocabulary, lm, boosting.lexicon, self.config.beam, FRAME_MS, boosting)
        if isinstance(self.lexicon, FlashlightLexicon):
            return FlashlightCtcDecoder(self.vocabulary, self.lexicon, self.config.beam, FRAME_MS)
        if self.lm is None:
            return CtcDecoder(self.vocabulary, FRAME_MS)
        return BeamCtcDecoder(self.vocabulary, self.lm, self.lexicon, self.config.beam, FRAME_MS, boosting)
