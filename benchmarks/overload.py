"""Overload: a flood of REALTIME arrivals and BATCH sessions past capacity, with admission by headroom
(``serve --admit-load 0.9``, the default) and without it (``--admit-load 0``), against the same streams alone.

Each round starts a server per configuration, in turn, and runs two latency probes against it at once:
``--base`` REALTIME streams already in service (their latency is the figure: what a flood costs the
sessions a server has taken), and, from ``--flood-after-s`` on, the flood: ``--realtime`` more REALTIME
streams arriving over ``--ramp-s`` and ``--batch`` BATCH sessions sending as fast as flow control allows.
The "alone" configuration runs the base streams only. Reports, per configuration: the base streams' chunk
latency p50/p99 and deadline misses, the arrivals admitted and refused (RESOURCE_EXHAUSTED, with a
RetryInfo), the admitted arrivals' p99, the BATCH sessions' errors and speed, and the engine's load
(``cosystream_engine_load``, sampled every 0.25 s: median and max).

``--engine-share`` emulates a host whose engine is the limit (a GPU server, a large CPU host): the engine
alone on the last CPU with about that share of it, the frontends and the probes on the others
(``benchmarks/_harness.py``). Without it, on a small host the probes and frontends saturate the cores
before the engine does, so no signal the server has sees the backlog (docs/PERFORMANCE.md, "Overload").

``--admit-lag-ms MS`` adds a configuration with the frontends' loop lag refusing as well (``serve
--admit-lag-ms``), ``--admit-late-ms MS`` one with their audio lateness (``serve --admit-late-ms``),
``--admit-cpu F [F ...]`` one per share with their host's projected CPU (``serve --admit-cpu``); every
configuration reports the lateness (``LoadStatus.audio_late_ms``) and the cores busy on the frontend's CPUs
(``LoadStatus.host_cpu_busy``), sampled every 0.25 s: median and max. ``--skip NAME`` leaves a
configuration out ("by count only", say).

On a GPU host (``benchmarks/gpu_check.sh``, its ``overload`` stage) the engine is on the device and the
frontends and probes have cores of their own: ``--device cuda``, ``--wav`` (no espeak-ng there) and
``--probe-processes`` (each probe's streams over that many processes).

    python -m benchmarks.overload --base 10 --realtime 40 --batch 4 --engine-share 0.5 --rounds 3
    python -m benchmarks.overload --device cuda --frontends 8 --probe-processes 4 --wav speech.wav \
        --base 100 --realtime 600 --batch 16 --skip "by count only"
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

from benchmarks._harness import Server, dump, p, probe, run_probe
from cosystream.v1.client import HelpFormatter

CONFIGS = {"alone": ["--admit-load", "0.9"], "admission by load": ["--admit-load", "0.9"]}
CONFIGS["by count only"] = ["--admit-load", "0"]


def sample_load(
    server: Server, stop: threading.Event, loads: list[float], late: list[float], cpu: list[float]
) -> None:
    """``cosystream_engine_load``, ``LoadStatus.audio_late_ms`` and ``host_cpu_busy`` (GetServerInfo) every
    0.25 s until ``stop``."""
    import grpc

    from cosystream.v1 import cosystream_pb2 as pb
    from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CosyStreamStub(channel)
        while not stop.wait(0.25):
            try:
                text = urllib.request.urlopen(server.metrics_url, timeout=2).read().decode()
                load = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).load
                late.append(load.audio_late_ms)
                cpu.append(load.host_cpu_busy)
            except (OSError, grpc.RpcError):
                continue
            loads.extend(float(v) for v in re.findall(r'^cosystream_engine_load\{engine="0"\} (\S+)$', text, re.M))


def probe_flags(args: argparse.Namespace) -> list[str]:
    """The probes' audio (``--wav``; default: espeak-ng's speech) and processes."""
    return ["--processes", str(args.probe_processes)] + (["--wav", *args.wav] if args.wav else [])


def run_flood(server: Server, args: argparse.Namespace, results: list[dict]) -> None:
    """After ``--flood-after-s``, the flood's probe; its JSON appended to ``results``."""
    time.sleep(args.flood_after_s)
    flood = [
        *("--realtime", str(args.realtime), "--batch", str(args.batch), "--chunk-ms", str(args.chunk_ms)),
        *("--duration", str(args.duration), "--ramp-s", str(args.ramp_s)),
        *probe_flags(args),
    ]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        results.append(run_probe(server, out.name, *flood))


