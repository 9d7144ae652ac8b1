"""The endpointing state machine over per-frame voice activity (:mod:`cosystream.audio.vad`).

The frontend runs, per session and per frame::

    ring.push(frame)
    decision = endpointer.feed(vad.is_speech(frame))
    if decision.started: ...emit SPEECH_STARTED at decision.start_ms
    if decision.forward_frames: ...send ring.last(decision.forward_frames) to the model
    if decision.ended: ...emit SPEECH_ENDED (decision.end_reason, decision.end_ms), final

Frames that are not forwarded are dropped, so silence costs nothing downstream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

from cosystream.frames import FRAME_MS

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class EndpointingConfig:
    """When utterances start and end. All durations are multiples of the 10 ms frame.

    silence_ms: trailing non-speech that ends an utterance (frames in it are still forwarded).
    max_utterance_ms: audio forwarded for one utterance (pre-roll included) before a forced final.
    preroll_ms: audio kept from before the speech run so onsets are not clipped.
    speech_start_ms: consecutive speech needed to start an utterance, so clicks do not.
    vad_aggressiveness: webrtcvad mode, 0 (least) to 3 (most aggressive at calling non-speech).
    """

    silence_ms: int = 500
    max_utterance_ms: int = 15000
    preroll_ms: int = 200
    speech_start_ms: int = 30
    vad_aggressiveness: int = 2

    def __post_init__(self) -> None:
        bounds = {
            "silence_ms": (FRAME_MS, 10_000),
            "max_utterance_ms": (1_000, 600_000),
            "preroll_ms": (0, 2_000),
            "speech_start_ms": (FRAME_MS, 1_000),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if value % FRAME_MS:
                raise ValueError(f"{name}={value} must be a multiple of {FRAME_MS} ms")
            if not low <= value <= high:
                raise ValueError(f"{name}={value} must be between {low} and {high} ms")
        if self.max_utterance_ms <= self.preroll_ms + self.speech_start_ms:
            raise ValueError(
                f"max_utterance_ms={self.max_utterance_ms} must exceed preroll_ms + speech_start_ms "
                f"({self.preroll_ms + self.speech_start_ms}): raise it or shorten the pre-roll"
            )
        if not 0 <= self.vad_aggressiveness <= 3:
            raise ValueError(f"vad_aggressiveness={self.vad_aggressiveness} must be 0, 1, 2 or 3")


class EndReason(StrEnum):
    """Why an utterance ended (compares equal to its string value)."""

    SILENCE = "silence"
    MAX_LENGTH = "max_length"
    FINALIZE = "finalize"


@dataclass(slots=True, frozen=True)
class Decision:
    """What to do after one frame. Frame indices count 10 ms frames from stream start.

    forward_frames: how many of the most recent frames, ending with ``frame_index``, to send
        to the model now (0 = drop this frame).
    started / start_frame: SPEECH_STARTED; the utterance's speech begins at ``start_frame``
        (where the speech run began, not where the pre-roll begins).
    ended / end_reason / end_frame: SPEECH_ENDED; ``end_frame`` is one past the utterance's
        last speech frame (trailing silence forwarded as context is not counted).
    """

    frame_index: int
    forward_frames: int = 0
    started: bool = False
    start_frame: int = -1
    ended: bool = False
    end_reason: EndReason | None = None
    end_frame: int = -1

    @property
    def first_forward_frame(self) -> int:
        """Stream frame index of the first forwarded frame (the model's ``first_frame``)."""
        return self.frame_index - self.forward_frames + 1

    @property
    def start_ms(self) -> int:
        return self.start_frame * FRAME_MS

    @property
    def end_ms(self) -> int:
        return self.end_frame * FRAME_MS


class Endpointer:
    """Per-session utterance state machine, fed one VAD decision per 10 ms frame.

    Contract, per utterance:

    * SPEECH_STARTED is reported (``started``) in the same decision as, and so before, the
      utterance's first forwarded frames: the pre-roll, the speech run, and the current frame.
    * While the utterance is open every frame is forwarded, including the ``silence_ms``
      hangover, so the model sees trailing context; outside utterances nothing is forwarded.
    * Each frame is forwarded at most once over the whole stream: pre-roll never reaches
      back into frames already forwarded for the previous utterance.
    * An utterance ends exactly once: after ``silence_ms`` of non-speech, when it has
      forwarded ``max_utterance_ms`` of audio, or on :meth:`finalize`.
    * An end does not forget the ongoing speech run: if speech continues past a
      ``max_length`` end (or a mid-speech finalize), the next frame starts a new utterance
      at once, with no pre-roll (those frames went to the previous one).
    * Onset needs ``speech_start_ms`` of consecutive speech, so shorter clicks never start
      an utterance; inside an utterance any speech frame resets the silence count.
    """

    __slots__ = (
        "_first_forward",
        "_frame",
        "_in_utterance",
        "_last_speech",
        "_max_frames",
        "_next_unforwarded",
        "_preroll_frames",
        "_silence_frames",
        "_silence_run",
        "_speech_run",
        "_start_frames",
        "config",
    )

    def __init__(self, config: EndpointingConfig | None = None, first_frame: int = 0) -> None:
        """``first_frame``: the index of the first frame fed (a session resumed from a snapshot goes on in its
        stream's timeline; nothing before it is forwarded)."""
        self.config = config or EndpointingConfig()
        self._silence_frames = self.config.silence_ms // FRAME_MS
        self._max_frames = self.config.max_utterance_ms // FRAME_MS
        self._preroll_frames = self.config.preroll_ms // FRAME_MS
        self._start_frames = self.config.speech_start_ms // FRAME_MS
        self._frame = first_frame  # index of the next frame fed
        self._next_unforwarded = first_frame
        self._speech_run = 0
        self._silence_run = 0
        self._in_utterance = False
        self._first_forward = 0
        self._last_speech = -1

    @property
    def max_forward_frames(self) -> int:
        """Most frames one decision can forward (pre-roll + speech run): the ring size needed."""
        return self._preroll_frames + self._start_frames

    @property
    def in_utterance(self) -> bool:
        return self._in_utterance

    @property
    def frames_seen(self) -> int:
        return self._frame

    @property
    def silence_run(self) -> int:
        """Frames of non-speech since the open utterance's last speech frame (0 outside utterances)."""
        return self._silence_run if self._in_utterance else 0

    @property
    def utterance_frames(self) -> int:
        """Frames forwarded so far for the open utterance (0 outside utterances)."""
        return self._frame - self._first_forward if self._in_utterance else 0

    @property
    def between_utterances(self) -> bool:
        """No utterance open and no speech run begun: a new endpointer started here decides the same."""
        return not self._in_utterance and self._speech_run == 0

    @property
    def resume_frame(self) -> int:
        """The first frame a new endpointer must be fed to go on as this one would from here (between
        utterances): a pre-roll back, but nothing this one has forwarded already."""
        return max(self._next_unforwarded, self._frame - self._preroll_frames)

    def feed(self, is_speech: bool) -> Decision:
        """Advance one frame and say what to do with it."""
        i = self._frame
        self._frame = i + 1
        self._speech_run = self._speech_run + 1 if is_speech else 0

        if not self._in_utterance:
            if self._speech_run < self._start_frames:
                return Decision(i)
            run_start = i - self._speech_run + 1
            start = max(run_start, self._next_unforwarded)
            first = max(run_start - self._preroll_frames, self._next_unforwarded)
            self._in_utterance = True
            self._first_forward = first
            self._last_speech = i
            self._silence_run = 0
            self._next_unforwarded = i + 1
            logger.debug("speech started at frame %d (forwarding from %d)", start, first)
            return Decision(i, forward_frames=i - first + 1, started=True, start_frame=start)

        self._next_unforwarded = i + 1
        if is_speech:
            self._silence_run = 0
            self._last_speech = i
        else:
            self._silence_run += 1
        if self._silence_run >= self._silence_frames:
            return self._end(i, 1, EndReason.SILENCE)
        if i - self._first_forward + 1 >= self._max_frames:
            return self._end(i, 1, EndReason.MAX_LENGTH)
        return Decision(i, forward_frames=1)

    def finalize(self) -> Decision:
        """Client FINALIZE or end of stream: end the open utterance now, if there is one.

        A speech run too short to have started an utterance is dropped.
        """
        if not self._in_utterance:
            return Decision(self._frame - 1)
        return self._end(self._frame - 1, 0, EndReason.FINALIZE)

    def _end(self, i: int, forward_frames: int, reason: EndReason) -> Decision:
        self._in_utterance = False
        self._silence_run = 0
        logger.debug("speech ended at frame %d (%s)", self._last_speech + 1, reason)
        return Decision(
            i, forward_frames=forward_frames, ended=True, end_reason=reason, end_frame=self._last_speech + 1
        )
