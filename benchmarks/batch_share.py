"""The scheduler's BATCH share beside realtime, simulated: no model, no processes, a clock that only moves.

The engine loop is replayed with the step costs of a model measured elsewhere (default: the embedded model's
eager CPU step, one thread: 2.9 ms per step + 0.1 ms per row-frame, +0.6 ms for T > 1): ``--realtime N``
streams send one 10 ms frame each every 10 ms (staggered), ``--batch M`` sessions always have frames
queued. Reports, for this checkout's scheduler and (``--ref REV``) another revision's side by side:
realtime frame arrival -> result p50/p99, deadline misses, the engine's busy share (realtime, BATCH,
total) and how many times real time each BATCH session went. Deterministic: the same numbers every run,
whatever else the machine does, so it isolates the scheduling policy from the machine's noise (it does
not model the frontends' CPU, which is why the total busy share matters on shared cores).

    python -m benchmarks.batch_share --ref HEAD~2 --realtime 10 20 30 --batch 2
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from cosystream.runtime.buckets import FRAME_BUCKETS, batch_buckets

ROOT = Path(__file__).resolve().parents[1]
MAX_SESSIONS = 64


def step_cost_s(rows: int, frames: int, fixed_s: float, per_row_frame_s: float) -> float:
    bucket = next(b for b in batch_buckets(MAX_SESSIONS) if b >= rows)
    return fixed_s + per_row_frame_s * bucket * frames + (0.0006 if frames > 1 else 0.0)


def scheduler_at(rev: str | None) -> ModuleType:
    """``cosystream/engine/scheduler.py`` of ``rev`` (None: this checkout's) as a module."""
    if rev is None:
        from cosystream.engine import scheduler

        return scheduler
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:cosystream/engine/scheduler.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="cosystream-sched-")) / "scheduler_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("scheduler_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def simulate(s: ModuleType, realtime: int, batch: int, seconds: float, args: argparse.Namespace) -> dict:
    clock = [0.0]
    config = s.SchedulerConfig(
        max_sessions=MAX_SESSIONS,
        max_batch=MAX_SESSIONS,
        frame_buckets=FRAME_BUCKETS,
        batch_max_duty=args.batch_duty,
    )
    sched = s.Scheduler(config, clock=lambda: clock[0])
    for slot in range(realtime + batch):
        priority = s.Priority.REALTIME if slot < realtime else s.Priority.BATCH
        sched.admit(priority)
        sched.add(slot, priority)
    arrivals = sorted(
        (k * 0.010 + i * 0.010 / max(realtime, 1), i) for i in range(realtime) for k in range(int(seconds * 100))
    )
    next_arrival, latencies, batch_frames = 0, [], 0
    busy = {s.Priority.REALTIME: 0.0, s.Priority.BATCH: 0.0}
    while clock[0] < seconds:
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= clock[0]:
            sched.add_frames(arrivals[next_arrival][1], 1, arrivals[next_arrival][0])
            next_arrival += 1
        for slot in range(realtime, realtime + batch):  # (a frontend keeps 128 frames in flight)
            if sched.pending(slot) < 64:
                sched.add_frames(slot, 128, clock[0])
        plan = sched.schedule()
        if plan is None:
            arrival = arrivals[next_arrival][0] if next_arrival < len(arrivals) else seconds
            due = sched.next_due_s()
            clock[0] = max(clock[0] + 1e-6, arrival if due is None else min(arrival, due))
            continue
        cost_s = step_cost_s(plan.rows, plan.frames, args.fixed_ms / 1e3, args.per_row_frame_ms / 1e3)
        clock[0] += cost_s
        sched.update_cost(plan.rows, plan.frames, cost_s, plan.priority)
        busy[plan.priority] += cost_s
        if plan.priority == s.Priority.REALTIME:
            latencies.extend(wait + cost_s for wait in plan.queue_wait_s)
        else:
            batch_frames += plan.rows * plan.frames
    latencies.sort()

    def q(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1e3 if latencies else float("nan")

    return {
        "realtime": realtime,
        "batch": batch,
        "p50_ms": q(0.5),
        "p99_ms": q(0.99),
        "deadline_misses": sched.stats.deadline_misses,
        "busy_realtime": busy[s.Priority.REALTIME] / seconds,
        "busy_batch": busy[s.Priority.BATCH] / seconds,
        "batch_x_realtime": batch_frames / seconds / 100 / batch if batch else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default=None, help="also simulate this revision's scheduler")
    parser.add_argument("--realtime", type=int, nargs="+", default=[10, 20, 30])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--batch-duty", type=float, default=0.5, help="serve --batch-duty (0.5: the CPU default)")
    parser.add_argument("--fixed-ms", type=float, default=2.9, help="a step's fixed cost")
    parser.add_argument("--per-row-frame-ms", type=float, default=0.1, help="a step's cost per padded row-frame")
    args = parser.parse_args(argv)
    trees = {"new": scheduler_at(None)} | ({"ref": scheduler_at(args.ref)} if args.ref else {})
    print(
        f"{'tree':>4} {'rt':>4} {'batch':>5} {'p50 ms':>7} {'p99 ms':>7} {'misses':>7} {'busy rt':>8} "
        f"{'busy batch':>10} {'total':>6} {'batch x rt':>10}"
    )
    for realtime in args.realtime:
        for batch in (0, args.batch):
            for name, module in trees.items():
                if batch == 0 and name == "ref":
                    continue  # (no BATCH: the change does nothing)
                r = simulate(module, realtime, batch, args.seconds, args)
                factor = "" if r["batch_x_realtime"] is None else f"{r['batch_x_realtime']:.1f}"
                print(
                    f"{name if batch else 'both':>4} {realtime:>4} {batch:>5} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} "
                    f"{r['deadline_misses']:>7} {r['busy_realtime']:>8.2f} {r['busy_batch']:>10.2f} "
                    f"{r['busy_realtime'] + r['busy_batch']:>6.2f} {factor:>10}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
