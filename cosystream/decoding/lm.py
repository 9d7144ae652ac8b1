"""Word n-gram language models in the ARPA format, for CTC beam search.

ARPA is the plain-text back-off format SRILM, KenLM (``lmplz``) and the ``training.lm`` builder write, so
any such model (optionally gzipped) can be plugged in. Probabilities are kept as natural logs.
``score(state, word)`` returns ``(log P(word | state), next_state)``, where a state is the tuple of the
last ``order - 1`` word ids; unknown words score ``<unk>`` (or a floor when the model has none).
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

LN10 = math.log(10.0)
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
_UNK_FLOOR = -30.0 * LN10  # log P of a word unknown to a model without <unk>


class NgramLm:
    """A back-off n-gram model: ``P(w | h) = p(h, w)`` if seen, else ``bow(h) * P(w | h[1:])``."""

    def __init__(
        self,
        order: int,
        words: list[str],
        probs: dict[tuple[int, ...], float],
        backoffs: dict[tuple[int, ...], float],
    ) -> None:
        self.order = order
        self.words = words
        self.ids = {w: i for i, w in enumerate(words)}
        self._probs = probs
        self._backoffs = backoffs
        self.unk = self.ids.get(UNK, -1)
        self.bos = self.ids.get(BOS, -1)
        self.eos = self.ids.get(EOS, -1)
        self._cache: dict[tuple[tuple[int, ...], int], tuple[float, tuple[int, ...]]] = {}

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | Path) -> NgramLm:
        """Read an ARPA file (``.arpa`` or ``.arpa.gz``)."""
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return cls.from_lines(f, source=str(path))

    @classmethod
    def from_lines(cls, lines, source: str = "<arpa>") -> NgramLm:
        counts: dict[int, int] = {}
        words: list[str] = []
        ids: dict[str, int] = {}
        probs: dict[tuple[int, ...], float] = {}
        backoffs: dict[tuple[int, ...], float] = {}
        section = -1  # -1 before \data\, 0 in \data\, n in \n-grams:
        for lineno, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line:
                continue
            if line == "\\data\\":
                section = 0
                continue
            if line == "\\end\\":
                break
            if line.startswith("\\") and line.endswith("-grams:"):
                section = int(line[1:].split("-")[0])
                continue
            if section == 0:
                if line.startswith("ngram "):
                    n, c = line[6:].split("=")
                    counts[int(n)] = int(c)
                continue
            if section <= 0:
                continue
            parts = line.split()
            if len(parts) < section + 1:
                raise ValueError(f"{source}:{lineno}: expected {section} words after the probability")
            try:
                logp = float(parts[0]) * LN10
                bow = float(parts[section + 1]) * LN10 if len(parts) > section + 1 else None
            except ValueError as exc:
                raise ValueError(f"{source}:{lineno}: {exc}") from None
            key = []
            for w in parts[1 : section + 1]:
                i = ids.get(w)
                if i is None:
                    i = ids[w] = len(words)
                    words.append(w)
                key.append(i)
            k = tuple(key)
            probs[k] = logp
            if bow is not None:
                backoffs[k] = bow
        if not counts or not probs:
            raise ValueError(f"{source}: not an ARPA file (no \\data\\ section or no n-grams)")
        return cls(max(counts), words, probs, backoffs)

    # ------------------------------------------------------------------ scoring

    def start(self) -> tuple[int, ...]:
        """The state at the start of a sentence (after ``<s>``)."""
        return (self.bos,) if self.bos >= 0 and self.order > 1 else ()

    def _logp(self, history: tuple[int, ...], word: int) -> float:
        bow = 0.0
        probs, backoffs = self._probs, self._backoffs
        while True:
            p = probs.get((*history, word))
            if p is not None:
                return bow + p
            if not history:
                return bow + _UNK_FLOOR
            bow += backoffs.get(history, 0.0)
            history = history[1:]

    def score(self, state: tuple[int, ...], word: str | int) -> tuple[float, tuple[int, ...]]:
        """``(ln P(word | state), next state)``; ``word`` is a string or an id from :attr:`ids`."""
        w = word if isinstance(word, int) else self.ids.get(word, self.unk)
        key = (state, w)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if w < 0:
            result = (_UNK_FLOOR, ())
        else:
            nxt = ((*state, w))[-(self.order - 1) :] if self.order > 1 else ()
            # Shorten the state to the longest suffix the model has seen as a context.
            while nxt and nxt not in self._backoffs:
                nxt = nxt[1:]
            result = (self._logp(state, w), nxt)
        if len(self._cache) < 2_000_000:
            self._cache[key] = result
        return result

    def end(self, state: tuple[int, ...]) -> float:
        """``ln P(</s> | state)`` (0 when the model has no end-of-sentence token)."""
        return self.score(state, self.eos)[0] if self.eos >= 0 else 0.0

    def known(self, word: str) -> bool:
        return word in self.ids and word not in (BOS, EOS, UNK)
