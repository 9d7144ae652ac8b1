"""The step scheduler, pure Python: a fake clock, hand-fed frame counts and step costs, no device."""

import math
import random
from collections import deque
from dataclasses import FrozenInstanceError

import pytest

from cosystream.engine.scheduler import (
    AdmissionError,
    Priority,
    Scheduler,
    SchedulerConfig,
    StepPlan,
)

RT, BATCH = Priority.REALTIME, Priority.BATCH


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# The policy cases below are written for these settings (the served defaults batch realtime frames for 6 ms
# and allow T=2 and a larger catch-up, which these cases would only obscure).
UNIT = {
    "frame_buckets": (1, 4, 16),
    "realtime_max_frames": 4,
    "batch_frames": 16,
    "deadline_s": 0.1,
    "realtime_batch_window_s": 0.0,
}


def unit_config(**config) -> SchedulerConfig:
    return SchedulerConfig(**{**UNIT, **config})


def make(**config) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    return Scheduler(unit_config(**config), clock=clock), clock


def open_session(sched: Scheduler, slot: int, priority: Priority) -> None:
    assert sched.admit(priority) is None
    sched.add(slot, priority)


def drain(sched: Scheduler) -> list[StepPlan]:
    plans = []
    while (plan := sched.schedule()) is not None:
        plans.append(plan)
        assert len(plans) < 10_000
    return plans


# -- config --------------------------------------------------------------------------------------------


def test_config_checks():
    assert SchedulerConfig(frame_buckets=[1, 2, 8]).frame_buckets == (1, 2, 8)
    with pytest.raises(FrozenInstanceError):
        SchedulerConfig().max_batch = 3  # type: ignore[misc]
    for bad in (
        {"frame_buckets": (4, 16)},
        {"frame_buckets": (1, 16, 4)},
        {"frame_buckets": ()},
        {"max_batch": 0},
        {"max_sessions": 0},
        {"realtime_max_frames": 0},
        {"deadline_s": 0.004, "realtime_batch_window_s": 0.006},
        {"deadline_s": 0.0},
        {"batch_step_budget_s": -1.0},
        {"cost_ema_alpha": 0.0},
        {"batch_min_duty": 0.0},
        {"batch_max_duty": 0.5, "batch_min_duty": 0.6},
        {"realtime_load_window_s": 0.0},
    ):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


# -- priority and round-robin --------------------------------------------------------------------------


def test_realtime_before_batch():
    sched, _ = make()
    open_session(sched, 0, BATCH)
    open_session(sched, 1, RT)
    sched.add_frames(0, 32, 0.0)
    sched.add_frames(1, 1, 0.0)
    plan = sched.schedule()
    assert (plan.priority, plan.slots, plan.frames) == (RT, [1], 1)
    plan = sched.schedule()
    assert (plan.priority, plan.slots, plan.frames) == (BATCH, [0], 16)
    # A realtime frame arriving while batch work remains jumps the queue.
    sched.add_frames(1, 1, 0.01)
    assert sched.schedule().priority == RT
    assert sched.schedule().priority == BATCH
    assert sched.schedule() is None
    assert not sched.has_work()


@pytest.mark.parametrize(("n", "max_batch"), [(10, 3), (256, 256), (300, 256), (7, 1), (9, 3)])
def test_round_robin_fairness(n, max_batch):
    """With more ready sessions than rows, everyone is served within ceil(ready / max_batch) steps."""
    sched, clock = make(max_sessions=n, max_batch=max_batch)
    for slot in range(n):
        open_session(sched, slot, RT)
        sched.add_frames(slot, 1, 0.0)
    window = math.ceil(n / max_batch)
    last_served = dict.fromkeys(range(n), -1)
    for step in range(5 * window):
        clock.now += 0.01
        plan = sched.schedule()
        assert plan.rows == min(n, max_batch) and plan.frames == 1
        for slot in plan.slots:
            assert step - last_served[slot] <= window
            last_served[slot] = step
            sched.add_frames(slot, 1, clock.now)  # stays ready with exactly one frame
    assert all(step - last <= window for last in last_served.values())


