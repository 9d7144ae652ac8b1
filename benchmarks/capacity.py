"""End-to-end capacity: how many REALTIME streams one server carries with p99 <= 20 ms and no misses.

For each mode (the engine, and the naive baseline: one process, a model call per chunk, no batching) and
chunk size (10 ms, 20 ms), runs the latency probe from a separate process at growing stream counts and
records chunk-to-result latency p50/p99, deadline misses, the server's CPU per second of audio and, where
it has them, its GPU gauges mid-run (``gpu``: memory, utilization, power, clocks events per device); the
largest passing count is the capacity. Prints JSON and a table.

    python benchmarks/capacity.py                        # both modes, 10 and 20 ms chunks
    python benchmarks/capacity.py --modes engine --chunk-ms 10 --counts 40 80 120
    python benchmarks/capacity.py --modes engine --chunk-ms 10 --decoders greedy beam   # decoding's cost
    python benchmarks/capacity.py --modes engine --chunk-ms 10 --decoders beam:16 beam:64  # beam widths
    python benchmarks/capacity.py --modes engine --chunk-ms 10 --models DIR_A DIR_B     # two models
    python benchmarks/capacity.py --modes engine --chunk-ms 10 --engines 1 2            # engine processes
    python -m benchmarks.capacity --modes engine --device cuda --frontends 8 --probe-processes 6 \
        --wav speech.wav --counts 200 400 800                  # a GPU box (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import math
import sys

from benchmarks._harness import GpuSample, Server, dump, p, probe_cpu, server_seconds
from cosystream.v1.client import HelpFormatter

DEFAULT_COUNTS = {"engine": [20, 40, 60, 80, 100, 120, 140, 160, 200], "naive": [2, 4, 6, 8, 10, 12, 16, 20, 30]}
P99_LIMIT_MS = 20.0


def measure(
    mode: str,
    chunk_ms: int,
    counts: list[int],
    duration_s: float,
    frontends: int,
    decoder: str,
    model: str | None,
    device: str = "auto",
    wavs: list[str] | None = None,
    probe_processes: int = 1,
    engines: int = 1,
    finalize_after_ms: float | None = None,
    serve_args: tuple[str, ...] = (),
    batch: int = 0,
) -> dict:
    extra = ["--naive"] if mode == "naive" else ["--frontends", str(frontends), "--engines", str(engines)]
    extra += list(serve_args)
    extra += ["--model", model] if model else []
    kind, _, beam_size = decoder.partition(":")
    extra += ["--beam-size", beam_size] if beam_size else []
    probe_extra = ["--processes", str(probe_processes)] + (["--wav", *wavs] if wavs else [])
    measured_extra = ["--batch", str(batch)] if batch else []  # BATCH sessions beside each measured count
    runs = []
    with Server(
        "--max-sessions", str(max(counts) + batch + 8), "--decoder", kind, "--device", device, *extra
    ) as server:
        # Unmeasured: the frontends spawned after the port opened finish starting, every path is warm.
        probe_cpu(server, "--realtime", str(min(4, counts[0])), "--duration", "1", "--ramp-s", "0", *probe_extra)
        for count in counts:
            # Read halfway through the streams (the probe's start-up, its 1 s ramp, half the duration).
            with GpuSample(server, delay_s=1.5 + duration_s / 2) as gpu:
                result, cpu = probe_cpu(
                    server,
                    "--realtime",
                    str(count),
                    "--chunk-ms",
                    str(chunk_ms),
                    "--duration",
                    str(duration_s),
                    "--ramp-s",
                    "1",
                    *probe_extra,
                    *measured_extra,
                    *([] if finalize_after_ms is None else ["--finalize-after-ms", str(finalize_after_ms)]),
                )
            cpu_s = server_seconds(cpu)
            rt = result["classes"]["realtime"]
            run = {
                "streams": count,
                "p50_ms": p(rt, "chunk_latency_ms", "p50"),
                "p99_ms": p(rt, "chunk_latency_ms", "p99"),
                "first_result_p50_ms": p(rt, "first_result_ms", "p50"),
                "finalize_p50_ms": p(rt, "finalize_ms", "p50"),
                "finalize_p99_ms": p(rt, "finalize_ms", "p99"),
                "deadline_misses": rt["deadline_misses"],
                "errors": rt["errors"],
                "batch_realtime_factor": result["classes"]["batch"].get("realtime_factor") if batch else None,
                "audio_s": rt["audio_seconds"],
                "server_cpu_ms_per_audio_s": 1e3 * cpu_s / rt["audio_seconds"]
                if rt["audio_seconds"]
                else math.nan,
                # Per process (cs-engine, cs-supervisor, cs-frontend-N from 0, the probe's own), ms of
                # CPU per second of audio streamed.
                "cpu_ms_per_audio_s": {
                    name: round(1e3 * seconds / rt["audio_seconds"], 3) if rt["audio_seconds"] else math.nan
                    for name, seconds in sorted(cpu.items())
                },
                "gpu": gpu.gauges,  # by NVML index; {} where the server has no GPU gauges
            }
            run["passed"] = run["p99_ms"] <= P99_LIMIT_MS and run["deadline_misses"] == 0 and run["errors"] == 0
            runs.append(run)
            print(
                f"{mode:>6} {decoder:>6} {chunk_ms:>3} ms x{count:<4} p50 {run['p50_ms']:7.1f} p99 {run['p99_ms']:8.1f}"
                f" misses {run['deadline_misses']:>5} cpu/audio-s {run['server_cpu_ms_per_audio_s']:6.1f} ms"
                + (
                    f" finalize p50 {run['finalize_p50_ms']:.1f} p99 {run['finalize_p99_ms']:.1f}"
                    if finalize_after_ms is not None
                    else ""
                ),
                file=sys.stderr,
            )
            if not run["passed"] and len(runs) >= 2 and not runs[-2]["passed"]:
                break  # two failures in a row: past capacity
    passing = [r["streams"] for r in runs if r["passed"]]
    return {
        "mode": mode,
        "engines": engines if mode == "engine" else 0,
        "model": model or "default",
        "decoder": decoder,
        "chunk_ms": chunk_ms,
        "capacity": max(passing, default=0),
        "runs": runs,
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        streams = [run["streams"] for run in result["runs"]]
        label = f"{result['mode']} {result['chunk_ms']} ms {result['decoder']}"
        ax.plot(streams, [run["p99_ms"] for run in result["runs"]], marker="o", label=f"{label} p99")
        ax.plot(streams, [run["p50_ms"] for run in result["runs"]], linestyle="--", label=f"{label} p50")
    ax.axhline(P99_LIMIT_MS, color="grey", linewidth=0.8)
    ax.set_xlabel("realtime streams")
    ax.set_ylabel("chunk -> result latency, ms")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def decoder_spec(text: str) -> str:
    kind, colon, beam_size = text.partition(":")
    if kind not in ("auto", "greedy", "beam") or (colon and (kind != "beam" or not beam_size.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto, greedy, beam or beam:N")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["engine", "naive"], choices=["engine", "naive"])
    parser.add_argument("--chunk-ms", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--counts", type=int, nargs="+", default=None, help="stream counts to try (ascending)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--device", default="auto", help="serve --device (auto | cpu | cuda | cuda:N)")
    parser.add_argument("--wav", nargs="+", default=None, help="WAV files for the probe (default: espeak-ng)")
    parser.add_argument("--probe-processes", type=int, default=1, help="latency probe processes (--processes)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="p50/p99 against stream count, PNG")
    parser.add_argument(
        "--decoders",
        nargs="+",
        default=["auto"],
        type=decoder_spec,
        help="serve --decoder values; beam:N also passes --beam-size N",
    )
    parser.add_argument(
        "--models", nargs="+", default=[None], help="serve --model directories, measured one after the other"
    )
    parser.add_argument(
        "--engines", type=int, nargs="+", default=[1], help="serve --engines counts, measured one after the other"
    )
    parser.add_argument(
        "--finalize-after-ms",
        type=float,
        default=None,
        help="the probe sends FINALIZE this long after each sentence; FINALIZE -> final is reported",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="BATCH sessions sending as fast as allowed beside each stream count (realtime isolation)",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more serve flag (repeatable; --serve-arg=--no-compile)",
    )
    args = parser.parse_args(argv)
    counts = lambda mode: args.counts or DEFAULT_COUNTS[mode]  # noqa: E731
    results = [
        measure(
            mode,
            chunk_ms,
            counts(mode),
            args.duration,
            args.frontends,
            decoder,
            model,
            args.device,
            args.wav,
            args.probe_processes,
            engines,
            args.finalize_after_ms,
            tuple(args.serve_arg),
            args.batch,
        )
        for chunk_ms in args.chunk_ms
        for decoder in args.decoders
        for model in args.models
        for mode in args.modes
        for engines in (args.engines if mode == "engine" else [1])
    ]
    summary = {"p99_limit_ms": P99_LIMIT_MS, "results": results}
    for chunk_ms in args.chunk_ms:
        for decoder in args.decoders:
            for model in dict.fromkeys(r["model"] for r in results):  # in --models order
                key = (chunk_ms, decoder, model)
                by_mode = {
                    r["mode"]: r["capacity"] for r in results if (r["chunk_ms"], r["decoder"], r["model"]) == key
                }
                if by_mode.get("naive"):
                    name = f"ratio_{chunk_ms}ms_{decoder}" + (f"_{model}" if len(args.models) > 1 else "")
                    summary[name] = by_mode.get("engine", 0) / by_mode["naive"]
    dump(summary, args.json)
    if args.plot:
        plot(results, args.plot)
    print(
        f"\n{'model':>10} {'mode':>6} {'eng':>3} {'decoder':>7} {'chunk':>6} {'streams':>8} {'p50 ms':>8} {'p99 ms':>8}"
        f" {'misses':>7} {'cpu ms/s':>9}  pass"
    )
    for result in results:
        for run in result["runs"]:
            print(
                f"{result['model'][-10:]:>10} {result['mode']:>6} {result['engines']:>3} {result['decoder']:>7}"
                f" {result['chunk_ms']:>4}ms"
                f" {run['streams']:>8} {run['p50_ms']:>8.1f}"
                f" {run['p99_ms']:>8.1f} {run['deadline_misses']:>7} {run['server_cpu_ms_per_audio_s']:>9.1f}"
                f"  {'yes' if run['passed'] else 'no'}"
                + (f"  batch x{run['batch_realtime_factor'] or 0:.1f}" if args.batch else "")
                + (
                    f"  finalize p50/p99 {run['finalize_p50_ms']:.1f}/{run['finalize_p99_ms']:.1f} ms"
                    if args.finalize_after_ms is not None
                    else ""
                )
            )
    for result in results:
        engines = f", {result['engines']} engines" if result["engines"] > 1 else ""
        print(
            f"capacity {result['mode']} ({result['model']}, {result['decoder']} decoding{engines})"
            f" at {result['chunk_ms']} ms chunks:"
            f" {result['capacity']} streams"
        )
    for key, value in summary.items():
        if key.startswith("ratio"):
            print(f"{key}: engine/naive = {value:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
