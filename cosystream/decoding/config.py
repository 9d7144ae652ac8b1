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
from cosystream.models.loading import DEFAULT_MODEL_DIR, LEXICON_FILE

log = logging.getLogger(__name__)

LM_FILE = "lm.arpa.gz"
DECODERS = ("auto", "greedy", "beam")
SEARCHES = ("auto", "flashlight", "python")  # which beam search: auto is flashlight when it is installed
BEAM_TOP_K = 8  # token candidates per frame the engine sends for beam search


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
        return cls(data["kind"], data.get("lm_path"), beam, data.get("lexicon_path"), data.get("search", "auto"))


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
        """Whether :meth:`boosting` can be asked (the Python beam search)."""
        return self.lm is not None and isinstance(self.lexicon, Lexicon)

    def boosting(self, phrases: tuple[Phrase, ...]) -> Boosting:
        """A session's phrase boosting (its lexicon with the new words, pronounced by the G2P for a phoneme
        model, and its context graph); raises :class:`PhraseError` saying why not. Blocking (the G2P): call it
        off the event loop."""
        if not self.can_boost:
            how = (
                "greedy decoding (serve --decoder beam)"
                if self.config.kind == "greedy"
                else "the flashlight search"
            )
            raise PhraseError(f"phrases need the Python beam search: this server decodes this model with {how}")
        spell = None
        if not self.lexicon.spelled:
            with self._speller_lock:
                if self._speller is None:
                    try:
                        self._speller = PhonemeSpeller.from_lexicon(self.lexicon.words)
                    except G2PUnavailable as err:
                        raise PhraseError(f"phrases with words the model does not know: {err}") from None
                    log.info(
                        "G2P (espeak-ng) for new words: %d phonemes mapped, %.1f%% of sampled lexicon words "
                        "pronounced as the lexicon has them",
                        len(self._speller.units),
                        100 * self._speller.agreement,
                    )
            spell = self._speller.spell
        return Boosting.build(phrases, self.lexicon, self.lm, self.config.beam.alpha, spell)

    def __call__(self, boosting: Boosting | None = None) -> CtcDecoder | BeamCtcDecoder | FlashlightCtcDecoder:
        """A fresh decoder; ``boosting`` (from :meth:`boosting`): the session's phrases."""
        if isinstance(self.lexicon, FlashlightLexicon):
            return FlashlightCtcDecoder(self.vocabulary, self.lexicon, self.config.beam, FRAME_MS)
        if self.lm is None:
            return CtcDecoder(self.vocabulary, FRAME_MS)
        return BeamCtcDecoder(self.vocabulary, self.lm, self.lexicon, self.config.beam, FRAME_MS, boosting)