def test_batch_round_robin():
    sched, _ = make(max_sessions=4)
    for slot in range(4):
        open_session(sched, slot, BATCH)
        sched.add_frames(slot, 32, 0.0)
    served = [sched.schedule().slots for _ in range(8)]  # no cost measured yet: one row per step
    assert served == [[0], [1], [2], [3], [0], [1], [2], [3]]


# -- frames per step -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pending", "steps"),
    [
        (1, [1]),
        (2, [1, 1]),
        (3, [1, 1, 1]),  # 3 rounds down to the bucket 1, not up to 4
        (4, [4]),
        (9, [4, 4, 1]),  # catch-up never exceeds realtime_max_frames even though 16 is a bucket
        (16, [4, 4, 4, 4]),
    ],
)
def test_realtime_catch_up_and_bucket_rounding(pending, steps):
    sched, _ = make()
    open_session(sched, 0, RT)
    sched.add_frames(0, pending, 0.0)
    assert [plan.frames for plan in drain(sched)] == steps


@pytest.mark.parametrize(
    ("config", "pending", "steps"),
    [
        ({}, 37, [16, 16, 4, 1]),
        ({}, 20, [16, 4]),
        ({}, 3, [1, 1, 1]),
        ({"batch_frames": 8}, 20, [4, 4, 4, 4, 4]),  # min(pending, 8) rounds down to the bucket 4
    ],
)
def test_batch_multi_frame_steps(config, pending, steps):
    sched, _ = make(**config)
    open_session(sched, 0, BATCH)
    sched.add_frames(0, pending, 0.0)
    plans = drain(sched)
    assert [plan.frames for plan in plans] == steps
    assert all(plan.priority == BATCH and plan.deadline_misses == 0 for plan in plans)
    assert sched.stats.batch_frames == pending


def test_mixed_frame_counts_oldest_group_first():
    sched, clock = make()
    for slot in range(4):
        open_session(sched, slot, RT)
    sched.add_frames(0, 1, 0.02)
    sched.add_frames(1, 1, 0.02)
    sched.add_frames(2, 5, 0.01)  # fell behind: T=4, and holds the oldest frame
    sched.add_frames(3, 1, 0.03)
    clock.now = 0.04
    plan = sched.schedule()
    assert (plan.slots, plan.frames) == ([2], 4)
    plan = sched.schedule()  # the sessions passed over kept their place at the front
    assert (plan.slots, plan.frames) == ([0, 1, 3, 2], 1)
    # Equal oldest frames: the larger group goes first.
    sched.add_frames(0, 4, 0.05)
    sched.add_frames(1, 1, 0.05)
    sched.add_frames(2, 1, 0.05)
    assert (sched.schedule().slots, sched.schedule().slots) == ([1, 2], [0])


# -- deadlines and queue time --------------------------------------------------------------------------


def test_deadline_misses_counted_per_frame():
    sched, clock = make(deadline_s=0.125)
    open_session(sched, 0, RT)
    open_session(sched, 1, RT)
    sched.add_frames(0, 2, 0.0)
    sched.add_frames(0, 2, 0.0625)
    sched.add_frames(1, 1, 0.125)
    clock.now = 0.1875  # slot 0: two frames 0.1875 s old (missed), two 0.125 s old (exactly on time)
    plan = sched.schedule()
    assert (plan.slots, plan.frames) == ([0], 4)
    assert plan.deadline_misses == 2
    assert plan.queue_wait_s == [0.1875]
    assert plan.oldest_arrival_s == 0.0
    clock.now = 0.25
    plan = sched.schedule()
    assert (plan.slots, plan.deadline_misses, plan.queue_wait_s) == ([1], 0, [0.125])
    sched.add_frames(1, 3, 0.25)
    clock.now = 0.5
    assert [p.deadline_misses for p in drain(sched)] == [1, 1, 1]
    assert sched.stats.deadline_misses == 5
    # BATCH frames have no deadline.
    open_session(sched, 2, BATCH)
    sched.add_frames(2, 16, 0.0)
    clock.now = 10.0
    assert sched.schedule().deadline_misses == 0
    assert sched.stats.deadline_misses == 5


