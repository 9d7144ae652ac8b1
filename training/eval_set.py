"""Write held-out evaluation groups of the corpus as a test set for ``cosystream eval`` and
``benchmarks.accuracy``: a directory of ``GROUP-NNN.wav`` (16 kHz) + ``GROUP-NNN.txt``.

    .venv/bin/python -m training.eval_set --corpus data/corpus --out data/heldout --limit 40
    .venv/bin/cosystream eval data/heldout --decoder greedy --tilt 6

``--groups`` defaults to the four held-out voice groups whose mean the training logs report.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cosystream.app.transcribe import write_wav
from training.corpus import HELD_OUT, load_shard


def write_groups(corpus: Path, out: Path, groups: list[str], limit: int | None = None) -> int:
    """The first ``limit`` utterances (all when ``None``) of each group; returns how many were written."""
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for group in groups:
        audio, offsets, texts, _ = load_shard(corpus / "eval" / f"{group}.npz")
        for i in range(len(texts) if limit is None else min(limit, len(texts))):
            write_wav(out / f"{group}-{i:03d}.wav", audio[offsets[i] : offsets[i + 1]], 16000)
            (out / f"{group}-{i:03d}.txt").write_text(texts[i] + "\n")
            written += 1
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--groups", nargs="+", default=HELD_OUT, help="evaluation groups (eval/GROUP.npz)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many utterances per group")
    args = parser.parse_args(argv)
    n = write_groups(args.corpus, args.out, args.groups, args.limit)
    print(f"{args.out}: {n} utterances from {', '.join(args.groups)}")


if __name__ == "__main__":
    main()
