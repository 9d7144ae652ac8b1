"""Admission by what is really free: a new REALTIME session is admitted while the engine has the headroom
to step it in time, not merely while a slot is free.

The signal is the engine's **projected realtime load** (``engine/adaptive.py``: the share of wall time its
loop is busy with realtime work, BATCH steps left out), averaged over the last :data:`RECENT_WINDOWS` windows
(2 s) so that one slow window (a collection, a model load beside the loop) does not close the door. What one
more session would add is priced in two parts. The load's **model steps** (their measured compute time) grow
as the scheduler's **step cost model** says (the measured time of a step per row bucket and frames,
``Scheduler.estimate_cost_s``): a batched step costs little more for one more row, so that part is scaled by
``cost(rows') / cost(rows)``, ``rows`` the mean rows of the windows' realtime steps and ``rows' = rows x
(open + 1) / sessions`` the rows of a step once each of the ``open`` sessions (and the new one) brings its
share, ``sessions`` the realtime sessions open during the windows. The **rest** of the load (each frame's own
work around the steps: IPC, queueing, results), which no batching makes cheaper, grows as ``(open + 1) /
sessions``. So a ramp of arrivals is priced as it is admitted, before their speech reaches the measured load,
and after a burst of calls has ended the load of those calls is not charged to the sessions left. A new
REALTIME session is refused, RESOURCE_EXHAUSTED with a retry delay (gRPC ``RetryInfo``), when that projection
would pass ``admit_load`` (``serve --admit-load``, :data:`ADMIT_LOAD`), less BATCH's floor share of the
engine's time while BATCH sessions are open (``scheduler.BATCH_MIN_DUTY``: BATCH keeps it however busy
realtime is, so without it a load at the limit would leave realtime none of the limit's slack). Before the
cost model has measured both sizes, the projection is linear in rows (the cautious side). BATCH sessions are
not refused for load: they are stepped only in the time realtime leaves (``engine/scheduler.py``), so load
slows them instead.

Under realtime pressure the engine sheds work in **stages** (:class:`Degradation`), the cheapest to lose
first, each keeping the ones before it, each a log line and the gauge ``cosystream_engine_degradation``, and
each undone on its own once the load falls: BATCH steps squeezed to their floor share of the engine's time
(``engine/scheduler.py``: they slow down, never fail), then interims thinned (every frontend sends each
stream's interims at most every :data:`THIN_INTERIM_MS` of audio; finals never), then admission closed
(overloaded, below).

The engine is **overloaded** once the projected load has stayed at or over ``admit_load`` for
``window_s`` (``--overload-window-s``), and no longer once it has stayed under for as long: the frontends'
``load`` health service says NOT_SERVING meanwhile, so a load balancer sends new sessions elsewhere.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

ADMIT_LOAD = 0.9
"""Projected realtime load past which new REALTIME sessions are refused (``serve --admit-load``); 0: off,
the overload state then uses 1.0 (an engine busy all the time)."""
OVERLOAD_WINDOW_S = 5.0
"""How long the load must stay over (or under) ``admit_load`` for the engine to be (or stop being)
overloaded (``serve --overload-window-s``)."""
RETRY_AFTER_S = 2.0
"""The retry delay a session refused for load is given (RetryInfo): a few load windows."""
RECENT_WINDOWS = 4  # load windows (0.5 s each) averaged for admission

THIN_INTERIM_MS = 500
"""A stream's interims are at most this much audio apart while interims are thinned."""


class Degradation(IntEnum):
    """What the engine sheds under realtime pressure; each stage keeps the ones before it."""

    NONE = 0
    BATCH_SQUEEZED = 1  # BATCH steps get only their floor share of the engine's time (scheduler.BATCH_MIN_DUTY)
    INTERIMS_THINNED = 2  # interims at most every THIN_INTERIM_MS of audio; finals never
    ADMISSION_CLOSED = 3  # overloaded: new REALTIME sessions refused, health "load" NOT_SERVING


STAGE_AT = {Degradation.BATCH_SQUEEZED: 0.7, Degradation.INTERIMS_THINNED: 0.95}
"""The recent load, as a share of the limit, at which a stage begins; it ends :data:`STAGE_HYSTERESIS` under."""
STAGE_HYSTERESIS = 0.1

