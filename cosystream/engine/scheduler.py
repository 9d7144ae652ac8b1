"""The step scheduler: which sessions the engine steps next, and with how many frames each.

Shaped after vLLM v1 / nano-vllm: the engine reports what arrived (`add_frames`) and what a step cost
(`update_cost`); `schedule()` returns one `StepPlan`, a plain data object the engine hands to
``runner.run(plan.slots, frames)``. The scheduler holds no audio, only per-session frame counts and
arrival times, and it imports nothing but the standard library and the runner's bucket arithmetic
(``runtime/buckets.py``).

Policy (the scheduler contract in README.md, "How it works"):

- REALTIME before BATCH: while any realtime session has a frame due, `schedule()` returns a realtime
  step. Frames become due ``realtime_batch_window_s`` after the oldest waiting one arrived (at once when
  ``max_batch`` sessions are ready), so that sessions whose 10 ms frames arrive at different moments
  share a step; BATCH work may run meanwhile. Each ready session steps ``min(pending, realtime_max_frames)`` frames rounded down to a frame
  bucket (with buckets (1, 4, 16) and a cap of 4: pending 1-3 -> T=1, pending >= 4 -> T=4). All rows of
  a step share T, so among the next ``max_batch`` sessions in round-robin order the scheduler takes the
  T-group that holds the oldest pending frame (ties: the larger group). "Larger group first" would
  starve a lagging session; oldest-first serves it once its frame is the oldest, which it soon is.
- BATCH fills the rest: the session at the round-robin head fixes T (``min(pending, batch_frames)``
  rounded down to a bucket), and the step takes the sessions with that T among the next N in order,
  where N is the largest row bucket whose estimated cost fits ``batch_step_budget_s`` (at least 1).
  A realtime frame therefore waits behind at most one budget-sized batch step, and usually none: a BATCH
  step is not started when realtime frames are due before it would end (by the last BATCH step's cost),
  unless BATCH had less than ``batch_min_duty`` of the engine's time lately.
- BATCH's share of the engine's time (``batch_max_duty`` < 1, the CPU default, where frontends share the
  cores): ``batch_max_duty`` minus the share realtime steps took over the last ``realtime_load_window_s``,
  at least ``batch_min_duty``. On shared cores every BATCH frame stepped also costs its frontend the
  decoding of it (15-70x real time of beam search), so with realtime near the cap BATCH gets the floor.
- Round-robin: each class keeps an insertion-ordered set of ready slots; a stepped session that still
  has frames moves to the back, one that was passed over keeps its place at the front.
- Several models: every session runs on one (``add(slot, priority, model)``); a step's rows are all of one
  model, so the T-groups above are (model, T) groups, one round-robin over the sessions of every model.
  Step costs are measured per model. With one model (the usual case) nothing of this costs anything.
  A model loaded while serving (a new version beside the old) gets an index of its own, ``add_model()``;
  a session moves to it between utterances, ``move(slot, model)``.
- End of utterance: the frontend ends a session's utterance (``end_utterance``) when its utterance has ended and the frames
  still to step (the end-of-utterance silence among them) are all its final waits for. Those frames are
  due at once, not after the batching window, and the ending session's (model, T) group steps before any
  other realtime group until nothing of it is left: FINALIZE -> final costs a few steps of one session,
  however many sessions wait.
- Admission: at most ``max_sessions`` sessions, of all models together. `admit()` is asked *before* the engine allocates a slot
  (a full engine has no free slot to offer): on a full engine a REALTIME request sheds the most recently
  admitted BATCH session, anything else gets `AdmissionError`.

Ready sessions sit in `OrderedDict`s (O(1) delete and move-to-back) and arrival times are kept as runs of
``(arrival_s, count)``, so admitting, adding frames and filing a step's result are O(1) per session or row;
`schedule()` scans the ready sessions of one class for the T-group (O(ready), at most ``max_batch`` rows
taken).
"""

import logging
import math
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice, pairwise

from cosystream.priority import Priority
from cosystream.runtime.buckets import FRAME_BUCKETS, batch_buckets

logger = logging.getLogger(__name__)