def test_queue_wait_per_row():
    sched, clock = make()
    for slot, arrival in enumerate((0.01, 0.03, 0.02)):
        open_session(sched, slot, RT)
        sched.add_frames(slot, 1, arrival)
    clock.now = 0.05
    plan = sched.schedule()
    assert plan.slots == [0, 1, 2]
    assert plan.queue_wait_s == pytest.approx([0.04, 0.02, 0.03])
    assert plan.oldest_arrival_s == 0.01 and plan.now_s == 0.05


# -- batch budget --------------------------------------------------------------------------------------


def test_batch_budget_limits_rows():
    sched, _ = make(max_sessions=64, batch_step_budget_s=0.004)
    for slot in range(40):
        open_session(sched, slot, BATCH)
        sched.add_frames(slot, 1000, 0.0)
    assert sched.schedule().rows == 1  # nothing measured: one row
    # One measurement: cost assumed linear in rows*T through the origin, 1 ms per 16 row-frames.
    sched.update_cost(1, 16, 0.001)
    assert sched.estimate_cost_s(4, 16) == pytest.approx(0.004)
    assert sched.schedule().rows == 4
    # Two sizes: a fitted line with a fixed cost; 8 rows fit (3.33 ms), 16 do not (6 ms).
    sched.update_cost(4, 16, 0.002)
    assert sched.estimate_cost_s(8, 16) == pytest.approx(0.001 - 16 / 48_000 + 128 / 48_000)
    assert sched.schedule().rows == 8
    # A measured (rows bucket, T) overrides the line: 8 rows turned out to cost 10 ms.
    sched.update_cost(8, 16, 0.010)
    assert sched.batch_rows_limit(16) == 4
    # The EMA moves toward new measurements (alpha 0.2).
    sched.update_cost(8, 16, 0.0)
    assert sched.estimate_cost_s(8, 16) == pytest.approx(0.008)
    # Rows are keyed by the runner's padded bucket: 5 and 8 rows share a key.
    assert sched.estimate_cost_s(5, 16) == sched.estimate_cost_s(8, 16)
    # At least one row even when a single row blows the budget.
    sched.update_cost(1, 16, 1.0)
    sched.update_cost(2, 16, 2.0)
    assert sched.schedule().rows == 1


def test_realtime_ignores_batch_budget():
    sched, _ = make(max_sessions=64, batch_step_budget_s=0.001)
    sched.update_cost(1, 1, 0.01)
    for slot in range(64):
        open_session(sched, slot, RT)
        sched.add_frames(slot, 1, 0.0)
    assert sched.schedule().rows == 64


def test_update_cost_rejects_bad_measurements():
    sched, _ = make(max_batch=8)
    for rows, frames, seconds in ((0, 1, 0.1), (9, 1, 0.1), (1, 0, 0.1), (1, 1, -1.0), (1, 1, math.nan)):
        with pytest.raises(ValueError):
            sched.update_cost(rows, frames, seconds)


# -- admission -----------------------------------------------------------------------------------------


def test_admission_full():
    sched, _ = make(max_sessions=2)
    open_session(sched, 0, RT)
    open_session(sched, 1, RT)
    for priority in (RT, BATCH):
        with pytest.raises(AdmissionError) as err:
            sched.admit(priority)
        assert err.value.reason == "full"
        assert "2 sessions" in str(err.value)
    assert sched.stats.rejected == 2
    sched.remove(1)
    assert sched.admit(BATCH) is None


def test_realtime_preempts_newest_batch():
    sched, _ = make(max_sessions=4)
    open_session(sched, 3, BATCH)
    open_session(sched, 0, BATCH)  # admitted last, though its slot number is lowest
    open_session(sched, 1, RT)
    open_session(sched, 2, BATCH)
    sched.add_frames(2, 5, 0.0)
    sched.remove(2)  # the newest BATCH leaves by itself: slot 0 is now the newest
    open_session(sched, 2, RT)
    sched.add_frames(0, 7, 0.0)
    with pytest.raises(AdmissionError):
        sched.admit(BATCH)  # a full engine refuses BATCH outright
    assert sched.admit(RT) == 0
    assert sched.pending(0) == 0 and sched.num_active == 3
    assert sched.stats.shed == 1 and sched.stats.frames_dropped == 12
    assert not sched.has_work()
    sched.add(0, RT)  # the engine ends the shed session, frees slot 0 and gives it to the newcomer
    assert sched.admit(RT) == 3
    sched.add(3, RT)
    with pytest.raises(AdmissionError):
        sched.admit(RT)  # no BATCH left to shed