def run_one(name: str, flags: list[str], args: argparse.Namespace) -> dict:
    """One server with ``flags``: the base streams, and the flood beside them unless ``name`` is "alone"."""
    limit = str(args.base + args.realtime + args.batch + 8)
    base_s = args.flood_after_s + args.ramp_s + args.duration + 2  # (the base streams outlast the flood)
    base = ["--realtime", str(args.base), "--chunk-ms", str(args.chunk_ms), "--duration", str(base_s)]
    base += probe_flags(args)
    serve = ["--max-sessions", limit, "--frontends", str(args.frontends), *flags]
    if args.device:
        serve += ["--device", args.device]
    with Server(*serve, engine_share=args.engine_share) as server:
        loads: list[float] = []
        late: list[float] = []
        cpu: list[float] = []
        stop = threading.Event()
        threading.Thread(target=sample_load, args=(server, stop, loads, late, cpu), daemon=True).start()
        floods: list[dict] = []
        flood = threading.Thread(target=run_flood, args=(server, args, floods))
        if name != "alone":
            flood.start()
        result, cpu_s = probe(server, "--ramp-s", "0", *base)
        if name != "alone":
            flood.join()
        stop.set()
    flood_result = floods[0] if floods else None
    rt = result["classes"]["realtime"]
    run = {
        "base_p50_ms": p(rt, "chunk_latency_ms", "p50"),
        "base_p99_ms": p(rt, "chunk_latency_ms", "p99"),
        "base_errors": rt["errors"],
        "base_deadline_misses": rt["deadline_misses"],
        "engine_load_median": statistics.median(loads) if loads else None,
        "engine_load_max": max(loads) if loads else None,
        "audio_late_ms_median": statistics.median(late) if late else None,
        "audio_late_ms_max": max(late) if late else None,
        "host_cpu_busy_median": statistics.median(cpu) if cpu else None,
        "host_cpu_busy_max": max(cpu) if cpu else None,
        "server_cpu_s": cpu_s,
    }
    if flood_result is not None:
        arrivals, bt = flood_result["classes"]["realtime"], flood_result["classes"].get("batch", {})
        run |= {
            "arrivals_admitted": arrivals["sessions"] - arrivals["errors"],
            "arrivals_refused": arrivals["errors"],
            "arrivals_p99_ms": p(arrivals, "chunk_latency_ms", "p99"),
            "batch_errors": bt.get("errors", 0),
            "batch_realtime_factor": bt.get("realtime_factor"),
        }
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--base", type=int, default=10, help="REALTIME streams in service before the flood")
    parser.add_argument("--realtime", type=int, default=40, help="REALTIME streams arriving in the flood")
    parser.add_argument("--batch", type=int, default=4, help="BATCH sessions in the flood")
    parser.add_argument("--flood-after-s", type=float, default=4.0)
    parser.add_argument("--ramp-s", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds each arrival streams")
    parser.add_argument("--chunk-ms", type=int, default=10)
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--device", default=None, help="the engine's device (serve --device; default: serve's)")
    parser.add_argument("--wav", nargs="+", default=None, help="WAV files for the probes (default: espeak-ng)")
    parser.add_argument("--probe-processes", type=int, default=1, help="processes per latency probe (--processes)")
    parser.add_argument(
        "--engine-share",
        type=float,
        default=None,
        help="the engine's share of one CPU (emulates an engine-bound host)",
    )
    parser.add_argument(
        "--admit-lag-ms",
        type=float,
        default=None,
        help="also run admission by load with the frontends' loop lag refusing past this (serve --admit-lag-ms)",
    )
    parser.add_argument(
        "--admit-late-ms",
        type=float,
        default=None,
        help="also run admission by load with the frontends' audio lateness refusing past this "
        "(serve --admit-late-ms)",
    )
    parser.add_argument(
        "--admit-cpu",
        type=float,
        nargs="+",
        default=(),
        help="also run admission by load with the frontends' projected host CPU refusing past each share "
        "(serve --admit-cpu)",
    )
    parser.add_argument("--skip", action="append", default=[], help="leave this configuration out")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configs = dict(CONFIGS)
    if args.admit_lag_ms is not None:
        configs["load and loop lag"] = ["--admit-load", "0.9", "--admit-lag-ms", f"{args.admit_lag_ms:g}"]
    if args.admit_late_ms is not None:
        configs["load and audio lateness"] = ["--admit-load", "0.9", "--admit-late-ms", f"{args.admit_late_ms:g}"]
    for share in args.admit_cpu:
        configs[f"load and CPU {share:g}"] = ["--admit-load", "0.9", "--admit-cpu", f"{share:g}"]
    configs = {name: flags for name, flags in configs.items() if name not in args.skip}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, flags in configs.items():  # (alternating, in one sitting)
            runs[name].append(run_one(name, flags, args))
            time.sleep(1)
    medians = {name: statistics.median(r["base_p99_ms"] for r in rounds) for name, rounds in runs.items()}
    alone = medians.get("alone") or math.nan
    # How far each configuration moved the base streams' p99 from theirs alone (medians over the rounds).
    changes = {name: ms / alone - 1 for name, ms in medians.items()}
    dump({"config": vars(args), "runs": runs, "base_p99_medians": medians, "base_p99_change": changes}, args.json)
    print(
        f"\n{'':<18} {'base p50':>9} {'base p99':>9} {'misses':>7} {'admitted':>9} {'refused':>8} "
        f"{'arr. p99':>9} {'batch err':>9} {'batch x rt':>10} {'load med/max':>13} {'late ms med/max':>15}"
    )
    for name, rounds in runs.items():
        for run in rounds:
            factor = run.get("batch_realtime_factor")
            arrivals_p99 = run.get("arrivals_p99_ms")
            load = (
                f"{run['engine_load_median']:.2f}/{run['engine_load_max']:.2f}" if run["engine_load_max"] else "-"
            )
            late = run.get("audio_late_ms_max")
            late = "-" if late is None else f"{run['audio_late_ms_median']:.0f}/{late:.0f}"
            busy = run.get("host_cpu_busy_max")
            busy = "-" if busy is None else f"{run['host_cpu_busy_median']:.2f}/{busy:.2f}"
            print(
                f"{name:<18} {run['base_p50_ms']:>9.1f} {run['base_p99_ms']:>9.1f} "
                f"{run['base_deadline_misses']:>7} {run.get('arrivals_admitted', '-')!s:>9} "
                f"{run.get('arrivals_refused', '-')!s:>8} {'-' if arrivals_p99 is None else f'{arrivals_p99:.1f}':>9} "
                f"{run.get('batch_errors', '-')!s:>9} {'-' if factor is None else round(factor, 1)!s:>10} {load:>13} "
                f"{late:>15} {busy:>11}"
            )
    print(
        "median base p99: "
        + ", ".join(f"{name} {ms:.1f} ms ({changes[name] * 100:+.0f}%)" for name, ms in medians.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
