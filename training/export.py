"""Export a training checkpoint as a model directory and measure it on the held-out evaluation sets.

    nice -n 10 .venv/bin/python -m training.export --checkpoint runs/en1/best.pt --out runs/export/default

Writes ``config.json``, ``vocabulary.json`` and ``model.safetensors`` (float32) through
``cosystream.models.save_model``, checks that ``load_model`` reads back identical outputs, and (unless
``--no-eval``) writes ``eval.json`` and ``eval.md`` beside them: WER/CER per voice group, at 16 kHz and after
an 8 kHz mu-law round trip, on all held-out sentences, with greedy decoding and with beam search against
the language model ``--lm`` (default: the one shipped beside the default model), copied into the export.
A phoneme model (trained with ``training.train --lexicon``) needs that lexicon here too: it is written
into the export as ``lexicon.tsv.gz``, and its greedy table scores phoneme strings (CER = phoneme error
rate) against the sentences' pronunciations.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
from pathlib import Path

import torch

from cosystream.models import load_model, save_model
from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel

MAX_BYTES = 25 * 1024 * 1024


def model_from_checkpoint(path: Path, average: list[Path] = ()) -> tuple[ConvCtcModel, dict]:
    """The checkpoint's model; with ``average``, the mean of its weights and those checkpoints' weights."""
    ck = torch.load(path, map_location="cpu", weights_only=False)
    model = ConvCtcModel(ConvCtcConfig.from_dict(ck["config"]))
    state = {k: v.clone() for k, v in ck["model"].items()}
    for other in average:
        extra = torch.load(other, map_location="cpu", weights_only=False)
        if extra["config"] != ck["config"]:
            raise SystemExit(f"{other}: a different model configuration than {path}")
        for k, v in extra["model"].items():
            if v.is_floating_point():
                state[k] += v
    for v in state.values():
        if v.is_floating_point():
            v /= 1 + len(average)
    model.load_state_dict(state)
    return model.eval(), ck


def export(model: ConvCtcModel, out: Path) -> None:
    save_model(model, out)
    size = sum(
        f.stat().st_size
        for f in out.iterdir()
        if f.name in {"config.json", "vocabulary.json", "model.safetensors"}
    )
    if size > MAX_BYTES:
        raise SystemExit(f"exported model is {size} bytes > {MAX_BYTES}")
    loaded = load_model(out)
    probe = torch.randn(1, 16000) * 0.1
    with torch.no_grad():
        if not torch.allclose(loaded(probe), model.float()(probe), atol=1e-5):
            raise SystemExit("load_model(out) does not reproduce the checkpoint")


def markdown(results: dict) -> str:
    groups = sorted({k.split("@")[0] for k in results if k != "held_out_mean"})
    lines = [
        "| voice group | WER 16 kHz | CER 16 kHz | WER 8 kHz mu-law | CER 8 kHz mu-law |",
        "|---|---|---|---|---|",
    ]
    for g in groups:
        a, b = results.get(g, {}), results.get(g + "@8k-mulaw", {})
        fmt = lambda r, k: f"{100 * r[k]:.1f}%" if k in r else "-"  # noqa: E731
        lines.append(f"| {g} | {fmt(a, 'wer')} | {fmt(a, 'cer')} | {fmt(b, 'wer')} | {fmt(b, 'cer')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("runs/en1/best.pt"))
    p.add_argument(
        "--average",
        type=Path,
        nargs="*",
        default=[],
        help="more checkpoints of the same run to average weights with",
    )
    p.add_argument("--out", type=Path, default=Path("runs/export/default"))
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lm", type=Path, default=Path("cosystream/models/default/lm.arpa.gz"))
    p.add_argument("--lexicon", type=Path, help="a phoneme model's pronunciation lexicon (training.phonemes)")
    p.add_argument(
        "--save-checkpoint",
        type=Path,
        default=None,
        help="also write the (averaged) weights as a checkpoint without optimizer state: small to copy "
        "off a training machine and export or evaluate elsewhere",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, ck = model_from_checkpoint(args.checkpoint, args.average)
    export(model, args.out)
    if args.lm.is_file() and args.lm.resolve() != (args.out / "lm.arpa.gz").resolve():
        shutil.copyfile(args.lm, args.out / "lm.arpa.gz")
    units = None
    if args.lexicon is not None:
        from training.phonemes import read_lexicon, to_units, write_lexicon

        lexicon = read_lexicon(args.lexicon)
        write_lexicon(lexicon, args.out / "lexicon.tsv.gz")
        units = functools.partial(to_units, lexicon=lexicon)

    print(f"exported step {ck['step']} ({ck['audio_seen'] / 3600:.1f} h of audio seen) to {args.out}")
    if args.save_checkpoint is not None:
        light = {k: ck[k] for k in ("config", "step", "epoch", "audio_seen", "train_seconds")}
        torch.save({**light, "model": model.state_dict()}, args.save_checkpoint)
    if args.no_eval:
        return
    from cosystream.decoding.config import DecoderConfig, DecoderFactory
    from training.corpus import HELD_OUT
    from training.data import load_eval
    from training.evaluation import evaluate

    loaded, groups = load_model(args.out), load_eval(args.corpus)
    spelled = groups if units is None else {g: (a, [units(t) for t in texts]) for g, (a, texts) in groups.items()}
    tables = {"greedy": evaluate(loaded, spelled, torch.device("cpu"), examples=5)}
    if (args.out / "lm.arpa.gz").is_file():
        decoders = DecoderFactory(DecoderConfig("beam").resolve(str(args.out)), loaded.vocabulary)
        tables["beam"] = evaluate(loaded, groups, torch.device("cpu"), examples=5, decoders=decoders)
    for results in tables.values():
        mean = lambda key, cond, r=results: sum(r[g + cond][key] for g in HELD_OUT) / len(HELD_OUT)  # noqa: E731
        results["held_out_mean@8k-mulaw"] = {"wer": mean("wer", "@8k-mulaw"), "cer": mean("cer", "@8k-mulaw")}
        results["held_out_mean"] = {"wer": mean("wer", ""), "cer": mean("cer", "")}
    meta = {
        "checkpoint": str(args.checkpoint),
        "averaged_with": [str(a) for a in args.average],
        "step": ck["step"],
        "audio_hours_seen": ck["audio_seen"] / 3600,
        "train_seconds": ck["train_seconds"],
        "flops_per_frame": loaded.flops_per_frame(),
    }
    (args.out / "eval.json").write_text(json.dumps({"meta": meta, "results": tables}, indent=1) + "\n")
    table = "\n".join(f"{name}:\n\n{markdown(results)}" for name, results in tables.items())
    (args.out / "eval.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