# -- remove --------------------------------------------------------------------------------------------


def test_remove_is_clean_and_slots_are_reused():
    sched, _ = make()
    for slot in range(3):
        open_session(sched, slot, RT)
        sched.add_frames(slot, 6, 0.0)
    open_session(sched, 3, BATCH)
    sched.add_frames(3, 40, 0.0)
    assert sched.schedule().slots == [0, 1, 2]  # T=4; each keeps 2 frames
    assert sched.remove(1) and sched.remove(3)
    assert not sched.remove(1) and not sched.remove(99)
    plans = drain(sched)
    assert all(1 not in p.slots and 3 not in p.slots for p in plans)
    assert [(p.slots, p.frames) for p in plans] == [([0, 2], 1), ([0, 2], 1)]
    # Reuse slot 1 with the other priority: only the new session's frames count.
    sched.add(1, BATCH)
    assert sched.pending(1) == 0 and not sched.has_work()
    sched.add_frames(1, 1, 1.0)
    plan = sched.schedule()
    assert (plan.priority, plan.slots, plan.frames) == (BATCH, [1], 1)
    assert sched.schedule() is None
    st = sched.stats
    assert st.frames_arrived == st.realtime_frames + st.batch_frames + st.frames_dropped == 59


def test_misuse_raises():
    sched, _ = make(max_sessions=2)
    sched.add(0, RT)
    with pytest.raises(ValueError):
        sched.add(0, RT)
    with pytest.raises(ValueError):
        sched.add(2, RT)
    with pytest.raises(ValueError):
        sched.add_frames(1, 1, 0.0)
    with pytest.raises(ValueError):
        sched.add_frames(0, -1, 0.0)
    sched.add_frames(0, 0, 0.0)
    assert not sched.has_work()


