"""Admission by what is really free: a new REALTIME session is admitted while the engine has the headroom
to step it in time, not merely while a slot is free.

The signal is the engine's **projected realtime load** (``engine/adaptive.py``: the share of wall time its
loop is busy with realtime work, BATCH steps left out), averaged over the last :data:`RECENT_WINDOWS`
windows (2 s) so that one slow window (a collection, a model load beside the loop) does not close the door.
A new REALTIME session is refused, RESOURCE_EXHAUSTED with a retry delay (gRPC ``RetryInfo``), when the
load with one more session, projected linearly from the realtime sessions open (``load * (n + 1) / n``),
would pass ``admit_load`` (``serve --admit-load``, off by default: :data:`ADMIT_LOAD`). Linear is the cautious side:
a batched step costs less than its rows alone would. BATCH sessions are not refused for load: they are
stepped only in the time realtime leaves (``engine/scheduler.py``), so load slows them instead.

The engine is **overloaded** once the projected load has stayed at or over ``admit_load`` for
``window_s`` (``--overload-window-s``), and no longer once it has stayed under for as long: the frontends'
``load`` health service says NOT_SERVING meanwhile, so a load balancer sends new sessions elsewhere.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

ADMIT_LOAD = 0.0
"""Projected realtime load past which new REALTIME sessions are refused (``serve --admit-load``; 0.9 is
the value to try). 0, the default: off. Off until the projection is right: it scales the last 2 s of load
by the realtime sessions open now, so just after a burst of sessions ends it counts their load on the
few left (measured: 10 telephone calls ended, one left, one more refused at "1.04"); the overload state
then uses 1.0."""
OVERLOAD_WINDOW_S = 5.0
"""How long the load must stay over (or under) ``admit_load`` for the engine to be (or stop being)
overloaded (``serve --overload-window-s``)."""
RETRY_AFTER_S = 2.0
"""The retry delay a session refused for load is given (RetryInfo): a few load windows."""
RECENT_WINDOWS = 4  # load windows (0.5 s each) averaged for admission


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What the engine tells its frontends of its load, once per load window when it changed (``ACTIVE``)."""

    load: float  # projected realtime load, the last window's
    realtime: int  # sessions holding a slot, per priority, all frontends
    batch: int
    free_slots: int
    queued_frames: int  # frames received and not yet stepped, all sessions
    overloaded: bool
    admit_load: float  # the limit (0: admission by load is off)
    refused: int  # REALTIME sessions refused for load since start-up


class Headroom:
    """Admission by load and the overload state, fed the projected load once per window."""

    def __init__(
        self,
        admit_load: float | None = ADMIT_LOAD,
        window_s: float = OVERLOAD_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``admit_load``: None or 0 turns admission by load off (the overload state then uses 1.0, an engine
        busy all the time)."""
        if admit_load is not None and not admit_load >= 0:
            raise ValueError(f"admit_load must be >= 0 (0: off), got {admit_load}")
        if not window_s >= 0:
            raise ValueError(f"overload window must be >= 0 s, got {window_s}")
        self.admit_load = admit_load or 0.0
        self.window_s = window_s
        self._clock = clock
        self._recent: deque[float] = deque(maxlen=RECENT_WINDOWS)
        self.overloaded = False
        self._since = clock()  # when the load last crossed the limit
        self._over = False  # the last window's load was at or over the limit
        self.refused = 0

    @property
    def limit(self) -> float:
        return self.admit_load or 1.0

    @property
    def recent(self) -> float:
        """The projected load, averaged over the last windows (0 before the first)."""
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    def observe(self, load: float) -> bool:
        """A window's projected load; True when the overload state changed (see :attr:`overloaded`)."""
        now = self._clock()
        self._recent.append(load)
        over = load >= self.limit
        if over != self._over:
            self._over, self._since = over, now
        if over != self.overloaded and now - self._since >= self.window_s:
            self.overloaded = over
            return True
        return False

    def refuse(self, realtime: int) -> str | None:
        """Why a new REALTIME session is refused, with ``realtime`` open; None: admitted."""
        if not self.admit_load or realtime == 0:
            return None  # (the first session always: the load it would add is not known)
        projected = self.recent * (realtime + 1) / realtime
        if projected <= self.admit_load:
            return None
        self.refused += 1
        return (
            f"the server is at capacity for realtime sessions (projected load {projected:.2f} with one more, "
            f"limit {self.admit_load:g}); retry in {RETRY_AFTER_S:g} s or on another server"
        )
