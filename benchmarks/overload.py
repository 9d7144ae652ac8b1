"""Overload: more REALTIME sessions than the engine can step in time, with a BATCH flood, with admission by
headroom (``serve --admit-load 0.9``, the default) and without it (``--admit-load 0``), side by side.

Each round starts both servers in turn and runs the latency probe against each: N REALTIME streams whose
starts are spread over ``--ramp-s`` (so the engine's load is measured as they arrive) and M BATCH sessions
sent as fast as flow control allows. Reports, per configuration: the realtime sessions admitted and refused
(RESOURCE_EXHAUSTED), the admitted ones' chunk latency p50/p99 and deadline misses, and the BATCH
sessions' errors and speed. Pick N past the machine's capacity (``benchmarks/capacity.py`` finds it).

    python -m benchmarks.overload --realtime 120 --batch 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks._harness import Server, dump, p, probe
from cosystream.v1.client import HelpFormatter

CONFIGS = {"admission by load": ["--admit-load", "0.9"], "by count only": ["--admit-load", "0"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--realtime", type=int, default=120)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ramp-s", type=float, default=15.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--chunk-ms", type=int, default=10)
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    common = [
        *("--realtime", str(args.realtime), "--batch", str(args.batch), "--chunk-ms", str(args.chunk_ms)),
        *("--duration", str(args.duration), "--ramp-s", str(args.ramp_s)),
    ]
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, flags in CONFIGS.items():  # (alternating, in one sitting)
            limit = str(args.realtime + args.batch + 8)
            with Server("--max-sessions", limit, "--frontends", str(args.frontends), *flags) as server:
                result, cpu_s = probe(server, *common)
            rt, bt = result["classes"]["realtime"], result["classes"].get("batch", {})
            runs[name].append(
                {
                    "realtime_admitted": rt["sessions"] - rt["errors"],
                    "realtime_refused": rt["errors"],
                    "realtime_p50_ms": p(rt, "chunk_latency_ms", "p50"),
                    "realtime_p99_ms": p(rt, "chunk_latency_ms", "p99"),
                    "deadline_misses": rt["deadline_misses"],
                    "batch_errors": bt.get("errors", 0),
                    "batch_realtime_factor": bt.get("realtime_factor"),
                    "server_cpu_s": cpu_s,
                }
            )
    dump({"config": vars(args), "runs": runs}, args.json)
    print(
        f"\n{'':<20} {'admitted':>9} {'refused':>8} {'rt p50 ms':>10} {'rt p99 ms':>10} {'misses':>8} "
        f"{'batch err':>9} {'batch x rt':>10}"
    )
    for name, rounds in runs.items():
        for run in rounds:
            factor = run["batch_realtime_factor"]
            print(
                f"{name:<20} {run['realtime_admitted']:>9} {run['realtime_refused']:>8} "
                f"{run['realtime_p50_ms']:>10.1f} {run['realtime_p99_ms']:>10.1f} {run['deadline_misses']:>8} "
                f"{run['batch_errors']:>9} {factor if factor is None else round(factor, 1)!s:>10}"
            )
    medians = {name: statistics.median(r["realtime_p99_ms"] for r in rounds) for name, rounds in runs.items()}
    print("median realtime p99: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