# -- randomized invariants -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_randomized_invariants(seed):
    rng = random.Random(seed)
    config = unit_config(
        max_sessions=rng.choice([4, 16, 40]),
        max_batch=rng.choice([1, 3, 8, 64]),
        deadline_s=0.05,
        batch_step_budget_s=0.004,
    )
    clock = FakeClock()
    sched = Scheduler(config, clock=clock)
    buckets = config.frame_buckets
    cap = {RT: config.realtime_max_frames, BATCH: config.batch_frames}
    # The reference model: per live slot, its priority and one arrival time per pending frame.
    prio: dict[int, Priority] = {}
    frames: dict[int, deque[float]] = {}
    admitted: list[int] = []  # admission order
    arrived = stepped = dropped = misses = 0

    def expected_t(slot: int) -> int:
        return max(b for b in buckets if b <= min(len(frames[slot]), cap[prio[slot]]))

    def forget(slot: int) -> None:
        nonlocal dropped
        dropped += len(frames.pop(slot))
        del prio[slot]
        admitted.remove(slot)

    def step_once(drained: bool = False) -> bool:
        nonlocal stepped, misses
        rt_ready = any(frames[s] for s in prio if prio[s] == RT)
        any_ready = any(frames.values())
        assert sched.has_work() == any_ready
        plan = sched.schedule()
        if plan is None:
            assert not any_ready
            return False
        assert plan.priority == (RT if rt_ready else BATCH)  # realtime never waits behind batch
        assert len(set(plan.slots)) == plan.rows >= 1 and plan.rows <= config.max_batch
        assert plan.frames in buckets and plan.frames <= cap[plan.priority]
        assert plan.now_s == clock.now and len(plan.queue_wait_s) == plan.rows
        if plan.priority == BATCH:
            assert plan.rows <= sched.batch_rows_limit(plan.frames)
        want_misses = 0
        for slot, wait in zip(plan.slots, plan.queue_wait_s, strict=True):
            assert prio[slot] == plan.priority
            assert expected_t(slot) == plan.frames  # so never more than arrived
            assert wait == clock.now - frames[slot][0]
            for _ in range(plan.frames):
                a = frames[slot].popleft()
                want_misses += plan.priority == RT and clock.now - a > config.deadline_s
        assert plan.deadline_misses == want_misses
        stepped += plan.rows * plan.frames
        misses += want_misses
        if not drained:
            sched.update_cost(
                plan.rows, plan.frames, rng.uniform(0.0002, 0.0006) * (1 + plan.rows * plan.frames / 64)
            )
        return True

    for _ in range(400):
        clock.now += rng.choice([0.0, 0.005, 0.01, 0.03])
        if rng.random() < 0.3:  # open a session
            priority = rng.choice([RT, BATCH])
            full = len(prio) == config.max_sessions
            try:
                shed = sched.admit(priority)
            except AdmissionError as err:
                assert err.reason == "full" and full
                assert priority == BATCH or not any(prio[s] == BATCH for s in prio)
            else:
                if shed is not None:
                    assert full and priority == RT
                    assert shed == [s for s in admitted if prio[s] == BATCH][-1]
                    forget(shed)
                else:
                    assert not full
                slot = rng.choice([s for s in range(config.max_sessions) if s not in prio])
                sched.add(slot, priority)
                prio[slot], frames[slot] = priority, deque()
                admitted.append(slot)
        if prio and rng.random() < 0.15:  # close a session, pending frames and all
            slot = rng.choice(sorted(prio))
            assert sched.remove(slot)
            forget(slot)
        for slot in prio:  # frames arrive, sometimes late and in bursts
            if rng.random() < 0.6:
                n = rng.choice([0, 1, 1, 1, 2, 5, 17])
                arrival = max(frames[slot][-1] if frames[slot] else 0.0, clock.now - rng.choice([0.0, 0.08]))
                sched.add_frames(slot, n, arrival)
                frames[slot].extend([arrival] * n)
                arrived += n
        for _ in range(rng.randint(0, 4)):
            if not step_once():
                break
        assert sched.num_active == len(prio)
        assert all(sched.pending(s) == len(frames[s]) for s in prio)
        st = sched.stats
        assert st.frames_arrived == arrived and st.frames_dropped == dropped and st.deadline_misses == misses
        assert st.realtime_frames + st.batch_frames == stepped
        assert arrived == stepped + dropped + sum(len(f) for f in frames.values())

    clock.now += 1.0
    while step_once(drained=True):
        pass
    assert not sched.has_work() and all(not f for f in frames.values())
    assert arrived == stepped + dropped


def test_realtime_batch_window_gathers_rows():
    clock = FakeClock()
    sched = Scheduler(unit_config(max_sessions=8, max_batch=3, realtime_batch_window_s=0.004), clock=clock)
    for slot in range(4):
        open_session(sched, slot, RT)
    sched.add_frames(0, 1, 0.000)
    clock.now = 0.002
    assert not sched.has_work() and sched.schedule() is None  # the first frame waits for company
    assert sched.realtime_due_s() == pytest.approx(0.004)
    sched.add_frames(1, 1, 0.002)
    clock.now = 0.004
    assert sched.schedule().slots == [0, 1]  # due: both share one step
    # max_batch ready sessions step at once, without waiting out the window.
    for slot in range(3):
        sched.add_frames(slot, 1, 0.005)
    clock.now = 0.005
    assert sched.schedule().slots == [0, 1, 2]
    # Frames left over by a full step keep their age: due once their own window has passed.
    for slot in range(4):
        sched.add_frames(slot, 1, 0.006)
    clock.now = 0.006
    assert sched.schedule().rows == 3 and not sched.has_work()
    clock.now = 0.010
    assert sched.schedule().slots == [3]


