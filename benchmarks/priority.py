"""Priority isolation: realtime latency with and without a BATCH flood, side by side in one run.

Runs the latency probe against one server, alternating ``--rounds`` times: N REALTIME streams alone, then the
same N streams while M BATCH sessions send files as fast as flow control allows. Reports realtime
chunk-latency p50/p99 of every run, how much the medians' p99 moved, deadline misses, and how many times real
time the BATCH sessions ran.

    python -m benchmarks.priority --realtime 40 --batch 4 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from statistics import median

from benchmarks._harness import Server, dump, p, probe
from cosystream.v1.client import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--realtime", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--chunk-ms", type=int, default=10)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=3, help="alone and flooded, alternating this many times (medians reported)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    common = ["--realtime", str(args.realtime), "--chunk-ms", str(args.chunk_ms), "--duration", str(args.duration)]
    rounds: list[dict[str, dict]] = []
    with Server(
        "--max-sessions", str(args.realtime + args.batch + 8), "--frontends", str(args.frontends)
    ) as server:
        for _ in range(args.rounds):
            runs = {}
            for name, extra in (("alone", []), ("with_batch_flood", ["--batch", str(args.batch)])):
                result, cpu_s = probe(server, *common, *extra)
                rt, bt = result["classes"]["realtime"], result["classes"]["batch"]
                runs[name] = {
                    "realtime_p50_ms": p(rt, "chunk_latency_ms", "p50"),
                    "realtime_p99_ms": p(rt, "chunk_latency_ms", "p99"),
                    "realtime_first_result_p50_ms": p(rt, "first_result_ms", "p50"),
                    "deadline_misses": rt["deadline_misses"],
                    "errors": rt["errors"] + bt["errors"],
                    "batch_sessions": bt["sessions"],
                    "batch_realtime_factor": bt.get("realtime_factor"),
                    "server_cpu_s": cpu_s,
                }
            rounds.append(runs)
    medians = {
        name: {key: median(run[name][key] for run in rounds) for key in ("realtime_p50_ms", "realtime_p99_ms")}
        for name in ("alone", "with_batch_flood")
    }
    alone, flood = medians["alone"], medians["with_batch_flood"]
    summary = {
        "config": vars(args),
        "rounds": rounds,
        "medians": medians,
        # Of the medians: one round's tail moves more from one minute to the next than a flood moves it.
        "p99_change": flood["realtime_p99_ms"] / alone["realtime_p99_ms"] - 1,
        "p50_change": flood["realtime_p50_ms"] / alone["realtime_p50_ms"] - 1,
        "batch_realtime_factor_min": min(
            (run["with_batch_flood"]["batch_realtime_factor"] or 0.0) for run in rounds
        ),
        "errors": sum(run[name]["errors"] for run in rounds for name in run),
    }
    dump(summary, args.json)
    print(f"\n{'round':>5} {'run':<18} {'rt p50 ms':>10} {'rt p99 ms':>10} {'misses':>7} {'batch x realtime':>17}")
    for number, runs in enumerate(rounds, 1):
        for name, run in runs.items():
            factor = run["batch_realtime_factor"]
            print(
                f"{number:>5} {name:<18} {run['realtime_p50_ms']:>10.1f} {run['realtime_p99_ms']:>10.1f}"
                f" {run['deadline_misses']:>7} {factor if factor is None else round(factor, 1)!s:>17}"
            )
    print(
        f"medians: realtime p99 {alone['realtime_p99_ms']:.1f} -> {flood['realtime_p99_ms']:.1f} ms, moved"
        f" {summary['p99_change'] * 100:+.0f}% (p50 {summary['p50_change'] * 100:+.0f}%) under a flood of"
        f" {args.batch} BATCH sessions at x{summary['batch_realtime_factor_min']:.1f} real time or faster;"
        f" {summary['errors']} errors"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
