"""Incremental greedy CTC decoding of the model's per-frame token ids into words.

The engine returns, per forwarded frame, the most likely token ids and their log-probabilities, best
first; greedy decoding reads only the best.
Greedy CTC collapses repeated ids, then drops blanks (so "a a" is one "a" but
"a <blank> a" is two). Each push costs O(frames pushed): the transcript and word list
grow incrementally and nothing already decoded is revisited.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

# Below this many frames per push a plain Python loop beats numpy's per-call overhead.
_SMALL_PUSH_FRAMES = 32


@dataclass(slots=True, frozen=True)
class Word:
    """A decoded word; times are ms from stream start, ``end_ms`` exclusive."""

    word: str
    start_ms: int
    end_ms: int
    confidence: float


MAX_ALTERNATIVES = 10
"""The most n-best alternatives a final may ask for (StreamingConfig.max_alternatives)."""


@dataclass(slots=True, frozen=True)
class Alternative:
    """One of a final's n best word sequences: its words and a 0..1 confidence (best first in a list)."""

    words: tuple[Word, ...]
    confidence: float

    @property
    def text(self) -> str:
        return " ".join(w.word for w in self.words)


def ranked_alternatives(
    scored: list[tuple[float, tuple[Word, ...]]], top_confidence: float, n: int
) -> list[Alternative]:
    """The ``n`` best distinct word sequences of ``(score in nats, words)`` pairs, best first. The best gets
    ``top_confidence``; each other that times ``exp(its score - the best's)``."""
    seen: set[tuple[str, ...]] = set()
    out: list[Alternative] = []
    best = None
    for score, words in sorted(scored, key=lambda s: -s[0]):
        key = tuple(w.word for w in words)
        if key in seen:
            continue
        seen.add(key)
        if best is None:
            best = score
        out.append(Alternative(tuple(words), top_confidence * math.exp(min(0.0, score - best))))
        if len(out) >= n:
            break
    return out