MAX_SESSIONS = 256
"""Sessions one engine holds (``serve --max-sessions``); each has a slot of the state slab."""
DEADLINE_S = 0.05
"""A realtime frame stepped later than this after it reached the engine is a deadline miss (a metric)."""
REALTIME_BATCH_WINDOW_S = 0.006
"""How long a realtime frame may wait for other sessions' frames to share its step (``--batch-window-ms``)."""
BATCH_STEP_BUDGET_S = 0.004
"""The estimated cost cap of one BATCH step: the longest a realtime frame waits behind BATCH work."""
BATCH_MIN_DUTY = 0.1
"""The share of the engine's time BATCH work keeps however busy realtime is, so BATCH streams progress: on a
CPU with the eager step (~5 ms per 16-frame row), ~1.5x real time for each of two BATCH sessions (0.05
left them below real time, where a file upload takes longer than its audio)."""
REALTIME_LOAD_WINDOW_S = 0.5
"""The time constant over which realtime steps' share of the engine's time is measured (an exponential
average), for the BATCH duty cap."""
PRESSED_AT = 0.5
"""A realtime step whose oldest frame waited this share of ``deadline_s`` or more squeezes BATCH to its floor
share (``batch_min_duty``) for ``realtime_load_window_s``: realtime is near its deadline now, before the
engine's 2 s load average (``engine/headroom.py``'s BATCH_SQUEEZED stage) has seen it. BATCH slows, never
fails."""


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_sessions: int = MAX_SESSIONS
    models: int = 1  # how many models the sessions run on (a step runs one)
    max_batch: int = MAX_SESSIONS  # rows per step
    frame_buckets: tuple[int, ...] = FRAME_BUCKETS  # allowed frames per row (T); must start at 1
    # Rows per step the runner pads to; None: ``batch_buckets(max_batch)``, the runner's own rule.
    row_buckets: tuple[int, ...] | None = None
    # Most frames a realtime row takes (a session that fell behind, a speech onset's pre-roll); None: the
    # largest frame bucket.
    realtime_max_frames: int | None = None
    batch_frames: int | None = None  # frames per BATCH row when that many are pending; None: the largest bucket
    deadline_s: float = DEADLINE_S  # a realtime frame stepped later than arrival + deadline_s is a miss
    batch_step_budget_s: float = BATCH_STEP_BUDGET_S  # estimated cost cap of one BATCH step
    # Realtime frames wait up to this long for others to join their step (0 = step at once). A step costs
    # a fixed ~1 ms on a CPU plus a little per row, so stepping every arrival alone saturates the core.
    realtime_batch_window_s: float = REALTIME_BATCH_WINDOW_S
    # Most of the engine's time steps may take before BATCH work waits (1 = BATCH takes all that realtime
    # leaves). Below 1 leaves CPU to frontends sharing the cores: BATCH gets ``duty`` minus the share of
    # the engine's time realtime took lately (at least ``batch_min_duty``), so after a BATCH step of d seconds
    # the next waits d * (1/share - 1). Realtime's share is the larger of its steps' (realtime_share()) and
    # the engine's whole realtime load (``realtime_load``: its frames' IPC and results as well). It counts
    # because on shared cores every BATCH frame stepped also costs its frontend the decoding of it, on the
    # same cores realtime streams need.
    batch_max_duty: float = 1.0
    batch_min_duty: float = BATCH_MIN_DUTY
    realtime_load_window_s: float = REALTIME_LOAD_WINDOW_S
    cost_ema_alpha: float = 0.2  # weight of a new measurement in the per-(rows, T) cost EMA

    def __post_init__(self) -> None:
        object.__setattr__(self, "frame_buckets", tuple(self.frame_buckets))
        buckets = self.frame_buckets
        if self.row_buckets is None:
            object.__setattr__(self, "row_buckets", batch_buckets(self.max_batch))
        if self.realtime_max_frames is None:
            object.__setattr__(self, "realtime_max_frames", max(buckets, default=1))
        if self.batch_frames is None:
            object.__setattr__(self, "batch_frames", max(buckets, default=1))
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.models < 1:
            raise ValueError(f"models must be >= 1, got {self.models}")
        if not buckets or buckets[0] != 1 or any(a >= b for a, b in pairwise(buckets)):
            # Without a bucket of 1 the last frames of a stream could never be stepped.
            raise ValueError(f"frame_buckets must be strictly increasing and start at 1, got {buckets}")
        if self.realtime_max_frames < 1 or self.batch_frames < 1:
            raise ValueError("realtime_max_frames and batch_frames must be >= 1")
        if not self.deadline_s > 0 or not self.batch_step_budget_s > 0:
            raise ValueError("deadline_s and batch_step_budget_s must be > 0")
        if not 0 <= self.realtime_batch_window_s < self.deadline_s:
            raise ValueError("realtime_batch_window_s must be in [0, deadline_s)")
        if not 0 < self.batch_max_duty <= 1:
            raise ValueError(f"batch_max_duty must be in (0, 1], got {self.batch_max_duty}")
        if not 0 < self.batch_min_duty <= self.batch_max_duty:
            raise ValueError(f"batch_min_duty must be in (0, batch_max_duty], got {self.batch_min_duty}")
        if not self.realtime_load_window_s > 0:
            raise ValueError(f"realtime_load_window_s must be > 0, got {self.realtime_load_window_s}")
        if not 0 < self.cost_ema_alpha <= 1:
            raise ValueError(f"cost_ema_alpha must be in (0, 1], got {self.cost_ema_alpha}")


