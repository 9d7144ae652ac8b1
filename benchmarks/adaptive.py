"""The adaptive model under load, side by side: the same realtime load on HEAVY alone, on LIGHT alone, and
on HEAVY with ``--adaptive HEAVY=LIGHT``, interleaved per stream count in one sitting.

For each count the latency probe (its own process) streams that many realtime sessions; per configuration
it records chunk-to-result p50/p99, deadline misses, errors, the server's CPU per audio second, and for the
adaptive server how often it switched and the share of the run it spent on LIGHT. Prints JSON and a table.

    python -m benchmarks.adaptive                                   # the embedded default and light models
    python -m benchmarks.adaptive --counts 60 80 --duration 10
    python -m benchmarks.adaptive --heavy DIR --light DIR --chunk-ms 20
    python -m benchmarks.adaptive --light embedded:default --light-precision int8   # HEAVY at int8 as LIGHT
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import threading
import time
import urllib.request

from benchmarks._harness import Server, dump, p, probe_cpu, server_seconds
from cosystream.v1.client import HelpFormatter

CONFIGS = ("heavy", "light", "adaptive")


def sampler(server: Server, stop: threading.Event, fallback: list[float], load: list[float]) -> None:
    """Poll ``cosystream_adaptive_fallback`` and ``cosystream_engine_load`` every 100 ms until ``stop``."""
    while not stop.wait(0.1):
        try:
            text = urllib.request.urlopen(server.metrics_url, timeout=2).read().decode()
        except OSError:
            continue
        for series, samples in (
            ('cosystream_adaptive_fallback\\{model="heavy"\\}', fallback),
            ('cosystream_engine_load\\{engine="0"\\}', load),
        ):
            found = re.findall(rf"^{series} (\S+)$", text, re.M)
            if found:
                samples.append(float(found[0]))


def switches(server: Server) -> int:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return int(
        sum(float(v) for v in re.findall(r"^cosystream_adaptive_switches_total\{[^}]*\} (\S+)$", text, re.M))
    )


def serve_args(config: str, heavy: str, light: str, light_precision: str | None, extra: list[str]) -> list[str]:
    precision = ["--precision", f"light={light_precision}"] if light_precision else []
    if config == "heavy":
        return ["--model", f"heavy={heavy}", *extra]
    if config == "light":
        return ["--model", f"light={light}", *precision, *extra]
    models = ["--model", f"heavy={heavy}", "--model", f"light={light}", *precision]
    return [*models, "--adaptive", "heavy=light", *extra]


def run_one(config: str, count: int, args: argparse.Namespace) -> dict:
    extra = ["--max-sessions", str(count + 8), "--frontends", str(args.frontends), "--device", args.device]
    extra += ["--beam-size", str(args.beam_size)] if args.beam_size else []
    extra += ["--adaptive-high", str(args.high)] if args.high and config == "adaptive" else []
    extra += ["--adaptive-low", str(args.low)] if args.low and config == "adaptive" else []
    with Server(*serve_args(config, args.heavy, args.light, args.light_precision, extra)) as server:
        probe_cpu(server, "--realtime", "4", "--duration", "1", "--ramp-s", "0")  # (warm, unmeasured)
        fallback: list[float] = []
        load: list[float] = []
        stop = threading.Event()
        threading.Thread(target=sampler, args=(server, stop, fallback, load), daemon=True).start()
        started = time.monotonic()
        result, cpu = probe_cpu(
            server,
            "--realtime",
            str(count),
            "--chunk-ms",
            str(args.chunk_ms),
            "--duration",
            str(args.duration),
            "--ramp-s",
            "1",
        )
        stop.set()
        rt = result["classes"]["realtime"]
        run = {
            "config": config,
            "streams": count,
            "p50_ms": p(rt, "chunk_latency_ms", "p50"),
            "p99_ms": p(rt, "chunk_latency_ms", "p99"),
            "deadline_misses": rt["deadline_misses"],
            "errors": rt["errors"],
            "server_cpu_ms_per_audio_s": 1e3 * server_seconds(cpu) / rt["audio_seconds"]
            if rt["audio_seconds"]
            else math.nan,
            "seconds": round(time.monotonic() - started, 1),
            # The engine's projected load over the run (the middle half: the ramp and the tail left out).
            "load_mean": round(sum(mid := load[len(load) // 4 : 3 * len(load) // 4]) / max(1, len(mid)), 3),
        }
        if config == "adaptive":
            run["switches"] = switches(server)
            run["light_share"] = round(sum(fallback) / len(fallback), 3) if fallback else math.nan
    line = (
        f"{config:>8} x{count:<4} p50 {run['p50_ms']:7.1f} p99 {run['p99_ms']:8.1f} misses"
        f" {run['deadline_misses']:>5} errors {run['errors']:>3} cpu/audio-s {run['server_cpu_ms_per_audio_s']:6.1f} ms"
        f" load {run['load_mean']:.2f}"
    )
    if config == "adaptive":
        line += f"  switches {run['switches']} on LIGHT {run['light_share']:.0%} of the run"
    print(line, file=sys.stderr)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--heavy", default="embedded:default", help="the HEAVY model (serve --model)")
    parser.add_argument("--light", default="embedded:light", help="the LIGHT model")
    parser.add_argument(
        "--light-precision", default=None, help="serve LIGHT at this precision (e.g. int8: HEAVY's own weights)"
    )
    parser.add_argument("--counts", type=int, nargs="+", default=[40, 60, 80])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--chunk-ms", type=int, default=10)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--beam-size", type=int, default=None, help="serve --beam-size (default: the server's)")
    parser.add_argument("--high", type=float, default=None, help="serve --adaptive-high")
    parser.add_argument("--low", type=float, default=None, help="serve --adaptive-low")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    runs = [run_one(config, count, args) for count in args.counts for config in args.configs]
    dump({"chunk_ms": args.chunk_ms, "duration_s": args.duration, "runs": runs}, args.json)
    print("\n| streams | " + " | ".join(f"{c} p99 ms / misses" for c in args.configs) + " |")
    print("|---|" + "---|" * len(args.configs))
    for count in args.counts:
        cells = [
            f"{r['p99_ms']:.1f} / {r['deadline_misses']}"
            + (f" ({r['light_share']:.0%} on LIGHT)" if r["config"] == "adaptive" else "")
            for config in args.configs
            for r in runs
            if r["streams"] == count and r["config"] == config
        ]
        print(f"| {count} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
