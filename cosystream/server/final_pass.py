"""One session's second pass: the current utterance's audio kept, sent to the second pass when it ends,
and its answer put into the final.

The session keeps every 16 kHz frame it forwards for the utterance (its pre-roll included, the end-of-
utterance silence not), at most :data:`MAX_AUDIO_S` of it (1.9 MB); a longer utterance (a client may ask for
up to 600 s) keeps its streaming final: Whisper would take longer than any deadline on it. When the utterance ends its
final waits (the next utterance's SPEECH_STARTED waits behind it, as behind any final) until the second pass
answers, its deadline passes, or it fails; then the final is sent with Whisper's text, or with the streaming
text when the answer is gated, late or missing. ``final_pass`` on the result says which.

Word times: Whisper's text comes with no times of its own here. When it has as many words as the streaming
final, each word keeps the streaming word's times; otherwise the words are spread over the utterance's span
in proportion to their length (a forced alignment of Whisper's words is a later step).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np

from cosystream.secondpass.whisper import SecondPassResult
from cosystream.secondpass.worker import SecondPass
from cosystream.v1 import cosystream_pb2 as pb

log = logging.getLogger(__name__)

STREAMING, SECOND_PASS = "streaming", "second_pass"
MAX_AUDIO_S = 60
_IDLE, _WAITING, _ANSWERED = 0, 1, 2


class FinalPass:
    """A session's link to the frontend's :class:`SecondPass`. ``on_answer`` is called (on the loop) when an
    answer came for the final that waits: the session then sends it."""

    __slots__ = (
        "_answer",
        "_chunks",
        "_frames",
        "_state",
        "key",
        "max_frames",
        "on_answer",
        "punctuation",
        "realtime",
        "second",
    )

    def __init__(
        self,
        second: SecondPass,
        key: int,
        realtime: bool,
        max_frames: int,
        on_answer: Callable[[], None],
        punctuation: bool = False,
    ):
        """``punctuation``: finals keep Whisper's own writing (capitals, punctuation, digits)."""
        self.second, self.key, self.realtime, self.max_frames = second, key, realtime, max_frames
        self.on_answer = on_answer
        self.punctuation = punctuation
        self._chunks: list[np.ndarray] = []
        self._frames = 0
        self._state = _IDLE
        self._answer: SecondPassResult | None = None

    def keep(self, frames: np.ndarray) -> None:
        """Frames (float, ``(n, 160)``) forwarded for the current utterance; past ``max_frames`` the
        utterance's audio is let go (its final is the streaming one)."""
        if self._frames + len(frames) > self.max_frames:
            self._chunks.clear()
            self._frames = self.max_frames + 1  # (over: nothing more is kept until the next utterance)
            return
        self._chunks.append((np.clip(frames, -1, 1 - 1 / 32768) * 32768).astype(np.int16).reshape(-1))
        self._frames += len(frames)

    def ready(self, index: int) -> bool:
        """Whether utterance ``index``'s final may be sent now; the first call submits its audio (False: it
        waits for :attr:`on_answer`)."""
        if self._state == _ANSWERED:
            return True
        if self._state == _WAITING:
            return False
        audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        over = self._frames > self.max_frames
        self._chunks.clear()
        self._frames = 0
        if len(audio) and not over and self.second.submit(self.key, index, audio, self.realtime, self._answered):
            self._state = _WAITING
            return False
        self._state = _ANSWERED  # (refused, too long, or nothing heard: the streaming final now)
        return True

    def _answered(self, result: SecondPassResult | None) -> None:
        self._state, self._answer = _ANSWERED, result
        self.on_answer()

    def apply(self, result: pb.StreamingResult) -> None:
        """Put the answer into ``result`` (a final with the streaming model's text) and get ready for the
        next utterance."""
        answer, self._answer, self._state = self._answer, None, _IDLE
        if answer is None or answer.gated or not answer.text:
            result.final_pass = STREAMING
            if answer is not None and answer.gated:
                log.debug("second pass gated (%s): the streaming final stands", answer.gated)
            return
        result.final_pass = SECOND_PASS
        result.transcript = answer.written if self.punctuation else answer.text
        result.confidence = math.exp(min(0.0, answer.avg_logprob))
        if result.words:
            words = result.transcript.split()
            streamed = list(result.words)
            del result.words[:]
            if len(words) == len(streamed):
                spans = [(w.start_ms, w.end_ms) for w in streamed]
            else:
                spans = spread(words, result.start_ms, result.end_ms)
            result.words.extend(
                pb.WordInfo(word=word, start_ms=start, end_ms=end, confidence=result.confidence)
                for word, (start, end) in zip(words, spans, strict=True)
            )

    def close(self) -> None:
        """The session closed: its waiting job is dropped unrun."""
        self._chunks.clear()
        if self._state == _WAITING:
            self.second.cancel(self.key)
        self._state = _IDLE


def spread(words: list[str], start_ms: int, end_ms: int) -> list[tuple[int, int]]:
    """Word spans over ``[start_ms, end_ms]`` in proportion to each word's length (plus one for the space)."""
    weights = [len(w) + 1 for w in words]
    total = sum(weights) or 1
    span_ms = max(0, end_ms - start_ms)
    spans, at = [], 0
    for weight in weights:
        spans.append((start_ms + span_ms * at // total, start_ms + span_ms * (at + weight) // total))
        at += weight
    return spans