class AdmissionError(Exception):
    """No room for a new session; the server answers RESOURCE_EXHAUSTED with ``str(err)``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "full"


@dataclass(slots=True)
class StepPlan:
    """One step: run ``slots`` (sessions of model ``model``) with ``frames`` frames each (the next ones each
    session has queued)."""

    priority: Priority
    frames: int  # T, a frame bucket
    slots: list[int]
    queue_wait_s: list[float]  # per row: now_s - arrival of the oldest frame stepped in that row
    deadline_misses: int  # realtime frames in this step older than deadline_s
    now_s: float  # clock time when the step was planned
    oldest_arrival_s: float
    model: int = 0

    @property
    def rows(self) -> int:
        return len(self.slots)


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters, read by the metrics module.

    Conservation: ``frames_arrived == realtime_frames + batch_frames + frames_dropped + pending``.
    """

    realtime_steps: int = 0
    batch_steps: int = 0
    realtime_rows: int = 0
    batch_rows: int = 0
    realtime_frames: int = 0  # frames stepped
    batch_frames: int = 0
    deadline_misses: int = 0
    frames_arrived: int = 0
    frames_dropped: int = 0  # still pending when their session was removed or shed
    admitted: int = 0
    rejected: int = 0
    shed: int = 0
    pressed: int = 0  # realtime steps whose oldest frame waited PRESSED_AT of the deadline (BATCH squeezed)


class _Session:
    __slots__ = ("model", "pending", "priority", "runs")

    def __init__(self, priority: Priority, model: int = 0) -> None:
        self.priority = priority
        self.model = model
        self.pending = 0
        self.runs: deque[tuple[float, int]] = deque()  # (arrival_s, count), oldest first


