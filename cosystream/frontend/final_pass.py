"""One session's second pass: each utterance's audio kept, sent to the second pass when it ends, and its
answer put into that utterance's final.

The session keeps every 16 kHz frame it forwards for the utterance (its pre-roll included, the end-of-
utterance silence not), at most :data:`MAX_AUDIO_S` of it (1.9 MB); a longer utterance (a client may ask for
up to 600 s) keeps its streaming final: Whisper would take longer than any deadline on it. When the utterance
ends, its streaming final is built and held until the second pass answers, its deadline passes, or it fails;
then it is sent with Whisper's text, or with the streaming text when the answer is gated, late or missing.
``final_pass`` on the result says which. The stream does not wait meanwhile: the next utterance's frames go
to the engine as they come, and only its responses queue behind the held final (``Session``), so a slow
second pass delays what a client sees by at most one deadline, never cumulatively. On a REALTIME stream not
even that for interims: the next utterance's first interim gives the held final up (:meth:`FinalPass.give_up`:
sent with the streaming text, its job dropped), unless the server says finals hold the next utterance
(``serve --final-holds-next``).

Early reads: the endpoint comes only after ``silence_ms`` of silence (500 ms by default), and the second
pass's read of the utterance, started then, holds its final (and whatever follows it) for the read's time on
top. So once the speech has been followed by some silence (``early_ms``, or more where the read's measured
cost fits in what is left of ``silence_ms``) the session reads the utterance early (:meth:`FinalPass.early`)
if the worker has nothing else to do: the read runs during the endpoint's silence, and when the utterance
ends on that pause its final has its answer already, or sooner. Speech again (a pause, not an end) drops the
read, and the utterance is read again at its end or next pause. Only an idle worker takes one, so an early
read never queues before another utterance's final: at most it is running when one comes.

Word times (for streams that ask for them): from Whisper's own alignment of its words to the audio (its
cross-attention alignment heads: ``WhisperTranscriber``), each written word's span shared by the spoken
words it becomes ("25" -> "twenty five"); where that cannot be had (no alignment, or the spoken words of
the parts differ from those of the whole), the words are spread over the utterance's span in proportion to
their length.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np

from cosystream.decoding.text import spoken_form
from cosystream.frames import FRAME_MS
from cosystream.frontend.results import Alternative, Result, Word
from cosystream.secondpass.whisper import SecondPassResult
from cosystream.secondpass.worker import SecondPass

log = logging.getLogger(__name__)

STREAMING, SECOND_PASS = "streaming", "second_pass"
MAX_AUDIO_S = 60
EARLY_MARGIN_FRAMES = 5
"""An early read starts this much (50 ms) before the endpoint less its measured cost: the estimate's slack."""