StepCost = Callable[[int, int], float]
"""(rows, frames) -> the estimated seconds of a realtime step that size (``math.inf``: not known yet)."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What the engine tells its frontends of its load, once per load window when it changed (``Active``)."""

    load: float  # projected realtime load, the last window's
    realtime: int  # sessions holding a slot, per priority, all frontends
    batch: int
    free_slots: int
    queued_frames: int  # frames received and not yet stepped, all sessions
    overloaded: bool
    admit_load: float  # the limit (0: admission by load is off)
    refused: int  # REALTIME sessions refused for load since start-up
    stage: Degradation = Degradation.NONE  # what is being shed


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
        # Per window: (load, mean rows, mean frames of its realtime steps, 0 and 0 without any; the realtime
        # sessions open at its steps, on average; the part of the load that was model steps).
        self._recent: deque[tuple[float, float, float, float, float]] = deque(maxlen=RECENT_WINDOWS)
        self.overloaded = False
        self._since = clock()  # when the load last crossed the limit
        self._over = False  # the last window's load was at or over the limit
        self.refused = 0
        self.stage = Degradation.NONE

    @property
    def limit(self) -> float:
        return self.admit_load or 1.0

    @property
    def recent(self) -> float:
        """The projected load, averaged over the last windows (0 before the first)."""
        return sum(window[0] for window in self._recent) / len(self._recent) if self._recent else 0.0

    def projected(self, realtime: int, cost: StepCost | None = None) -> float | None:
        """The load with one more REALTIME session, ``realtime`` open now; None: nothing to project from (no
        realtime step in the last windows).

        The windows' steps had ``rows`` rows on average while ``sessions`` were open; with ``realtime + 1``
        open, each session bringing its share, a step has ``rows x (realtime + 1) / sessions`` rows. The part
        of the load that was model steps grows as the cost of such a step over the cost of the steps measured
        (a batched step costs little more for more rows); the rest (each frame's own work: receiving it,
        queueing it, sending its result) grows with the sessions. So sessions admitted since the windows (a
        ramp of arrivals, whose speech has not reached the load yet) are priced in, and those that have ended
        since are not."""
        stepped = [(rows, frames, sessions) for _, rows, frames, sessions, _ in self._recent if rows]
        if not stepped:
            return None
        rows = max(1, round(sum(r for r, _, _ in stepped) / len(stepped)))
        frames = max(1, round(sum(f for _, f, _ in stepped) / len(stepped)))
        sessions = sum(s or r for r, _, s in stepped) / len(stepped)  # (not counted: as many as rows)
        more_sessions = (realtime + 1) / max(1.0, sessions)
        target = rows * more_sessions
        now, more = (math.inf, math.inf) if cost is None else (cost(rows, frames), cost(math.ceil(target), frames))
        # Linear in its rows is the most a step can grow by (its fixed part only shrinks the ratio), and a step
        # of fewer rows costs no more than the steps measured: a noisy EMA of one bucket, or the fitted line's
        # guess for a bucket never measured, must not price a session above that (measured: a 9-row step
        # guessed at 55x an 8-row one closed the door at 7 of 16 sessions).
        bound = max(1.0, math.ceil(target) / rows)
        growth = min(more / now, bound) if 0 < now < math.inf and more < math.inf else more_sessions
        compute = sum(window[4] for window in self._recent) / len(self._recent)
        return compute * growth + (self.recent - compute) * more_sessions

    def observe(
        self,
        load: float,
        rows: float = 0.0,
        frames: float = 0.0,
        sessions: float = 0.0,
        compute: float | None = None,
    ) -> bool:
        """A window's projected load, with the mean rows and frames of its realtime steps (0: none), the
        realtime sessions that made it (those open at its steps, on average: not those left at its end, or a
        burst of calls ending in the window would charge its load to the few left; 0: not counted, taken as
        ``rows``) and the part of ``load`` that was model steps (None: all of it); True when the overload state
        changed (see :attr:`overloaded`). Updates :attr:`stage`."""
        now = self._clock()
        self._recent.append((load, rows, frames, sessions, load if compute is None else min(compute, load)))
        over = load >= self.limit
        if over != self._over:
            self._over, self._since = over, now
        changed = over != self.overloaded and now - self._since >= self.window_s
        if changed:
            self.overloaded = over
        self.stage = self._stage()
        return changed

    def _stage(self) -> Degradation:
        if self.overloaded:
            return Degradation.ADMISSION_CLOSED
        share, stage = self.recent / self.limit, Degradation.NONE
        for begins, at in STAGE_AT.items():
            if share >= at or (self.stage >= begins and share >= at - STAGE_HYSTERESIS):
                stage = begins
        return stage

    def refuse(self, realtime: int, cost: StepCost | None = None, batch_share: float = 0.0) -> str | None:
        """Why a new REALTIME session is refused, with ``realtime`` open; None: admitted. ``cost``: the
        scheduler's step cost model (None: linear in rows). ``batch_share``: the share of the engine's time
        BATCH work keeps however busy realtime is (its floor, while BATCH sessions are open), taken off the
        limit: the load leaves realtime the slack the limit meant only after BATCH's floor."""
        projected = self.projected(realtime, cost) if self.admit_load and realtime else None
        limit = self.admit_load - batch_share
        if projected is None or projected <= limit:  # (the first session always: its cost is unknown)
            return None
        self.refused += 1
        of = f"{self.admit_load:g} less BATCH's floor share {batch_share:g}" if batch_share else f"{limit:g}"
        return (
            f"the server is at capacity for realtime sessions (projected load {projected:.2f} with one more, "
            f"limit {of}); retry in {RETRY_AFTER_S:g} s or on another server"
        )
