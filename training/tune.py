"""Tune the beam search's LM weight and word bonus (and compare model directories, e.g. prior weights).

Each model runs once over each set through the engine's ``Runner`` (as ``cosystream eval`` does); its
per-frame top-k outputs are kept in memory and decoded again for every point of the grid, so a grid costs
the decoding only. A set is ``NAME=PATH`` (a ``cosystream eval`` directory or manifest), optionally
``NAME=PATH:even`` or ``:odd`` for every other utterance in name order: a development half, the other
half kept as a test. The shipped defaults came from (the training voices' held-out sentences and every
other Asterisk prompt; ``ph5-pN`` is ``training.prior --weight 0.N`` of ph5's export):

    PYTHONPATH=. .venv/bin/python -m training.eval_set --groups train_voices --out data/tune-tv
    PYTHONPATH=. .venv/bin/python -m training.tune --model runs/export/ph5 runs/export/ph5-p{1,2,3} \\
        --set tv=data/tune-tv --set ast=.cache/accuracy/asterisk-prompts-16k:even \\
        --lm-weight 0.7 0.8 0.9 --word-bonus -1 -0.5 0 0.25

Prints WER / CER per set and the mean WER over the sets for every (model, LM weight, word bonus), best
last, and writes them all to ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from cosystream.app.evaluate import decode, edit_distance, eval_runner, load_set, normalize, stream
from cosystream.decoding.beam import BeamConfig
from cosystream.decoding.config import DecoderConfig, DecoderFactory
from cosystream.models import load_model
from cosystream.runtime.runner import Runner

Outputs = list[tuple[str, list[tuple[np.ndarray, np.ndarray, int]]]]  # (reference, [(ids, logprobs, frame)])


def parse_set(spec: str) -> tuple[str, Path, str | None]:
    name, eq, path = spec.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=PATH or NAME=PATH:even|odd")
    half = None
    for suffix in (":even", ":odd"):
        if path.endswith(suffix):
            path, half = path[: -len(suffix)], suffix[1:]
    return name, Path(path), half


def model_outputs(runner: Runner, path: Path, half: str | None) -> Outputs:
    """Every utterance's per-frame top-k token ids and log-probs, streamed as ``cosystream eval`` does."""
    utterances = sorted(load_set(path), key=lambda u: u.name)
    if half is not None:
        utterances = utterances[(half == "odd") :: 2]
    return [
        (normalize(u.reference), [(ids.copy(), lps.copy(), first) for ids, lps, first in stream(runner, u.audio)])
        for u in utterances
    ]


def score(outputs: Outputs, decoding: DecoderConfig, vocabulary: list[str]) -> dict:
    decoder = DecoderFactory(decoding, vocabulary)()
    we = words = ce = chars = 0
    for reference, chunks in outputs:
        hypothesis, _ = decode(decoder, chunks)
        we += edit_distance(reference.split(), hypothesis.split())
        words += len(reference.split())
        ce += edit_distance(list(reference), list(hypothesis))
        chars += len(reference)
    return {"wer": we / max(words, 1), "cer": ce / max(chars, 1), "words": words}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", required=True, help="model directories (with their lexicon and LM)")
    p.add_argument("--set", dest="sets", type=parse_set, action="append", required=True)
    defaults = BeamConfig()
    p.add_argument("--lm-weight", type=float, nargs="+", default=[defaults.alpha])
    p.add_argument("--word-bonus", type=float, nargs="+", default=[defaults.beta])
    p.add_argument("--beam-size", type=int, default=defaults.beam_size)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    rows = []
    for model_dir in args.model:
        base = DecoderConfig("beam").resolve(model_dir)
        model = load_model(model_dir)
        runner = eval_runner(model, base.top_k)
        outputs = {name: model_outputs(runner, path, half) for name, path, half in args.sets}
        for alpha, beta in itertools.product(args.lm_weight, args.word_bonus):
            beam = dataclasses.replace(base.beam, alpha=alpha, beta=beta, beam_size=args.beam_size)
            decoding = dataclasses.replace(base, beam=beam)
            sets = {name: score(out, decoding, model.vocabulary) for name, out in outputs.items()}
            mean = sum(s["wer"] for s in sets.values()) / len(sets)
            rows.append(
                {"model": model_dir, "lm_weight": alpha, "word_bonus": beta, "mean_wer": mean, "sets": sets}
            )
            cells = "  ".join(f"{n} {100 * s['wer']:5.1f} / {100 * s['cer']:4.1f}" for n, s in sets.items())
            print(
                f"{model_dir}  lm {alpha:4.2f}  bonus {beta:5.2f}  {cells}  mean WER {100 * mean:5.1f}", flush=True
            )
    best = min(rows, key=lambda r: r["mean_wer"])
    print(f"best: {best['model']} lm weight {best['lm_weight']} word bonus {best['word_bonus']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "best": best}, indent=1) + "\n")


if __name__ == "__main__":
    main()
