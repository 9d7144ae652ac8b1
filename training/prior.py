"""Prior correction: divide a CTC model's posteriors by its tokens' prior, folded into the output layer.

A CTC network's per-frame posterior ``P(token | audio)`` carries the token's overall frequency (the blank
above all: most frames are blank). On audio unlike its training data the network is less sure of itself,
and that prior pulls its frames towards the blank and the commonest phonemes: words go missing. Scoring
with ``P(token | audio) / P(token) ** weight`` instead (as hybrid recognizers divide by state priors) takes
some of that pull away. Because the beam search compares hypotheses that have consumed the same frames, a
per-frame normalizer does not matter, and the correction is exactly a shift of the output layer's bias by
``-weight * ln P(token)``: the corrected model is an ordinary model directory, served at no extra cost.

    PYTHONPATH=. .venv/bin/python -m training.prior --model runs/export/ph5 --corpus data/corpus \\
        --weight 0.2 --out runs/export/ph5-prior

The prior is the mean posterior of each token over the frames of ``--utterances`` random training
utterances (all voice sets, as stored: not augmented), written beside the weights as ``prior.json``; a
model directory that already has one is refused, so the correction is never applied twice, and
``training.train --init DIR`` takes it back out before fine-tuning.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from cosystream.models import load_model, save_model
from cosystream.models.conv_ctc import ConvCtcModel
from training.data import Corpus

PRIOR_FILE = "prior.json"
COPIED = ("lexicon.tsv.gz", "lm.arpa.gz")


def token_prior(model: ConvCtcModel, corpus: Corpus, utterances: int, seed: int) -> torch.Tensor:
    """``ln P(token)``: each token's posterior averaged over every frame of random training utterances."""
    items = corpus.items(corpus.refresh())
    if not items:
        raise SystemExit(f"no training shards in {corpus.directory / 'train'}")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(items), size=min(utterances, len(items)), replace=False)
    total = torch.zeros(len(model.vocabulary), dtype=torch.float64)
    frames = 0
    with torch.no_grad():
        for p in picks:
            name, index, _ = items[int(p)]
            pcm, _ = corpus.get(name, index)
            probs = torch.softmax(model(torch.from_numpy(pcm)[None]).float(), dim=-1)[0]
            total += probs.sum(0).double()
            frames += probs.shape[0]
    return (total / frames).clamp_min(1e-12).log().float()


def fold_prior(model: ConvCtcModel, log_prior: torch.Tensor, weight: float) -> None:
    """Shift the output bias so that ``log_softmax`` scores ``ln P(token | audio) - weight * ln P(token)``
    (up to a per-frame constant)."""
    with torch.no_grad():
        model.head.bias -= weight * log_prior.to(model.head.bias)


def undo_prior(model: ConvCtcModel, directory: Path) -> bool:
    """Take ``directory``'s prior correction (its ``prior.json``) back out of ``model``, loaded from there:
    a fine-tune trains the network, not its decoding-time correction. False if it had none."""
    path = Path(directory) / PRIOR_FILE
    if not path.is_file():
        return False
    record = json.loads(path.read_text())
    log_prior = torch.tensor([record["log_prior"][tok] for tok in model.vocabulary])
    fold_prior(model, log_prior, -record["weight"])
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="the model directory to correct")
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--weight", type=float, default=0.2, help="the prior's exponent (0 leaves the model as it is)")
    p.add_argument("--utterances", type=int, default=400)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if (args.model / PRIOR_FILE).exists():
        raise SystemExit(
            f"{args.model} is already prior-corrected ({PRIOR_FILE}); start from the uncorrected model"
        )
    torch.set_num_threads(args.threads)

    model = load_model(args.model).eval()
    log_prior = token_prior(model, Corpus(args.corpus), args.utterances, args.seed)
    fold_prior(model, log_prior, args.weight)
    save_model(model, args.out)
    for name in COPIED:
        if (args.model / name).is_file() and args.model.resolve() != args.out.resolve():
            shutil.copyfile(args.model / name, args.out / name)
    record = {
        "weight": args.weight,
        "utterances": args.utterances,
        "seed": args.seed,
        "log_prior": {tok: round(float(v), 4) for tok, v in zip(model.vocabulary, log_prior, strict=True)},
    }
    (args.out / PRIOR_FILE).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    top = sorted(record["log_prior"].items(), key=lambda kv: -kv[1])[:5]
    print(f"prior from {args.utterances} utterances, weight {args.weight}: {args.out}; commonest: {top}")


if __name__ == "__main__":
    main()