def test_an_ended_utterance_steps_at_once_and_before_older_frames():
    """``end_utterance``: the session's frames are due now (no batching window), its (model, T) group
    steps before the other realtime frames, even older ones, until nothing of it is left; then the
    window applies again."""
    clock = FakeClock()
    config = unit_config(max_sessions=8, max_batch=8, realtime_batch_window_s=0.004, realtime_max_frames=16)
    sched = Scheduler(config, clock=clock)
    for slot in range(4):
        open_session(sched, slot, RT)
    for slot in (0, 1, 2):
        sched.add_frames(slot, 1, 0.000)  # live frames, waiting for company
    sched.add_frames(3, 24, 0.001)  # an utterance's last frames and its end-of-utterance silence
    clock.now = 0.002
    assert sched.schedule() is None  # without the end: the window still runs
    sched.end_utterance(3)
    assert sched.realtime_due_s() == -math.inf
    first = sched.schedule()
    assert (first.slots, first.frames) == ([3], 16)  # before the older live frames
    second = sched.schedule()
    assert (second.slots, second.frames) == ([3], 4)
    third = sched.schedule()
    assert (third.slots, third.frames) == ([3], 4)  # all 24 frames stepped, three steps in a row
    assert sched.schedule() is None  # the live frames wait out their window again
    clock.now = 0.004
    assert sched.schedule().slots == [0, 1, 2]
    # Ending a session with nothing pending, or a BATCH one, changes nothing.
    sched.end_utterance(3)
    open_session(sched, 5, BATCH)
    sched.add_frames(5, 4, 0.004)
    sched.end_utterance(5)
    sched.add_frames(0, 1, 0.005)
    assert sched.realtime_due_s() == pytest.approx(0.009)


def test_ending_utterances_share_steps_and_a_removed_session_is_forgotten():
    clock = FakeClock()
    config = unit_config(max_sessions=8, max_batch=8, realtime_batch_window_s=0.004, realtime_max_frames=16)
    sched = Scheduler(config, clock=clock)
    for slot in range(4):
        open_session(sched, slot, RT)
    for slot in (1, 2):
        sched.add_frames(slot, 16, 0.0)
        sched.end_utterance(slot)
    sched.add_frames(3, 16, 0.0)  # the same T, not ending: joins the step
    sched.add_frames(0, 4, 0.0)
    sched.end_utterance(0)
    sched.remove(0)
    plan = sched.schedule()
    assert (plan.slots, plan.frames) == ([1, 2, 3], 16)
    assert sched.schedule() is None and sched.realtime_due_s() is None


# -- BATCH beside realtime: what realtime leaves -----------------------------------------------------


def run_realtime_load(sched: Scheduler, clock: FakeClock, slot: int, share: float, seconds: float) -> None:
    """Realtime steps taking ``share`` of the time for ``seconds``: one frame every 10 ms, each step
    measured at ``share * 10 ms``."""
    end = clock.now + seconds
    while clock.now < end:
        sched.add_frames(slot, 1, clock.now)
        plan = sched.schedule()
        assert plan is not None and plan.priority == RT
        clock.now += 0.010 * share
        sched.update_cost(plan.rows, plan.frames, 0.010 * share, RT)
        clock.now += 0.010 * (1 - share)


