"""Model step cost against batch size and frames per step, through the same runner the engine uses.

Prints a JSON document and a table: p50/p99 step latency for batch 1..N and T in {1, 4, 16}; the batched
step against a per-session loop at 64 sessions; FLOPs per frame and the achieved rate against a measured
matmul peak; on the CPU, the compiled step against eager (interleaved, shape by shape) and what compiling
cost at start-up; on CUDA, graph replay against eager.

    python benchmarks/step.py                       # CPU, one thread
    python benchmarks/step.py --no-compile          # eager only
    python benchmarks/step.py --device cuda --max-batch 4096
    python benchmarks/step.py --dtype float32 bfloat16 int8   # precisions side by side (batch 1 and 64, T=1)
    python benchmarks/step.py --dtype float32 --model cosystream/models/default cosystream/models/light
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time

import numpy as np
import torch

from cosystream.decoding.config import BEAM_TOP_K
from cosystream.engine.process import use_device
from cosystream.models import FRAME_SAMPLES, load_model
from cosystream.models.loading import PRECISIONS
from cosystream.runtime.runner import GraphMode, Runner, RunnerConfig, batch_buckets
from cosystream.runtime.slab import StateSlab
from cosystream.v1.client import HelpFormatter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, iterations: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return samples


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def matmul_peak_gflops(device: torch.device) -> float:
    """Best of a few square fp32 matmuls: the roofline the model step is compared with."""
    size = 1024 if device.type == "cpu" else 8192
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = min(time_calls(lambda: a @ b, 5, 2, device))
    return 2 * size**3 / best / 1e9


def build_runner(
    model, max_batch: int, mode: GraphMode, device: torch.device, direct: bool, top_k: int = 1, **config
) -> Runner:
    slab = StateSlab(model.cache_specs(), max_batch, device=device)
    for _ in range(max_batch):
        slab.alloc()
    return Runner(
        model,
        slab,
        RunnerConfig(max_batch=max_batch, graph_mode=mode, direct_state=direct, top_k=top_k, **config),
    )


def bench_runner(runner: Runner, batches: list[int], frame_counts: list[int], iterations: int) -> list[dict]:
    return bench_interleaved([runner], batches, frame_counts, iterations)[0]


def bench_interleaved(
    runners: list[Runner], batches: list[int], frame_counts: list[int], iterations: int, rounds: int = 1
) -> list[list[dict]]:
    """Per shape, each runner's step timed in turn (``rounds`` times, ``iterations`` calls split between
    them): alternatives see the same machine load, which on a shared box drifts more than they differ."""
    rows: list[list[dict]] = [[] for _ in runners]
    device = runners[0].device
    for frames in frame_counts:
        for batch in batches:
            pcm = (np.random.default_rng(0).standard_normal((batch, frames * FRAME_SAMPLES)) * 0.1).astype(
                np.float32
            )
            slots = list(range(batch))
            samples: list[list[float]] = [[] for _ in runners]
            for _ in range(rounds):
                for runner, into in zip(runners, samples, strict=True):
                    calls = max(1, iterations // rounds)
                    into += time_calls(lambda r=runner, s=slots, p=pcm: r.run(s, p), calls, 5, device)
            for into, out in zip(samples, rows, strict=True):
                p50 = percentile(into, 50)
                out.append(
                    {
                        "batch": batch,
                        "frames": frames,
                        "p50_ms": p50 * 1e3,
                        "p99_ms": percentile(into, 99) * 1e3,
                        "us_per_session_frame": p50 / (batch * frames) * 1e6,
                    }
                )
    return rows


def rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 1e6
    except OSError:
        return None


def build_compiled(model, args: argparse.Namespace) -> tuple[Runner, dict]:
    """The compiled CPU runner, and what it cost to start: seconds, keys compiled or loaded, memory."""
    before = rss_mb()
    started = time.perf_counter()
    runner = build_runner(
        model,
        args.max_batch,
        GraphMode.EAGER,
        torch.device("cpu"),
        direct=True,
        compile=True,
        frame_buckets=tuple(sorted(set(args.frames))),
        compile_cache_dir=args.compile_cache_dir,
        compile_budget_s=args.compile_budget_s,
    )
    seconds = time.perf_counter() - started
    steps = runner.compiled_steps
    after = rss_mb()
    startup = {
        "seconds": seconds,
        "keys": len(runner.compiled_keys),
        "compiled": steps.compiled if steps else 0,
        "loaded": steps.loaded if steps else 0,
        "left_eager": steps.skipped if steps else 0,
        "rss_mb": None if before is None or after is None else after - before,
        "cache_dir": str(steps.cache_dir) if steps else None,
    }
    return runner, startup


def bench_tf32(model, max_batch: int, device: torch.device, iterations: int) -> list[dict]:
    """The engine steps in full float32; what TF32 matmuls would gain, and how far their logits move (relative
    to the largest logit; the streaming tolerance is 1e-4)."""
    rows = []
    for batch in sorted({b for b in (64, 1024, max_batch) if b <= max_batch}):
        pcm = (np.random.default_rng(2).standard_normal((batch, FRAME_SAMPLES)) * 0.1).astype(np.float32)
        timings, logits = {}, {}
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            runner = build_runner(model, batch, GraphMode.GRAPHS, device, direct=True)
            logits[tf32] = runner.run(list(range(batch)), pcm, return_logits=True).logits.float()
            timings[tf32] = bench_runner(runner, [batch], [1], iterations)[0]["p50_ms"]
            del runner
        torch.backends.cuda.matmul.allow_tf32 = False
        scale = max(1.0, logits[False].abs().max().item())
        rows.append(
            {
                "batch": batch,
                "frames": 1,
                "fp32_p50_ms": timings[False],
                "tf32_p50_ms": timings[True],
                "speedup": timings[False] / timings[True],
                "max_rel_diff": (logits[True] - logits[False]).abs().max().item() / scale,
            }
        )
    return rows


def bench_precisions(
    paths: list[str | None], precisions: list[str], batches: list[int], device: torch.device, iterations: int
) -> list[dict]:
    """Per model and precision, the one-frame step at each batch (graphs on CUDA, as served), and how far
    its log-probabilities move from the model's first precision's on the same (noise) input: the largest and
    the mean difference; the accuracy that costs is measured on speech by ``cosystream eval --precision``.
    ``speedup`` is against the first model at the first precision, at the same batch."""
    rows, reference = [], {}
    mode = GraphMode.GRAPHS if device.type == "cuda" else GraphMode.EAGER
    for path, precision in ((path, precision) for path in paths for precision in precisions):
        model = load_model(path, device=device, precision=precision)
        for batch in batches:
            runner = build_runner(model, batch, mode, device, direct=True)
            rng = np.random.default_rng(3)
            steps = [(rng.standard_normal((batch, FRAME_SAMPLES)) * 0.1).astype(np.float32) for _ in range(30)]
            logprobs = torch.stack(
                [
                    torch.log_softmax(runner.run(list(range(batch)), pcm, return_logits=True).logits.float(), -1)
                    for pcm in steps
                ]
            ).cpu()
            reference.setdefault((path, batch), logprobs)
            timing = bench_runner(runner, [batch], [1], iterations)[0]
            diff = (logprobs - reference[(path, batch)]).abs()
            rows.append(
                {
                    "model": path or "embedded",
                    "precision": precision,
                    "batch": batch,
                    "p50_ms": timing["p50_ms"],
                    "p99_ms": timing["p99_ms"],
                    "us_per_session_frame": timing["us_per_session_frame"],
                    "max_logprob_diff": diff.max().item(),
                    "mean_logprob_diff": diff.mean().item(),
                }
            )
            del runner
    for row in rows:
        base = next(r for r in rows if r["batch"] == row["batch"])
        row["speedup"] = base["p50_ms"] / row["p50_ms"]
    return rows


def print_precisions(rows: list[dict], device: str, threads: int) -> None:
    sys.stdout.write(f"\nprecisions, one frame per step ({device}, {threads} thread(s)):\n")
    sys.stdout.write(
        f"{'model':<24} {'precision':<10} {'batch':>6} {'p50 ms':>9} {'p99 ms':>9} {'us/sess-frame':>14}"
        f" {'vs first':>8} {'max dlogp':>10} {'mean dlogp':>11}\n"
    )
    for r in rows:
        sys.stdout.write(
            f"{r['model'][-24:]:<24} {r['precision']:<10} {r['batch']:>6} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f}"
            f" {r['us_per_session_frame']:>14.1f} {r['speedup']:>7.2f}x {r['max_logprob_diff']:>10.3f}"
            f" {r['mean_logprob_diff']:>11.4f}\n"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the engine uses 1)")
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--frames", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument(
        "--model",
        nargs="+",
        default=[None],
        help="model directory (default: the embedded model); with --dtype, several are compared side by side",
    )
    parser.add_argument("--json", default=None, help="also write the JSON here")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=None,
        choices=PRECISIONS,
        help="compare these precisions instead (the first is the reference; float32 first is the useful order)",
    )
    parser.add_argument("--dtype-batches", type=int, nargs="+", default=[1, 64], help="batches for --dtype")
    parser.add_argument("--no-compile", action="store_true", help="CPU: skip the compiled step")
    parser.add_argument(
        "--compile-cache-dir",
        default=None,
        help="compiled packages (default: the engine's cache; 'none': a fresh temporary one, to time compiling)",
    )
    parser.add_argument(
        "--compile-budget-s", type=float, default=None, help="seconds to spend compiling (default: no limit)"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    use_device(device)  # as the engine runs it: the current CUDA device, full float32
    if args.dtype:
        with torch.no_grad():
            rows = bench_precisions(args.model, args.dtype, args.dtype_batches, device, args.iterations)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        result = {"device": name, "torch": torch.__version__, "threads": args.threads, "precisions": rows}
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        print_precisions(rows, name, args.threads)
        return 0
    if len(args.model) > 1:
        parser.error("several --model directories are compared with --dtype")
    model = load_model(args.model[0], device=device)
    batches = [b for b in batch_buckets(args.max_batch)]
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": args.threads,
        "flops_per_frame": model.flops_per_frame(),
        "matmul_peak_gflops": matmul_peak_gflops(device),
    }
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="cosystream-compiled-") as fresh:
        if args.compile_cache_dir == "none":
            args.compile_cache_dir = fresh
        eager = build_runner(model, args.max_batch, GraphMode.EAGER, device, direct=True)
        if device.type == "cpu" and not args.no_compile:
            compiled, result["compile_startup"] = build_compiled(model, args)
            # Shape by shape, eager and compiled in turn, twice: the ratio is what to read.
            result["eager"], result["compiled"] = bench_interleaved(
                [eager, compiled], batches, args.frames, args.iterations, rounds=2
            )
            result["compile_speedup"] = [
                {"batch": c["batch"], "frames": c["frames"], "speedup": e["p50_ms"] / c["p50_ms"]}
                for c, e in zip(result["compiled"], result["eager"], strict=True)
            ]
            del compiled
        else:
            result["eager"] = bench_runner(eager, batches, args.frames, args.iterations)
        gather = build_runner(model, 64, GraphMode.EAGER, device, direct=False)
        result["gather_scatter_b64"] = bench_runner(gather, [64], [1], args.iterations)[0]
        # Beam-search decoding has the runner return the 8 best tokens per frame instead of the argmax.
        top8 = build_runner(model, 64, GraphMode.EAGER, device, direct=True, top_k=BEAM_TOP_K)
        result["top8_b64"] = bench_runner(top8, [64], [1], args.iterations)[0]
        # The unbatched baseline: 64 sessions, one model call each per 10 ms frame.
        loop_batch = min(64, args.max_batch)
        one = build_runner(model, loop_batch, GraphMode.EAGER, device, direct=True)
        pcm = (np.random.default_rng(1).standard_normal((loop_batch, FRAME_SAMPLES)) * 0.1).astype(np.float32)

        def per_session_loop() -> None:
            for row in range(loop_batch):
                one.run([row], pcm[row : row + 1])

        loop = time_calls(per_session_loop, max(5, args.iterations // 5), 2, device)
        batched = next(r for r in result["eager"] if r["batch"] == loop_batch and r["frames"] == 1)
        result["per_session_loop"] = {
            "sessions": loop_batch,
            "p50_ms": percentile(loop, 50) * 1e3,
            "batched_p50_ms": batched["p50_ms"],
            "speedup": percentile(loop, 50) * 1e3 / batched["p50_ms"],
        }
        if device.type == "cuda":
            graphs = build_runner(model, args.max_batch, GraphMode.GRAPHS, device, direct=True)
            result["graphs"] = bench_runner(graphs, batches, args.frames, args.iterations)
            result["graph_speedup"] = [
                {"batch": g["batch"], "frames": g["frames"], "speedup": e["p50_ms"] / g["p50_ms"]}
                for g, e in zip(result["graphs"], result["eager"], strict=True)
            ]
            result["tf32"] = bench_tf32(model, args.max_batch, device, args.iterations)
    best = max(
        result["eager"] + result.get("graphs", []) + result.get("compiled", []),
        key=lambda r: r["batch"] * r["frames"] / r["p50_ms"],
    )
    result["achieved_gflops"] = result["flops_per_frame"] * best["batch"] * best["frames"] / best["p50_ms"] / 1e6
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    out = sys.stdout
    out.write(
        f"\nmodel: {result['flops_per_frame'] / 1e6:.2f} MFLOP/frame; matmul peak {result['matmul_peak_gflops']:.0f}"
        f" GFLOP/s; best achieved {result['achieved_gflops']:.1f} GFLOP/s ({result['device']}, {result['threads']} thread(s))\n"
    )
    graphs = {(r["batch"], r["frames"]): r for r in result.get("graphs", [])}
    compiled = {(r["batch"], r["frames"]): r for r in result.get("compiled", [])}
    header = f"{'batch':>6} {'T':>3} {'p50 ms':>9} {'p99 ms':>9} {'us/sess-frame':>14}"
    if graphs:
        header += f" {'graph p50':>10} {'graph x':>8}"
    if compiled:
        header += f" {'compiled p50':>13} {'compiled x':>11}"
    out.write(header + "\n")
    for row in result["eager"]:
        line = (
            f"{row['batch']:>6} {row['frames']:>3} {row['p50_ms']:>9.3f} {row['p99_ms']:>9.3f}"
            f" {row['us_per_session_frame']:>14.1f}"
        )
        g = graphs.get((row["batch"], row["frames"]))
        if g:
            line += f" {g['p50_ms']:>10.3f} {row['p50_ms'] / g['p50_ms']:>8.1f}"
        c = compiled.get((row["batch"], row["frames"]))
        if c:
            line += f" {c['p50_ms']:>13.3f} {row['p50_ms'] / c['p50_ms']:>11.2f}"
        out.write(line + "\n")
    startup = result.get("compile_startup")
    if startup:
        rss = "" if startup["rss_mb"] is None else f", {startup['rss_mb']:.0f} MB more memory"
        out.write(
            f"compiled step: {startup['keys']} (bucket, T) keys ready in {startup['seconds']:.1f} s"
            f" ({startup['compiled']} compiled, {startup['loaded']} loaded from {startup['cache_dir']},"
            f" {startup['left_eager']} left eager){rss}\n"
        )
    for row in result.get("tf32", []):
        out.write(
            f"TF32 at batch {row['batch']}: {row['tf32_p50_ms']:.3f} ms vs {row['fp32_p50_ms']:.3f} ms in float32"
            f" ({row['speedup']:.2f}x), logits moved by {row['max_rel_diff']:.1e} of the largest\n"
        )
    loop = result["per_session_loop"]
    gs = result["gather_scatter_b64"]
    out.write(
        f"\n{loop['sessions']} sessions: batched step {loop['batched_p50_ms']:.2f} ms vs per-session loop"
        f" {loop['p50_ms']:.2f} ms -> {loop['speedup']:.1f}x; gather/scatter path at batch 64: {gs['p50_ms']:.2f} ms;"
        f" top-8 output (beam search) at batch 64: {result['top8_b64']['p50_ms']:.2f} ms\n"
    )


if __name__ == "__main__":
    sys.exit(main())