class Scheduler:
    """Decides, one step at a time, which sessions the engine steps and with how many frames.

    Single-threaded: the engine's tick loop makes every call. Engine flow for a new session:
    ``shed = admit(p)`` (end ``shed`` if any) -> ``slot = slab.alloc()`` -> ``add(slot, p, model)``.
    """

    def __init__(self, config: SchedulerConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = c = config or SchedulerConfig()
        self.stats = SchedulerStats()
        self._clock = clock
        self._sessions: list[_Session | None] = [None] * c.max_sessions
        self._num_active = 0
        # Slots with >= 1 pending frame, in round-robin order (values unused).
        self._ready_rt: OrderedDict[int, None] = OrderedDict()
        # Realtime sessions whose pending frames end an utterance (``end_utterance``), in that order.
        self._rt_ending: OrderedDict[int, None] = OrderedDict()
        # Arrival of the oldest frame waiting in _ready_rt.
        self._rt_waiting_since = math.inf
        self._batch_allowed_s = -math.inf  # the duty cap's earliest time for the next BATCH step
        # Under realtime pressure (engine/headroom.py's BATCH_SQUEEZED), BATCH gets only batch_min_duty.
        self.batch_squeezed = False
        # Until then, a realtime step near its deadline (PRESSED_AT) squeezes BATCH the same way.
        self._pressed_until = -math.inf
        # The engine's realtime load over its last load window (engine/core.py): the share of wall time its loop
        # was busy with everything but BATCH steps (realtime steps, and each frame's IPC, queueing and results,
        # which realtime_share() leaves out). The duty cap subtracts the larger of the two.
        self.realtime_load = 0.0
        self._last_batch_s = 0.0  # the last BATCH step's measured seconds
        # The time after which a BATCH step runs even with realtime frames due (batch_min_duty's floor).
        self._batch_floor_s = -math.inf
        # Realtime step seconds, exponentially decayed over realtime_load_window_s, as of _rt_busy_at.
        self._rt_busy_s = 0.0
        self._rt_busy_at = clock()
        self._ready_batch: OrderedDict[int, None] = OrderedDict()
        self._batch_admitted: OrderedDict[int, None] = OrderedDict()  # oldest admission first
        # T for a given min(pending, cap): the largest frame bucket <= it.
        self._rt_frames = [_floor_bucket(c.frame_buckets, n) for n in range(c.realtime_max_frames + 1)]
        self._batch_frames = [_floor_bucket(c.frame_buckets, n) for n in range(c.batch_frames + 1)]
        self._row_buckets = list(c.row_buckets)  # the runner's, handed on
        # Per model: EMA of measured step seconds per (row bucket, T), and (fixed_s, per_row_frame_s) over it.
        self._cost_s: list[dict[tuple[int, int], float]] = [{} for _ in range(c.models)]
        self._fit: list[tuple[float, float] | None] = [None] * c.models
        self._fit_dirty = [False] * c.models
        # A (model, T) group's key in _schedule_realtime: T + model * _model_stride (just T with one model).
        self._model_stride = c.realtime_max_frames + 1

    # -- sessions ------------------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return self._num_active

    @property
    def batch_open(self) -> int:
        """BATCH sessions holding a slot."""
        return len(self._batch_admitted)

    def admit(self, priority: Priority) -> int | None:
        """Make room for one new session, before the engine allocates its slot.

        Returns None when there is room, or the slot of a BATCH session shed to make room for a REALTIME
        one: that session is already forgotten here (do not `remove` it); the engine ends it with
        RESOURCE_EXHAUSTED and frees its slot. Raises `AdmissionError` when there is no room.
        """
        c = self.config
        if self._num_active < c.max_sessions:
            return None
        if priority == Priority.REALTIME and self._batch_admitted:
            victim = next(reversed(self._batch_admitted))
            self.remove(victim)
            self.stats.shed += 1
            logger.info("engine full: shed BATCH session on slot %d to admit a REALTIME session", victim)
            return victim
        self.stats.rejected += 1
        what = "no BATCH session to preempt" if priority == Priority.REALTIME else "BATCH sessions are refused"
        raise AdmissionError("full", f"engine full ({c.max_sessions} sessions active; {what})")

    def add(self, slot: int, priority: Priority, model: int = 0) -> None:
        """Start scheduling a new session on ``slot``, running on model ``model`` (call `admit` first)."""
        if not 0 <= slot < self.config.max_sessions:
            raise ValueError(f"slot {slot} out of range [0, {self.config.max_sessions})")
        if self._sessions[slot] is not None:
            raise ValueError(f"slot {slot} already has a session")
        if not 0 <= model < self.models:
            raise ValueError(f"model {model} out of range [0, {self.models})")
        priority = Priority(priority)
        self._sessions[slot] = _Session(priority, model)
        self._num_active += 1
        if priority == Priority.BATCH:
            self._batch_admitted[slot] = None
        self.stats.admitted += 1

    @property
    def models(self) -> int:
        """How many model indices there are: ``config.models`` plus those added while serving."""
        return len(self._cost_s)

    def add_model(self, costs_from: int | None = None) -> int:
        """One more model index (a model loaded while serving); returns it. Its step costs start as those
        measured for ``costs_from`` (a new version of a model steps like the old one), else unmeasured."""
        self._cost_s.append({} if costs_from is None else dict(self._cost_s[costs_from]))
        self._fit.append(None)
        self._fit_dirty.append(True)
        return len(self._cost_s) - 1

    def move(self, slot: int, model: int) -> None:
        """Run the session on ``slot`` on model ``model`` from its next step (between utterances)."""
        s = self._sessions[slot] if 0 <= slot < self.config.max_sessions else None
        if s is None:
            raise ValueError(f"no session on slot {slot}")
        if not 0 <= model < self.models:
            raise ValueError(f"model {model} out of range [0, {self.models})")
        s.model = model

    def remove(self, slot: int) -> bool:
        """Forget the session on ``slot`` and its pending frames, in O(1). False if none was there."""
        s = self._sessions[slot] if 0 <= slot < self.config.max_sessions else None
        if s is None:
            return False
        self._sessions[slot] = None
        self._num_active -= 1
        self.stats.frames_dropped += s.pending
        if s.priority == Priority.REALTIME:
            self._ready_rt.pop(slot, None)
            self._rt_ending.pop(slot, None)
        else:
            self._ready_batch.pop(slot, None)
            self._batch_admitted.pop(slot, None)
        return True

    def end_utterance(self, slot: int) -> None:
        """The frames pending for the realtime session on ``slot`` end an utterance (its end-of-utterance
        silence among them), and its final waits for them: they are due at once, not after the batching
        window, and step before any other realtime frames until none is left. Nothing for a session with
        nothing pending, or a BATCH one."""
        s = self._sessions[slot] if 0 <= slot < self.config.max_sessions else None
        if s is not None and s.pending and s.priority == Priority.REALTIME:
            self._rt_ending[slot] = None

    def add_frames(self, slot: int, n: int, arrival_s: float) -> None:
        """Record ``n`` frames for ``slot`` that arrived at ``arrival_s`` (same clock as the scheduler's)."""
        s = self._sessions[slot] if 0 <= slot < self.config.max_sessions else None
        if s is None:
            raise ValueError(f"no session on slot {slot}")
        if n <= 0:
            if n < 0:
                raise ValueError(f"frame count must be >= 0, got {n}")
            return
        runs = s.runs
        if runs and runs[-1][0] == arrival_s:
            runs[-1] = (arrival_s, runs[-1][1] + n)
        else:
            runs.append((arrival_s, n))
        if s.pending == 0:
            if s.priority == Priority.REALTIME:
                if not self._ready_rt:
                    self._rt_waiting_since = arrival_s
                self._ready_rt[slot] = None
            else:
                self._ready_batch[slot] = None
        s.pending += n
        self.stats.frames_arrived += n

    def pending(self, slot: int) -> int:
        """Frames recorded for ``slot`` and not yet scheduled (0 if no session)."""
        s = self._sessions[slot] if 0 <= slot < self.config.max_sessions else None
        return 0 if s is None else s.pending

    def queued_frames(self) -> int:
        """Frames recorded and not yet scheduled, all sessions."""
        return sum(s.pending for s in self._sessions if s is not None)

    def has_work(self) -> bool:
        """Whether `schedule()` would return a step now."""
        now = self._clock()
        return self._realtime_due(now) or self._batch_due(now)

    def has_pending(self) -> bool:
        """Whether any frame waits, due now or not."""
        return bool(self._ready_rt or self._ready_batch)

    def realtime_due_s(self) -> float | None:
        """Clock time at which waiting realtime frames are due to step (None when none wait)."""
        if not self._ready_rt:
            return None
        if (
            self._rt_ending
            or len(self._ready_rt) >= self.config.max_batch
            or self.config.realtime_batch_window_s <= 0
        ):
            return -math.inf
        return self._rt_waiting_since + self.config.realtime_batch_window_s

    def next_due_s(self) -> float | None:
        """Earliest clock time at which `schedule()` may return a step (None: nothing pending)."""
        times = [t for t in (self.realtime_due_s(), self._batch_next_s(self._clock())) if t is not None]
        return min(times) if times else None

    def _batch_next_s(self, now: float) -> float | None:
        """When the next BATCH step may start, as things stand (None: no BATCH work waits)."""
        if not self._ready_batch:
            return None
        start = max(now, self._batch_allowed_s)
        if start < self._batch_floor_s and self._squeezed(now):
            start = self._batch_floor_s  # (realtime pressure: BATCH gets its floor share)
        if start >= self._batch_floor_s:
            return start
        # Realtime frames due before this step would end (as long as the last one took): they go first.
        due = self.realtime_due_s()
        if due is not None and due < start + self._last_batch_s:
            return self._batch_floor_s  # (or after realtime's step, which comes sooner)
        return start

    def _squeezed(self, now: float) -> bool:
        """BATCH gets only its floor share now: the engine's BATCH_SQUEEZED stage, or a realtime step near
        its deadline within the last load window (PRESSED_AT). Checked when the next BATCH step is due, not
        when the last one ended, so pressure that begins between the two holds the next one back."""
        return self.batch_squeezed or now < self._pressed_until

    def _batch_due(self, now: float) -> bool:
        start = self._batch_next_s(now)
        return start is not None and start <= now

    def realtime_share(self) -> float:
        """The share of the engine's time realtime steps took lately (over ``realtime_load_window_s``)."""
        return min(1.0, self._realtime_busy(self._clock()) / self.config.realtime_load_window_s)

    def _realtime_busy(self, now: float) -> float:
        """Realtime step seconds decayed to ``now`` (their sum over the window, at a steady rate)."""
        elapsed = now - self._rt_busy_at
        if elapsed > 0:
            self._rt_busy_s *= math.exp(-elapsed / self.config.realtime_load_window_s)
            self._rt_busy_at = now
        return self._rt_busy_s

    def _realtime_due(self, now: float) -> bool:
        due = self.realtime_due_s()
        return due is not None and due <= now

    # -- stepping ------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan ONE step, or None when nothing is pending.

        The plan is a commitment: its frames count as stepped from now on, so the engine runs it (or
        ends the sessions in it).
        """
        now = self._clock()
        if self._realtime_due(now):
            return self._schedule_realtime(now)
        if self._batch_due(now):
            return self._schedule_batch(now)
        return None

    def _schedule_realtime(self, now: float) -> StepPlan:
        sessions, table, cap = self._sessions, self._rt_frames, self.config.realtime_max_frames
        if self._rt_ending:
            return self._schedule_ending(now)
        window = list(islice(self._ready_rt, self.config.max_batch))
        ts = []  # per row, its group: T, or T + model * stride with several models
        if len(self._cost_s) == 1:
            for slot in window:
                p = sessions[slot].pending
                ts.append(table[p if p < cap else cap])
        else:
            stride = self._model_stride
            for slot in window:
                s = sessions[slot]
                p = s.pending
                ts.append(table[p if p < cap else cap] + s.model * stride)
        group = ts[0]
        if ts.count(group) == len(ts):
            model, t = divmod(group, self._model_stride)
            return self._commit(Priority.REALTIME, window, t, model, now)
        # Mixed groups: the one holding the oldest frame, ties to the larger group.
        oldest: dict[int, tuple[float, int]] = {}
        for slot, ti in zip(window, ts, strict=True):
            a = sessions[slot].runs[0][0]
            best = oldest.get(ti)
            oldest[ti] = (a, -1) if best is None else (min(best[0], a), best[1] - 1)
        group = min(oldest, key=oldest.__getitem__)
        rows = [slot for slot, ti in zip(window, ts, strict=True) if ti == group]
        model, t = divmod(group, self._model_stride)
        return self._commit(Priority.REALTIME, rows, t, model, now)

    def _schedule_ending(self, now: float) -> StepPlan:
        """A step of the first ending session's (model, T) group: it, the other ending sessions of that
        group, then the group's other ready sessions in round-robin order, up to ``max_batch`` rows."""
        sessions, table, cap = self._sessions, self._rt_frames, self.config.realtime_max_frames

        def group(slot: int) -> tuple[int, int]:
            s = sessions[slot]
            return s.model, table[s.pending if s.pending < cap else cap]

        first = next(iter(self._rt_ending))
        model, t = group(first)
        rows = [slot for slot in self._rt_ending if group(slot) == (model, t)][: self.config.max_batch]
        taken = set(rows)
        for slot in self._ready_rt:
            if len(rows) >= self.config.max_batch:
                break
            if slot not in taken and group(slot) == (model, t):
                rows.append(slot)
        return self._commit(Priority.REALTIME, rows, t, model, now)

    def _schedule_batch(self, now: float) -> StepPlan:
        sessions, table, cap = self._sessions, self._batch_frames, self.config.batch_frames
        ready = self._ready_batch
        head = sessions[next(iter(ready))]
        p = head.pending
        t = table[p if p < cap else cap]
        model = head.model
        limit = self.batch_rows_limit(t, model)
        rows = []
        for slot in islice(ready, limit):
            s = sessions[slot]
            p = s.pending
            if table[p if p < cap else cap] == t and s.model == model:
                rows.append(slot)
        return self._commit(Priority.BATCH, rows, t, model, now)

    def _commit(self, priority: Priority, rows: list[int], t: int, model: int, now: float) -> StepPlan:
        """Take ``t`` frames from each row's queue, rotate the ready set, count misses and waits."""
        realtime = priority == Priority.REALTIME
        ready = self._ready_rt if realtime else self._ready_batch
        deadline_s = self.config.deadline_s
        sessions = self._sessions
        waits = []
        misses = 0
        oldest = now
        for slot in rows:
            s = sessions[slot]
            runs = s.runs
            first = runs[0][0]
            waits.append(now - first)
            if first < oldest:
                oldest = first
            left = t
            while left:
                a, n = runs[0]
                if n <= left:
                    runs.popleft()
                else:
                    runs[0] = (a, n - left)
                    n = left
                if realtime and now - a > deadline_s:
                    misses += n
                left -= n
            s.pending -= t
            if s.pending:
                ready.move_to_end(slot)
            else:
                del ready[slot]
                if realtime:
                    self._rt_ending.pop(slot, None)
        st = self.stats
        if realtime:
            if now - oldest >= deadline_s * PRESSED_AT:
                self._pressed_until = now + self.config.realtime_load_window_s
                st.pressed += 1
            # Frames left waiting (another T group, or a backlog) keep their own age.
            self._rt_waiting_since = min(sessions[slot].runs[0][0] for slot in ready) if ready else math.inf
            st.realtime_steps += 1
            st.realtime_rows += len(rows)
            st.realtime_frames += len(rows) * t
            st.deadline_misses += misses
        else:
            st.batch_steps += 1
            st.batch_rows += len(rows)
            st.batch_frames += len(rows) * t
        return StepPlan(priority, t, rows, waits, misses, now, oldest, model)

    # -- cost model ----------------------------------------------------------------------------------

    def update_cost(
        self, rows: int, frames: int, seconds: float, priority: Priority | None = None, model: int = 0
    ) -> None:
        """Feed the measured wall time of a step of ``rows`` rows x ``frames`` frames of ``model`` (any
        priority)."""
        if not 1 <= rows <= self.config.max_batch or frames < 1 or not 0 <= seconds < math.inf:
            raise ValueError(f"bad step measurement: rows={rows} frames={frames} seconds={seconds}")
        c = self.config
        if priority == Priority.REALTIME:
            self._rt_busy_s = self._realtime_busy(self._clock()) + seconds
        elif priority == Priority.BATCH:
            now = self._clock()
            self._last_batch_s = seconds
            self._batch_floor_s = now + seconds * (1 / c.batch_min_duty - 1)  # (_batch_next_s: when squeezed)
            if c.batch_max_duty < 1:
                realtime = max(self.realtime_share(), self.realtime_load)
                share = max(c.batch_min_duty, c.batch_max_duty - realtime)
                self._batch_allowed_s = now + seconds * (1 / share - 1)
        key = (self._row_bucket(rows), frames)
        costs = self._cost_s[model]
        old = costs.get(key)
        costs[key] = seconds if old is None else old + self.config.cost_ema_alpha * (seconds - old)
        self._fit_dirty[model] = True

    def estimate_cost_s(self, rows: int, frames: int, model: int = 0) -> float:
        """Estimated seconds of a step of ``model``: the (row bucket, T) EMA if measured, else the fitted line.

        The line is ``fixed_s + per_row_frame_s * row_bucket * T``, least squares over the measured
        EMAs; with fewer than two distinct sizes (or a non-positive slope) it goes through the origin,
        which overestimates larger steps. Infinite before any measurement.
        """
        b = self._row_bucket(rows)
        costs = self._cost_s[model]
        measured = costs.get((b, frames))
        if measured is not None:
            return measured
        if self._fit_dirty[model]:
            self._fit[model] = _fit_line([(bb * tt, y) for (bb, tt), y in costs.items()])
            self._fit_dirty[model] = False
        fit = self._fit[model]
        if fit is None:
            return math.inf
        fixed_s, per_row_frame_s = fit
        return max(0.0, fixed_s + per_row_frame_s * b * frames)

    def batch_rows_limit(self, frames: int, model: int = 0) -> int:
        """The most BATCH rows of ``frames`` frames of ``model`` whose estimated cost fits the budget (at
        least 1)."""
        budget_s = self.config.batch_step_budget_s
        best = 1
        for b in self._row_buckets:  # stop at the first bucket over budget: estimates need not be monotone
            if self.estimate_cost_s(b, frames, model) > budget_s:
                break
            best = b
        return best

    def _row_bucket(self, rows: int) -> int:
        return self._row_buckets[bisect_left(self._row_buckets, rows)]


def _floor_bucket(buckets: tuple[int, ...], n: int) -> int:
    """The largest bucket <= n (0 when n < 1)."""
    best = 0
    for b in buckets:
        if b <= n:
            best = b
    return best


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = fixed + slope * x``; through the origin if degenerate; None if no points."""
    if not points:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx > 0:
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        if slope > 0:
            return my - slope * mx, slope
    return 0.0, my / mx
