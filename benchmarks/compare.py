"""The capacity benchmark against two checkouts in one sitting, interleaved, both tables printed.

These machines are noisy (a run's numbers move by 20-30% from one minute to the next), so a claim that a
change made serving faster compares the change with its reference side by side: ``rounds`` times each,
alternating which goes first, on the same machine in the same minutes. Each checkout serves its own code
(a git worktree of ``--ref``; this checkout as it is, or ``--new REV``); the probe and the venv are shared.

    python -m benchmarks.compare --ref origin/main -- --modes engine --chunk-ms 10 --counts 40 60 --duration 8
    python -m benchmarks.compare --ref HEAD~3 --new HEAD --rounds 3 --json compare.json -- --counts 40

Arguments after ``--`` go to ``benchmarks/capacity.py``. Prints each run's table, then per tree and stream
count the median of p50, p99, deadline misses and server CPU per second of audio. Prints JSON too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cosystream.v1.client import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]


def worktree(rev: str, parent: Path) -> Path:
    """A detached git worktree of ``rev`` under ``parent`` (removed by :func:`remove_worktree`)."""
    path = parent / rev.replace("/", "_").replace("~", "-").replace("^", "-")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def run_capacity(tree: Path, args: list[str], out: Path) -> dict:
    """One capacity run serving ``tree``'s code; its JSON."""
    env = {"PYTHONPATH": str(tree)}
    command = [sys.executable, "benchmarks/capacity.py", *args, "--json", str(out)]
    result = subprocess.run(command, cwd=tree, env={**os.environ, **env}, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"capacity in {tree} failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    print(result.stdout.rstrip().split("\n\n")[-1], flush=True)  # its table
    return json.loads(out.read_text())


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per tree, configuration and stream count: the medians over the rounds."""
    rows = []
    for tree, results in runs.items():
        by_key: dict[tuple, list[dict]] = {}
        for result in results:
            for config in result["results"]:
                for run in config["runs"]:
                    key = (config["mode"], config["model"], config["decoder"], config["chunk_ms"], run["streams"])
                    by_key.setdefault(key, []).append(run)
        for (mode, model, decoder, chunk_ms, streams), found in sorted(by_key.items()):
            rows.append(
                {
                    "tree": tree,
                    "mode": mode,
                    "model": model,
                    "decoder": decoder,
                    "chunk_ms": chunk_ms,
                    "streams": streams,
                    "rounds": len(found),
                    "p50_ms": statistics.median(r["p50_ms"] for r in found),
                    "p99_ms": statistics.median(r["p99_ms"] for r in found),
                    "deadline_misses": statistics.median(r["deadline_misses"] for r in found),
                    # (streams refused or failed: RESOURCE_EXHAUSTED for load among them)
                    "errors": statistics.median(r["errors"] for r in found),
                    "server_cpu_ms_per_audio_s": statistics.median(r["server_cpu_ms_per_audio_s"] for r in found),
                    "frontend_cpu_ms_per_audio_s": statistics.median(_share(r, "cs-frontend-") for r in found),
                    "engine_cpu_ms_per_audio_s": statistics.median(_share(r, "cs-engine") for r in found),
                    "passed": sum(r["passed"] for r in found),
                }
            )
    return rows


def _share(run: dict, prefix: str) -> float:
    """A run's CPU per second of audio in the processes named ``prefix``... (0 where none ran)."""
    return sum(ms for name, ms in run.get("cpu_ms_per_audio_s", {}).items() if name.startswith(prefix))


def table(rows: list[dict]) -> str:
    """``cpu ms/s``: the server's CPU per second of audio per stream; ``frontends`` and ``engine``: its shares."""
    lines = [
        f"{'tree':>6} {'mode':>7} {'decoder':>8} {'chunk':>6} {'streams':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'misses':>7} {'errors':>7} {'cpu ms/s':>9} {'frontends':>10} {'engine':>7} {'passed':>7}"
    ]
    for r in sorted(rows, key=lambda r: (r["mode"], r["decoder"], r["chunk_ms"], r["streams"], r["tree"])):
        lines.append(
            f"{r['tree']:>6} {r['mode']:>7} {r['decoder']:>8} {r['chunk_ms']:>4}ms {r['streams']:>8} "
            f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['deadline_misses']:>7.0f} {r['errors']:>7.0f} "
            f"{r['server_cpu_ms_per_audio_s']:>9.1f} {r['frontend_cpu_ms_per_audio_s']:>10.1f} "
            f"{r['engine_cpu_ms_per_audio_s']:>7.1f} {r['passed']:>3}/{r['rounds']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, capacity_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--ref", required=True, help="the reference revision (a git worktree is made of it)")
    parser.add_argument("--new", default=None, help="the new revision (default: this checkout as it is)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(ours)
    with tempfile.TemporaryDirectory(prefix="cosystream-compare-") as tmp:
        tmp_path = Path(tmp)
        trees = {"ref": worktree(args.ref, tmp_path)}
        trees["new"] = worktree(args.new, tmp_path) if args.new else ROOT
        runs: dict[str, list[dict]] = {"ref": [], "new": []}
        try:
            for round_ in range(args.rounds):
                order = ("ref", "new") if round_ % 2 == 0 else ("new", "ref")  # neither always goes first
                for name in order:
                    print(f"--- round {round_ + 1}: {name} ({trees[name]})", flush=True)
                    out = tmp_path / f"{name}-{round_}.json"
                    runs[name].append(run_capacity(trees[name], capacity_args, out))
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    remove_worktree(tree)
    rows = summarize(runs)
    report = {
        "ref": args.ref,
        "new": args.new or "working tree",
        "rounds": args.rounds,
        "summary": rows,
        "runs": runs,
    }
    print(json.dumps(report["summary"], indent=2))
    print(
        f"\nref = {args.ref}, new = {args.new or 'this checkout'}; medians over {args.rounds} interleaved rounds"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
