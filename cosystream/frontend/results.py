"""What a session says, as plain objects: a transport maps them to its own messages.

A :class:`Response` carries either one :class:`Result` (an interim or a final of one utterance) or one
:class:`SpeechEvent`, with the :class:`Latency` of the audio it answers. The gRPC servicer maps it to
``StreamingRecognizeResponse`` (``server/messages.py``); nothing in this layer knows a wire format. The
fields are those of the wire API, named alike, so the mapping is one line per field. Mutable: a final held
for the second pass is rewritten in place when the answer comes (``final_pass.py``), and a response's
receive-to-send time is set as it leaves the session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class EventType(IntEnum):
    """A speech event's type; the values are the wire enum's."""

    SPEECH_STARTED = 1
    SPEECH_ENDED = 2


@dataclass(slots=True)
class Word:
    word: str
    start_ms: int
    end_ms: int
    confidence: float = 0.0


@dataclass(slots=True)
class Alternative:
    """One of a final's n-best hypotheses."""

    transcript: str
    confidence: float
    words: list[Word] = field(default_factory=list)


@dataclass(slots=True)
class Result:
    """One utterance's text so far (interim) or for good (final); times in ms of the stream."""

    transcript: str
    is_final: bool
    stability: float
    start_ms: int
    end_ms: int
    utterance_index: int
    confidence: float = 0.0
    model: str = ""
    model_version: str = ""
    final_pass: str = ""  # a final's source: final_pass.STREAMING or SECOND_PASS; "" on an interim
    words: list[Word] = field(default_factory=list)  # when the stream asked for word times
    alternatives: list[Alternative] = field(default_factory=list)  # a final's n-best, when asked for


@dataclass(slots=True)
class SpeechEvent:
    type: EventType
    offset_ms: int


@dataclass(slots=True)
class Latency:
    audio_processed_ms: int = 0  # the stream's audio the response covers
    queue_ms: float = 0.0  # the last engine step's wait for its turn
    compute_ms: float = 0.0  # and its compute
    receive_to_send_ms: float = 0.0  # from the audio that completed the response to its leaving the session


@dataclass(slots=True)
class Response:
    """One thing a session says: a result or a speech event."""

    session_id: str
    latency: Latency
    result: Result | None = None
    event: SpeechEvent | None = None

    @property
    def interim_of(self) -> int | None:
        """The utterance index of an interim result (which a newer interim of the same utterance supersedes),
        else None."""
        result = self.result
        return result.utterance_index if result is not None and not result.is_final else None