@pytest.mark.parametrize(
    ("duty", "realtime_share", "engine_load", "gap_steps"),
    [
        (0.5, 0.0, 0.0, 1.0),  # no realtime: BATCH takes half the time, as before
        (0.5, 0.3, 0.0, 4.0),  # realtime took 0.3: BATCH gets 0.2, so after a step of d it waits 4d
        (0.5, 0.6, 0.0, 19.0),  # realtime past the cap: BATCH keeps its floor of 0.05 (waits 19d)
        (1.0, 0.6, 0.0, 0.0),  # duty 1 (CUDA): BATCH takes all that realtime leaves, no gap
        # The engine's whole realtime load (engine/core.py sets it once per load window), the larger counting:
        (0.5, 0.0, 0.3, 4.0),  # realtime's frames kept the loop busy 0.3 outside steps: BATCH gets 0.2
        (0.5, 0.3, 0.1, 4.0),  # a load measured under the realtime steps' share: the steps' share counts
        (0.5, 0.0, 0.6, 19.0),  # past the cap: the floor
    ],
)
def test_batch_share_is_the_duty_minus_what_realtime_took(duty, realtime_share, engine_load, gap_steps):
    sched, clock = make(max_sessions=8, batch_max_duty=duty, batch_min_duty=0.05, realtime_load_window_s=0.5)
    open_session(sched, 0, RT)
    open_session(sched, 1, BATCH)
    if realtime_share:
        run_realtime_load(sched, clock, 0, realtime_share, 3.0)  # six windows: the average has settled
        assert sched.realtime_share() == pytest.approx(realtime_share, rel=0.05)
    sched.realtime_load = engine_load
    sched.add_frames(1, 1000, clock.now)
    plan = sched.schedule()
    assert plan.priority == BATCH
    step_s = 0.004
    clock.now += step_s
    sched.update_cost(plan.rows, plan.frames, step_s, BATCH)
    if gap_steps:
        assert sched.schedule() is None
    assert sched.next_due_s() - clock.now == pytest.approx(gap_steps * step_s, rel=0.06)
    clock.now += gap_steps * step_s * 1.07
    assert sched.schedule().priority == BATCH


@pytest.mark.parametrize("duty", [0.5, 1.0])
def test_squeezed_batch_gets_only_its_floor_share_and_still_runs(duty):
    sched, clock = make(max_sessions=8, batch_max_duty=duty, batch_min_duty=0.05)
    open_session(sched, 1, BATCH)
    sched.batch_squeezed = True  # (the engine under realtime pressure: engine/headroom.py)
    sched.add_frames(1, 1000, clock.now)
    step_s = 0.004
    for _ in range(3):
        plan = sched.schedule()
        assert plan.priority == BATCH
        clock.now += step_s
        sched.update_cost(plan.rows, plan.frames, step_s, BATCH)
        assert sched.schedule() is None  # with nothing realtime to step: 5% of the time, a step per 20
        assert sched.next_due_s() - clock.now == pytest.approx(19 * step_s)
        clock.now += 19 * step_s
    sched.batch_squeezed = False
    plan = sched.schedule()
    clock.now += step_s
    sched.update_cost(plan.rows, plan.frames, step_s, BATCH)
    assert sched.next_due_s() - clock.now == pytest.approx(step_s * (1 / duty - 1))


@pytest.mark.parametrize("duty", [0.5, 1.0])
def test_a_squeeze_that_begins_or_ends_between_two_batch_steps_moves_the_next_one(duty):
    # The engine's stage changes once per load window, at any point of a BATCH step's gap: the next step obeys
    # the stage as it is when that step is due, not as it was when the last one ended.
    sched, clock = make(max_sessions=8, batch_max_duty=duty, batch_min_duty=0.05)
    open_session(sched, 1, BATCH)
    sched.add_frames(1, 10_000, clock.now)
    step_s = 0.004
    unsqueezed, floor = step_s * (1 / duty - 1), 19 * step_s

    def batch_step() -> None:
        plan = sched.schedule()
        assert plan is not None and plan.priority == BATCH
        clock.now += step_s
        sched.update_cost(plan.rows, plan.frames, step_s, BATCH)

    batch_step()
    assert sched.next_due_s() - clock.now == pytest.approx(unsqueezed)
    sched.batch_squeezed = True  # (the BATCH_SQUEEZED stage begins right after the step)
    assert sched.next_due_s() - clock.now == pytest.approx(floor)
    clock.now += unsqueezed
    assert sched.schedule() is None
    clock.now = sched.next_due_s()
    batch_step()
    assert sched.next_due_s() - clock.now == pytest.approx(floor)
    sched.batch_squeezed = False  # (the load fell: BATCH recovers at once, not after the floor's gap)
    assert sched.next_due_s() - clock.now == pytest.approx(unsqueezed)
    assert sched.stats.batch_steps == 2


