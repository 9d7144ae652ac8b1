"""Build the default word n-gram language model (ARPA, interpolated Kneser-Ney) from the training sentences.

    .venv/bin/python -m training.lm --corpus data/corpus --out cosystream/models/default/lm.arpa.gz

Only the corpus' *training* sentences are counted (the held-out evaluation sentences never are). Words
of ``--wordlist`` files (e.g. Debian's ``wamerican``, ``/usr/share/dict/american-english``) that fit the
model's alphabet join the vocabulary with the probability Kneser-Ney gives unseen words, so the beam
search may spell them too.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
_WORD = re.compile(r"^[a-z][a-z']*$")


def kneser_ney(
    sentences: list[list[str]], order: int = 3, discount: float = 0.75, extra_words: set[str] = frozenset()
) -> tuple[dict, dict]:
    """Interpolated Kneser-Ney. Returns ``(logprobs, backoffs)`` keyed by word tuples, natural logs."""
    raw: list[Counter] = [Counter() for _ in range(order + 1)]
    for s in sentences:
        toks = [BOS, *s, EOS]
        for n in range(1, order + 1):
            for i in range(max(1, n - 1), len(toks)):
                raw[n][tuple(toks[i - n + 1 : i + 1])] += 1
    # Lower orders count the distinct words that precede an n-gram (continuation counts), except
    # n-grams that start the sentence, which nothing can precede.
    adjusted: list[Counter] = [Counter() for _ in range(order + 1)]
    adjusted[order] = raw[order]
    for n in range(order - 1, 0, -1):
        for gram in raw[n + 1]:
            adjusted[n][gram[1:]] += 1
        for gram, c in raw[n].items():
            if gram[0] == BOS:
                adjusted[n][gram] = c
    vocab = {g[0] for g in adjusted[1]} | set(extra_words) | {UNK}
    vocab.discard(BOS)
    prob: dict[tuple, float] = {}
    backoffs: dict[tuple, float] = {}
    total = sum(adjusted[1].values())
    types = len(adjusted[1])
    uniform = 1.0 / len(vocab)
    for w in vocab:
        c = adjusted[1].get((w,), 0)
        prob[(w,)] = max(c - discount, 0.0) / total + discount * types / total * uniform
    for n in range(2, order + 1):
        ctx_total: Counter = Counter()
        ctx_types: Counter = Counter()
        for gram, c in adjusted[n].items():
            ctx_total[gram[:-1]] += c
            ctx_types[gram[:-1]] += 1
        for gram, c in adjusted[n].items():
            h = gram[:-1]
            gamma = discount * ctx_types[h] / ctx_total[h]
            prob[gram] = max(c - discount, 0.0) / ctx_total[h] + gamma * prob[gram[1:]]
        for h in ctx_total:
            backoffs[h] = math.log(discount * ctx_types[h] / ctx_total[h])
    logprobs = {g: math.log(p) for g, p in prob.items()}
    logprobs[(BOS,)] = -99.0 * math.log(10)  # a context only, never predicted
    return logprobs, backoffs


def write_arpa(path: Path, logprobs: dict, backoffs: dict) -> None:
    by_order: defaultdict[int, list] = defaultdict(list)
    for gram in logprobs:
        by_order[len(gram)].append(gram)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\\data\\\n")
        for n in sorted(by_order):
            f.write(f"ngram {n}={len(by_order[n])}\n")
        for n in sorted(by_order):
            f.write(f"\n\\{n}-grams:\n")
            for gram in sorted(by_order[n]):
                line = f"{logprobs[gram] / math.log(10):.4f}\t{' '.join(gram)}"
                if gram in backoffs and n < max(by_order):
                    line += f"\t{backoffs[gram] / math.log(10):.4f}"
                f.write(line + "\n")
        f.write("\n\\end\\\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--out", type=Path, default=Path("cosystream/models/default/lm.arpa.gz"))
    p.add_argument("--order", type=int, default=3)
    p.add_argument("--discount", type=float, default=0.75)
    p.add_argument("--wordlist", type=Path, action="append", default=[])
    args = p.parse_args(argv)

    sentences = [s.split() for s in json.loads((args.corpus / "sentences.json").read_text())["train"]]
    extra: set[str] = set()
    for path in args.wordlist:
        for w in path.read_text(encoding="utf-8", errors="ignore").lower().split():
            if (_WORD.match(w) and len(w) > 1) or w in ("a", "i"):
                extra.add(w)
    logprobs, backoffs = kneser_ney(sentences, args.order, args.discount, extra)
    write_arpa(args.out, logprobs, backoffs)
    n = Counter(len(g) for g in logprobs)
    print(
        f"{args.out}: {dict(sorted(n.items()))} n-grams, {len(sentences)} sentences, "
        f"{len(extra)} word-list words, {args.out.stat().st_size / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    main()