class FinalPass:
    """A session's link to the frontend's :class:`SecondPass`. ``on_answer`` is called (on the loop) each
    time an answer (or its absence) came for a held final: the session then sends what it can."""

    __slots__ = (
        "_chunks",
        "_early",
        "_frames",
        "_waiting",
        "early_ms",
        "holds_next",
        "hotwords",
        "key",
        "max_frames",
        "on_answer",
        "punctuation",
        "realtime",
        "second",
        "word_times",
    )

    def __init__(
        self,
        second: SecondPass,
        key: int,
        realtime: bool,
        max_frames: int,
        on_answer: Callable[[], None],
        punctuation: bool = False,
        word_times: bool = False,
        hotwords: str = "",
        early_ms: int = 0,
        holds_next: bool = False,
    ):
        """``punctuation``: finals keep Whisper's own writing (capitals, punctuation, digits); ``word_times``:
        the stream asked for word time offsets (its finals get Whisper's words, timed); ``hotwords``: the
        session's phrases, which Whisper is told to expect; ``early_ms``: silence after speech from which an
        utterance may be read early (:meth:`early_after_frames`), 0: never; ``holds_next``: a held final holds
        back the next utterance's interims until it is answered (else, on a REALTIME stream, the session gives it
        up: :meth:`give_up`)."""
        self.early_ms, self.holds_next = early_ms, holds_next or not realtime
        self._early: _Early | None = None  # the open utterance's early read
        self.hotwords = hotwords
        self.second, self.key, self.realtime, self.max_frames = second, key, realtime, max_frames
        self.on_answer = on_answer
        self.punctuation, self.word_times = punctuation, word_times
        self._chunks: list[np.ndarray] = []
        self._frames = 0
        self._waiting = 0  # jobs submitted and not answered yet

    def keep(self, frames: np.ndarray) -> None:
        """Frames (float, ``(n, 160)``) forwarded for the current utterance; past ``max_frames`` the
        utterance's audio is let go (its final is the streaming one)."""
        if self._frames + len(frames) > self.max_frames:
            self._chunks.clear()
            self._frames = self.max_frames + 1  # (over: nothing more is kept until the next utterance)
            return
        self._chunks.append((np.clip(frames, -1, 1 - 1 / 32768) * 32768).astype(np.int16).reshape(-1))
        self._frames += len(frames)

    def early_after_frames(self, utterance_frames: int, silence_frames: int) -> int | None:
        """Frames of silence after an utterance's speech (``utterance_frames`` long so far; the endpoint comes
        after ``silence_frames``) from which it is read early: ``early_ms``, or later while the read's measured
        cost still fits before the endpoint. None: not early (off, a BATCH stream, whose finals may wait and
        whose reads must not make a REALTIME final wait, or the utterance is over the cap)."""
        if not self.early_ms or not self.realtime or self._frames > self.max_frames:
            return None
        read_frames = math.ceil(self.second.predict_s(utterance_frames * FRAME_MS / 1000) * 1000 / FRAME_MS)
        return max(self.early_ms // FRAME_MS, silence_frames - read_frames - EARLY_MARGIN_FRAMES)

    def early(self, index: int) -> None:
        """Utterance ``index`` paused (the frames kept so far end in silence): read it now if the worker is
        idle. Its answer is the final's if the utterance ends before more speech (:meth:`take`)."""
        if self._early is not None or not self._chunks or self._frames > self.max_frames:
            return
        early = _Early(index)

        def answered(answer: SecondPassResult | None) -> None:
            early.answered, early.answer = True, answer
            if early.held is not None:
                self._deliver(early.held, answer)

        audio = np.concatenate(self._chunks)
        early.job = self.second.submit(
            self.key, index, audio, self.realtime, answered, self.word_times, self.hotwords, early=True
        )
        if early.job is not None:
            self._early = early

    def speech_again(self) -> None:
        """The utterance read early went on: the read is dropped."""
        if self._early is not None:
            self.second.early_ended(self._early.job, kept=False)
            self._early = None

    def take(self, index: int, result: Result, audio_start_ms: int = 0) -> Held | None:
        """Utterance ``index`` ended and ``result`` is its streaming final: submit its audio, whose first sample
        is at ``audio_start_ms`` in the stream (or keep its early read, when it ended on that pause). Returns
        the held final (send it once :attr:`Held.answered`: it may be already), or None when it may be sent now
        (refused, too long, or nothing heard: the streaming final)."""
        audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        over = self._frames > self.max_frames
        self._chunks.clear()
        self._frames = 0
        early, self._early = self._early, None
        if early is not None and (early.index != index or not len(audio) or over):  # (not this final's read)
            self.second.early_ended(early.job, kept=False)
            early = None
        if not len(audio) or over:
            return None
        held = Held(result, self.punctuation, audio_start_ms, self.word_times)
        if early is not None:
            self.second.early_ended(early.job, kept=True)
            held.job = early.job
            if early.answered:
                held.answer(early.answer)
            else:
                early.held = held
                self._waiting += 1
            return held

        held.job = self.second.submit(
            self.key,
            index,
            audio,
            self.realtime,
            lambda answer: self._deliver(held, answer),
            self.word_times,
            self.hotwords,
        )
        if held.job is None:
            return None
        self._waiting += 1
        return held

    def _deliver(self, held: Held, answer: SecondPassResult | None) -> None:
        """The answer (or its absence) for ``held``, a final waiting for it: the session sends what it can."""
        self._waiting -= 1
        held.answer(answer)
        self.on_answer()

    def give_up(self, held: Held) -> None:
        """Send ``held`` with the streaming text now (the next utterance has results to show, and a held final
        holds them back): its job is dropped, a queued one never read."""
        if held.answered:
            return
        self._waiting -= 1
        self.second.give_up(held.job)
        held.answer(None)

    def close(self) -> None:
        """The session closed: its waiting jobs are dropped unrun."""
        self._chunks.clear()
        self.speech_again()  # (an early read, whose utterance will not end)
        if self._waiting:
            self.second.cancel(self.key)
            self._waiting = 0


class _Early:
    """An utterance's early read: its job, its answer once come, and the final held for it once it ended."""

    __slots__ = ("answer", "answered", "held", "index", "job")

    def __init__(self, index: int):
        self.index = index
        self.job = None
        self.answer: SecondPassResult | None = None
        self.answered = False
        self.held: Held | None = None


class Held:
    """A streaming final held for the second pass's answer."""

    __slots__ = ("answered", "audio_start_ms", "job", "punctuation", "result", "word_times")

    def __init__(self, result: Result, punctuation: bool, audio_start_ms: int = 0, word_times: bool = False):
        self.result, self.punctuation, self.audio_start_ms = result, punctuation, audio_start_ms
        self.word_times = word_times  # (a streaming final with no words, because it heard none, gets Whisper's)
        self.answered = False
        self.job = None  # the second pass's job it waits for

    def answer(self, answer: SecondPassResult | None) -> None:
        """Put the answer into the held final (a final with the streaming model's text): Whisper's text, or
        the streaming text when there is none, or it is gated."""
        self.answered = True
        result = self.result
        if answer is None or answer.gated or not answer.text:
            result.final_pass = STREAMING
            if answer is not None and answer.gated:
                log.debug("second pass gated (%s): the streaming final stands", answer.gated)
            return
        result.final_pass = SECOND_PASS
        result.transcript = answer.written if self.punctuation else answer.text
        result.confidence = math.exp(min(0.0, answer.avg_logprob))
        if self.word_times:
            result.words = [Word(word, start, end, result.confidence) for word, start, end in self._timed(answer)]
        if result.alternatives:  # the streaming beam's n-best read other words: the second pass's text alone
            result.alternatives = [Alternative(result.transcript, result.confidence, list(result.words))]

    def _timed(self, answer: SecondPassResult) -> list[tuple[str, int, int]]:
        """The final's words with their spans (ms in the stream), within the utterance's."""
        low, high = self.result.start_ms, max(self.result.start_ms, self.result.end_ms)
        words = self.result.transcript.split()
        timed: list[tuple[str, int, int]] = []
        for written, start_s, end_s in answer.words:
            parts = [written] if self.punctuation else spoken_form(written).split()
            start = min(high, max(low, self.audio_start_ms + round(start_s * 1000)))
            end = min(high, max(start, self.audio_start_ms + round(end_s * 1000)))
            timed += [(w, a, b) for w, (a, b) in zip(parts, spread(parts, start, end), strict=True)]
        if [w for w, _, _ in timed] != words:  # (no alignment, or parts read otherwise than the whole)
            timed = [(w, a, b) for w, (a, b) in zip(words, spread(words, low, high), strict=True)]
        return timed


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