@pytest.mark.parametrize("duty", [0.5, 1.0])
def test_a_realtime_step_near_its_deadline_squeezes_batch_at_once_for_a_load_window(duty):
    # Deadline 100 ms (UNIT): a realtime frame that waited 50 ms or more presses; one that waited 40 does not.
    sched, clock = make(max_sessions=8, batch_max_duty=duty, batch_min_duty=0.05, realtime_load_window_s=0.5)
    open_session(sched, 0, RT)
    open_session(sched, 1, BATCH)
    sched.add_frames(1, 10_000, clock.now)
    step_s = 0.004

    def batch_step() -> float:
        """A BATCH step of ``step_s``; returns how long the next one waits (nothing realtime pending)."""
        plan = sched.schedule()
        assert plan is not None and plan.priority == BATCH
        clock.now += step_s
        sched.update_cost(plan.rows, plan.frames, step_s, BATCH)
        return sched.next_due_s() - clock.now

    def realtime_step(waited_s: float) -> None:
        sched.add_frames(0, 1, clock.now)
        clock.now += waited_s  # (BATCH work, a slow collection, a neighbour: the frame waited)
        plan = sched.schedule()
        assert plan.priority == RT
        sched.update_cost(plan.rows, plan.frames, 0.001, RT)

    unsqueezed = step_s * (1 / duty - 1)
    assert batch_step() == pytest.approx(unsqueezed, abs=1e-9)
    realtime_step(0.040)
    assert sched.stats.pressed == 0
    clock.now = sched.next_due_s()
    assert batch_step() == pytest.approx(unsqueezed, rel=0.1, abs=1e-4)  # (the realtime step's share: tiny)

    realtime_step(0.055)
    assert sched.stats.pressed == 1
    pressed_at = clock.now
    for _ in range(3):  # its floor share: a 4 ms step per 80 ms, 19 x 4 ms between
        clock.now = sched.next_due_s()
        assert batch_step() == pytest.approx(19 * step_s)
    clock.now = pressed_at + 0.5  # a load window later, and no realtime frame near its deadline since
    clock.now = max(clock.now, sched.next_due_s())
    assert batch_step() == pytest.approx(unsqueezed, rel=0.1, abs=1e-4)
    assert sched.stats.pressed == 1


def test_realtime_share_decays_when_realtime_stops():
    sched, clock = make(max_sessions=8, realtime_load_window_s=0.5)
    open_session(sched, 0, RT)
    run_realtime_load(sched, clock, 0, 0.4, 3.0)
    assert sched.realtime_share() == pytest.approx(0.4, rel=0.05)
    clock.now += 2.0  # four time constants
    assert sched.realtime_share() == pytest.approx(0.4 * math.exp(-4), rel=0.05)


def test_a_batch_step_waits_for_realtime_frames_due_before_it_would_end():
    sched, clock = make(max_sessions=8, realtime_batch_window_s=0.006, batch_min_duty=0.05)
    open_session(sched, 0, RT)
    open_session(sched, 1, BATCH)
    sched.add_frames(1, 1000, 0.0)
    plan = sched.schedule()
    clock.now = 0.005
    sched.update_cost(plan.rows, plan.frames, 0.005, BATCH)  # a BATCH step takes 5 ms
    sched.add_frames(0, 1, 0.005)  # a realtime frame, due at 0.011
    clock.now = 0.007
    assert sched.schedule() is None  # a BATCH step now would end at 0.012: the realtime frame goes first
    assert sched.next_due_s() == pytest.approx(0.011)  # and the engine sleeps until then, not spins
    clock.now = 0.011
    assert sched.schedule().priority == RT
    assert sched.schedule().priority == BATCH  # nothing realtime waits: BATCH goes on
    clock.now = 0.016
    sched.update_cost(plan.rows, plan.frames, 0.005, BATCH)
    # Realtime frames always due soon would starve BATCH: past its floor (5 ms / 0.05 - 5 ms = 95 ms
    # after its last step) a BATCH step runs anyway.
    clock.now = 0.110
    sched.add_frames(0, 1, 0.108)
    assert sched.schedule() is None
    clock.now = 0.111
    sched.add_frames(0, 1, 0.111)
    assert sched.schedule().priority == BATCH