class CtcDecoder:
    """Greedy CTC decoder for one utterance at a time.

    ``vocabulary[0]`` is the blank, the entry ``" "`` (if present) separates words, and
    every other entry is text appended to the current word. A word spans from the frame of
    its first emitted token to one past the frame of its last, and its confidence is
    ``exp(mean log-probability)`` of its emitted tokens (word separators and blanks excluded).
    """

    # Greedy output only grows: an interim transcript is a prefix of every later one.
    stable_interims = True

    __slots__ = (
        "_blank_id",
        "_committed",
        "_cur_chars",
        "_cur_end",
        "_cur_logprob",
        "_cur_start",
        "_next_frame",
        "_prev_id",
        "_space_id",
        "_text_cache",
        "_total_count",
        "_total_logprob",
        "_vocab",
        "_words",
        "frame_ms",
    )

    def __init__(self, vocabulary: list[str], frame_ms: int = 10) -> None:
        if len(vocabulary) < 2:
            raise ValueError("vocabulary needs the blank at index 0 and at least one symbol")
        if frame_ms <= 0:
            raise ValueError(f"frame_ms must be positive, got {frame_ms}")
        self._vocab = list(vocabulary)
        self._blank_id = 0
        self._space_id = self._vocab.index(" ") if " " in self._vocab[1:] else -1
        self.frame_ms = frame_ms
        self.reset()

    def reset(self) -> None:
        """Forget the transcript and start a new utterance."""
        self._prev_id = self._blank_id
        self._next_frame = -1
        self._words: list[Word] = []
        self._committed = ""  # finished words joined by spaces
        self._cur_chars: list[str] = []
        self._cur_start = 0
        self._cur_end = 0
        self._cur_logprob = 0.0
        self._total_logprob = 0.0
        self._total_count = 0
        self._text_cache: str | None = ""

    def push(self, ids: np.ndarray, logprobs: np.ndarray, first_frame: int) -> bool:
        """Add per-frame argmax ``ids`` and their ``logprobs`` for frames starting at ``first_frame``.

        ``[frames]`` arrays, or ``[frames, K]`` candidates best first (only the first column is read).

        Frames must arrive in order; if ``first_frame`` is not the frame after the last one
        pushed (a gap), the previous id does not merge with the first new one.
        Returns True if the transcript changed.
        """
        ids = np.asarray(ids)
        logprobs = np.asarray(logprobs)
        if ids.ndim == 2 and logprobs.shape == ids.shape:
            ids, logprobs = ids[:, 0], logprobs[:, 0]
        n = len(ids)
        if ids.ndim != 1 or logprobs.shape != ids.shape:
            raise ValueError(f"ids {ids.shape} and logprobs {logprobs.shape} must be equal-length 1-D")
        if n == 0:
            return False
        if first_frame != self._next_frame:
            self._prev_id = self._blank_id
        if n <= _SMALL_PUSH_FRAMES:
            emitted, toks, lps = self._emitted_small(ids.tolist(), logprobs.tolist())
        else:
            emitted, toks, lps = self._emitted_large(ids, logprobs)
        self._next_frame = first_frame + n
        if not emitted:
            return False

        vocab = self._vocab
        space = self._space_id
        frame_ms = self.frame_ms
        for pos, tok, lp in zip(emitted, toks, lps, strict=True):
            if tok == space:
                self._close_word()
                continue
            frame = first_frame + pos
            if not self._cur_chars:
                self._cur_start = frame * frame_ms
                self._cur_logprob = 0.0
            self._cur_chars.append(vocab[tok])
            self._cur_end = (frame + 1) * frame_ms
            self._cur_logprob += lp
            self._total_logprob += lp
            self._total_count += 1
        self._text_cache = None
        return True

    def _emitted_small(self, ids: list[int], logprobs: list[float]) -> tuple[list[int], list[int], list[float]]:
        """Positions, ids and logprobs of emitted tokens, in plain Python (cheapest for a few frames)."""
        vocab_size, blank, prev = len(self._vocab), self._blank_id, self._prev_id
        emitted: list[int] = []
        for pos, tok in enumerate(ids):
            if tok != prev and tok != blank:
                if not 0 <= tok < vocab_size:
                    raise ValueError(f"token ids must be in [0, {vocab_size}), got {tok}")
                emitted.append(pos)
            prev = tok
        self._prev_id = prev
        return emitted, [ids[p] for p in emitted], [logprobs[p] for p in emitted]

    def _emitted_large(self, ids: np.ndarray, logprobs: np.ndarray) -> tuple[list[int], list[int], list[float]]:
        """Same as :meth:`_emitted_small`, vectorised for long pushes."""
        if ids.min() < 0 or ids.max() >= len(self._vocab):
            raise ValueError(f"token ids must be in [0, {len(self._vocab)}), got {ids.min()}..{ids.max()}")
        prev = np.empty_like(ids)
        prev[0] = self._prev_id
        prev[1:] = ids[:-1]
        self._prev_id = int(ids[-1])
        emitted = np.flatnonzero((ids != prev) & (ids != self._blank_id))
        return emitted.tolist(), ids[emitted].tolist(), logprobs[emitted].tolist()

    def _close_word(self) -> None:
        if not self._cur_chars:
            return
        word = self._current_word()
        self._words.append(word)
        self._committed = f"{self._committed} {word.word}" if self._committed else word.word
        self._cur_chars.clear()

    def _current_word(self) -> Word:
        count = len(self._cur_chars)
        return Word(
            "".join(self._cur_chars),
            self._cur_start,
            self._cur_end,
            math.exp(self._cur_logprob / count),
        )

    def finalize(self) -> None:
        """The utterance has ended (greedy output needs no rescoring)."""

    def alternatives(self, n: int) -> list[Alternative]:
        """After :meth:`finalize`: greedy decoding has one hypothesis, whatever ``n``."""
        return [Alternative(tuple(self.words()), self.confidence)]

    @property
    def text(self) -> str:
        """Transcript so far: words joined by single spaces."""
        if self._text_cache is None:
            partial = "".join(self._cur_chars)
            if partial and self._committed:
                self._text_cache = f"{self._committed} {partial}"
            else:
                self._text_cache = self._committed or partial
        return self._text_cache

    def words(self) -> list[Word]:
        """Finished words plus the word in progress, if any."""
        if self._cur_chars:
            return [*self._words, self._current_word()]
        return list(self._words)

    @property
    def confidence(self) -> float:
        """exp(mean log-probability) over all emitted word tokens; 0.0 while nothing is decoded."""
        if self._total_count == 0:
            return 0.0
        return math.exp(self._total_logprob / self._total_count)
