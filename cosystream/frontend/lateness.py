"""How far behind real time a frontend reads its REALTIME streams' audio: admission's third signal.

A call's client sends audio as it is spoken. While the frontend keeps up, it reads each chunk as it comes;
once it cannot (its CPU shared by too many streams), the chunks wait in gRPC's queues and the socket's
buffer, and every result is late by that wait. The engine's load does not see it (the engine is fed late,
not slowly), and neither does the event loop's lag (measured: a 2-core host past capacity served results
seconds late with its loop 1-5 ms behind; ``docs/PERFORMANCE.md``, "Admission"). Audio that arrives late
does: each stream's :class:`AudioClock` counts the wall time since its first chunk against the audio read
since, and the frontend takes the median over its REALTIME streams (``SessionHost.audio_late_s``).

A stream's lateness is measured past the least it has been lately: a client that starts a little behind, or
sends 100 ms chunks, is not late for it. That least is forgotten at :data:`FORGET_PER_S` (a client that
stops sending in silence, discontinuous transmission, then goes on behind, is behind for its pause only
until it is forgotten), far slower than a frontend past capacity falls behind (by a tenth of a second per
second or more: 10% more streams than it can read).

Past :data:`BATCH_SLOW_LATE_S` the frontend reads its BATCH streams no faster than real time until its
REALTIME audio is on time again (BATCH slower, never failed: gRPC's flow control holds their senders).
``serve --admit-late-ms`` refuses new REALTIME sessions while the median passes it; 0, the default: only
reported (``LoadStatus.audio_late_ms``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

BATCH_SLOW_LATE_S = 0.1
"""Median lateness of a frontend's REALTIME audio past which it reads its BATCH streams no faster than real
time (``SessionHost.batch_turn``): the frontend's share of BATCH shed first, as the engine squeezes BATCH
steps (a BATCH stream read at 12x real time costs its frontend as much as 12 calls)."""
CHECK_S = 0.05
"""How often a frontend recomputes the median for its BATCH streams (not per chunk)."""
ADMIT_LATE_S = 0.0
"""Median lateness of a frontend's REALTIME audio past which it refuses new REALTIME sessions
(``serve --admit-late-ms``); 0: off, only reported."""
FORGET_PER_S = 0.02
"""How fast a stream's least lateness rises back towards its lateness now (seconds per second)."""


class AudioClock:
    """One stream's audio against the wall clock, from its first chunk."""

    __slots__ = ("_audio_s", "_chunk_s", "_least_at_s", "_least_s", "_start_s")

    def __init__(self) -> None:
        self._start_s: float | None = None
        self._audio_s = 0.0  # audio read since the first chunk
        self._chunk_s = 0.0  # the last chunk's (the next is due once as much more has been spoken)
        self._least_s = 0.0  # the least lateness seen, as of _least_at_s (before forgetting since)
        self._least_at_s = 0.0

    def read(self, received_s: float, audio_s: float) -> None:
        """A chunk holding ``audio_s`` seconds of audio was received at ``received_s`` (monotonic)."""
        if self._start_s is None:
            self._start_s = self._least_at_s = received_s - audio_s  # (as if its first sample came at once)
        self._audio_s += audio_s
        self._chunk_s = audio_s
        late = received_s - self._start_s - self._audio_s
        self._least_s = min(self._least(received_s), late)
        self._least_at_s = received_s

    def _least(self, now_s: float) -> float:
        return self._least_s + FORGET_PER_S * max(0.0, now_s - self._least_at_s)

    def late_s(self, now_s: float) -> float | None:
        """How late the stream's audio is at ``now_s``, past the least it has been lately: how long ago its
        next chunk (as long as its last) was due; None before its first chunk."""
        if self._start_s is None:
            return None
        late = now_s - self._start_s - self._audio_s - self._chunk_s
        return max(0.0, late - min(self._least(now_s), late))


def median_late_s(clocks: Iterable[AudioClock], now_s: float) -> float:
    """The median lateness of the streams that have sent audio (0 for none)."""
    late = [value for clock in clocks if (value := clock.late_s(now_s)) is not None]
    return statistics.median(late) if late else 0.0
