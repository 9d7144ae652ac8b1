"""Build the default word n-gram language model (ARPA, interpolated Kneser-Ney) from the training sentences.

    .venv/bin/python -m training.lm --corpus data/corpus --out cosystream/models/default/lm.arpa.gz

Only the corpus' *training* sentences are counted (the held-out evaluation sentences never are). Words
of ``--wordlist`` files (e.g. Debian's ``wamerican``, ``/usr/share/dict/american-english``) that fit the
model's alphabet join the vocabulary with the probability Kneser-Ney gives unseen words, so the beam
search may spell them too.

Options for other text and other estimates: ``--discount modified`` (modified Kneser-Ney: three discounts
per order, from the count-of-counts), ``--wordnet-weight W`` (a second model, of WordNet's usage examples,
mixed in with weight W into one back-off model), and ``--tune``, which holds out every 20th training
sentence and prints its perplexity over a grid of both. Every build prints the evaluation sentences'
perplexity (a report; nothing is chosen by it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

from training.text import wordnet_examples

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
_WORD = re.compile(r"^[a-z][a-z']*$")


def _discounts(counts: Counter, fixed: float | None) -> tuple[float, float, float]:
    """Discounts for n-grams counted 1, 2 and 3+ times: modified Kneser-Ney's (Chen & Goodman 1998),
    estimated from the count-of-counts, or one ``fixed`` discount for all."""
    if fixed is not None:
        return fixed, fixed, fixed
    n = Counter(c for c in counts.values() if c <= 4)
    n1, n2, n3, n4 = (n[k] for k in (1, 2, 3, 4))
    if min(n1, n2, n3, n4) > 0:
        y = n1 / (n1 + 2 * n2)
        d = (1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3)
        if all(0 < x < k + 1 for k, x in enumerate(d)):
            return d
    return 0.75, 0.75, 0.75  # too few counts to estimate them (a toy corpus)


def kneser_ney(
    sentences: list[list[str]], order: int = 3, discount: float | None = 0.75, extra_words: set[str] = frozenset()
) -> tuple[dict, dict]:
    """Interpolated Kneser-Ney with one absolute ``discount``, or modified (three per order) with ``None``.
    Returns ``(logprobs, backoffs)`` keyed by word tuples, natural logs."""
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
    uniform = 1.0 / len(vocab)
    d = _discounts(adjusted[1], discount)
    left = sum(d[min(c, 3) - 1] for c in adjusted[1].values()) / total  # mass given to the uniform
    for w in vocab:
        c = adjusted[1].get((w,), 0)
        prob[(w,)] = (c - d[min(c, 3) - 1] if c else 0.0) / total + left * uniform
    for n in range(2, order + 1):
        d = _discounts(adjusted[n], discount)
        ctx_total: Counter = Counter()
        ctx_left: Counter = Counter()  # the discounted mass of each context, given to the lower order
        for gram, c in adjusted[n].items():
            ctx_total[gram[:-1]] += c
            ctx_left[gram[:-1]] += d[min(c, 3) - 1]
        for gram, c in adjusted[n].items():
            h = gram[:-1]
            prob[gram] = (c - d[min(c, 3) - 1]) / ctx_total[h] + ctx_left[h] / ctx_total[h] * prob[gram[1:]]
        for h in ctx_total:
            backoffs[h] = math.log(ctx_left[h] / ctx_total[h])
    logprobs = {g: math.log(p) for g, p in prob.items()}
    logprobs[(BOS,)] = -99.0 * math.log(10)  # a context only, never predicted
    return logprobs, backoffs


def logprob(model: tuple[dict, dict], history: tuple[str, ...], word: str) -> float:
    """``ln P(word | history)`` of a ``(logprobs, backoffs)`` model, backing off as ARPA does."""
    logprobs, backoffs = model
    bow = 0.0
    while True:
        p = logprobs.get((*history, word))
        if p is not None:
            return bow + p
        if not history:
            return bow + logprobs[(UNK,)]
        bow += backoffs.get(history, 0.0)
        history = history[1:]


def interpolate(models: list[tuple[dict, dict]], weights: list[float]) -> tuple[dict, dict]:
    """One back-off model equal to ``sum(weight * P_model)`` on every n-gram any model lists (SRILM's
    static mixture); a context's back-off weight renormalizes what the mixture leaves to its lower order.
    The models must share the vocabulary (give them the same ``extra_words``)."""
    grams = set().union(*(m[0] for m in models))
    logprobs: dict[tuple, float] = {}
    for gram in grams:
        if gram == (BOS,):
            logprobs[gram] = models[0][0][gram]
            continue
        p = sum(w * math.exp(logprob(m, gram[:-1], gram[-1])) for m, w in zip(models, weights, strict=True))
        logprobs[gram] = math.log(p)
    seen: defaultdict[tuple, float] = defaultdict(float)  # P of the listed continuations of a context
    lower: defaultdict[tuple, float] = defaultdict(float)  # ... and of the same words one order lower
    for gram, lp in logprobs.items():
        if len(gram) > 1:
            seen[gram[:-1]] += math.exp(lp)
            lower[gram[:-1]] += math.exp(logprobs[gram[1:]])
    backoffs = {h: math.log(max(1.0 - seen[h], 1e-12) / max(1.0 - lower[h], 1e-12)) for h in seen}
    return logprobs, backoffs


def perplexity(model: tuple[dict, dict], sentences: list[list[str]]) -> float:
    """Per-word perplexity, the end of each sentence included."""
    order = max(len(g) for g in model[0])
    total, n = 0.0, 0
    for s in sentences:
        toks = [BOS, *s, EOS]
        for i in range(1, len(toks)):
            total += logprob(model, tuple(toks[max(0, i - order + 1) : i]), toks[i])
            n += 1
    return math.exp(-total / n)


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


def build(
    sentences: list[list[str]],
    extra_text: list[list[str]],
    extra_weights: list[float],
    order: int,
    discount: float | None,
    words: set[str],
) -> list[tuple[dict, dict]]:
    """The corpus model mixed with a model of ``extra_text`` at each of ``extra_weights`` (0: the corpus model
    alone); both models are counted once, whatever the number of weights."""
    words = words | {w for s in (*sentences, *extra_text) for w in s}
    model = kneser_ney(sentences, order, discount, words)
    other = kneser_ney(extra_text, order, discount, words) if max(extra_weights) > 0 else None
    return [interpolate([model, other], [1.0 - w, w]) if w > 0 else model for w in extra_weights]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--out", type=Path, default=Path("cosystream/models/default/lm.arpa.gz"))
    p.add_argument("--order", type=int, default=3)
    p.add_argument(
        "--discount",
        type=lambda v: None if v == "modified" else float(v),
        default=0.75,
        help="one absolute discount for every n-gram (default 0.75, the shipped model's), or 'modified': "
        "modified Kneser-Ney's three per order, estimated from the counts",
    )
    p.add_argument("--wordlist", type=Path, action="append", default=[])
    p.add_argument(
        "--wordnet-weight",
        type=float,
        default=0.0,
        help="mix in a model of WordNet's usage examples (Debian wordnet-base) with this weight (0: none)",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="hold out every 20th training sentence, print its perplexity for a grid of discounts and "
        "WordNet weights, and exit",
    )
    args = p.parse_args(argv)

    text = json.loads((args.corpus / "sentences.json").read_text())
    sentences = [s.split() for s in text["train"]]
    held_out = set(text["eval"])
    wordnet = (
        [s.split() for s in wordnet_examples() if s not in held_out] if args.wordnet_weight or args.tune else []
    )
    extra: set[str] = set()
    for path in args.wordlist:
        for w in path.read_text(encoding="utf-8", errors="ignore").lower().split():
            if (_WORD.match(w) and len(w) > 1) or w in ("a", "i"):
                extra.add(w)
    if args.tune:
        dev = sentences[::20]
        fit = [s for i, s in enumerate(sentences) if i % 20]
        for discount in [args.discount, None] if args.discount is not None else [None]:
            weights = [0.0, 0.1, 0.2, 0.3, 0.4]
            for weight, model in zip(
                weights, build(fit, wordnet, weights, args.order, discount, extra), strict=True
            ):
                name = "modified" if discount is None else discount
                print(f"discount {name}, WordNet weight {weight}: dev perplexity {perplexity(model, dev):.1f}")
        return
    [(logprobs, backoffs)] = build(sentences, wordnet, [args.wordnet_weight], args.order, args.discount, extra)
    write_arpa(args.out, logprobs, backoffs)
    n = Counter(len(g) for g in logprobs)
    evaluation = perplexity((logprobs, backoffs), [s.split() for s in text["eval"]])
    print(
        f"{args.out}: {dict(sorted(n.items()))} n-grams, {len(sentences)} sentences, {len(wordnet)} WordNet "
        f"examples, {len(extra)} word-list words, {args.out.stat().st_size / 1e6:.1f} MB; the evaluation "
        f"sentences' perplexity {evaluation:.1f}"
    )


if __name__ == "__main__":
    main()
