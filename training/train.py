"""CTC training of the default streaming model on the synthetic corpus, with fresh augmentation every draw.

    nohup nice -n 10 .venv/bin/python -m training.train --corpus data/corpus --run runs/en1 \\
        --total-steps 9000 > runs/en1.out 2>&1 &

Rerunning the same command resumes from ``runs/<name>/last.pt`` (model, optimizer, step, epoch position).
Batch ``i`` of epoch ``e`` is augmented with a generator seeded from ``(seed, e, i)``, so a run is the same
after a resume and whatever ``--workers`` (data-loading processes) it uses. ``runs/<name>/log.jsonl`` gets
one line per logging interval (training loss, learning rate, audio seconds seen) and one per evaluation
(greedy WER/CER per held-out voice group at 16 kHz and after an 8 kHz mu-law round trip). ``best.pt`` holds
the weights with the lowest mean held-out-voice CER.
Uses CUDA when available; on CPU it runs on ``--threads`` threads (default 1). ``--minutes`` time-boxes a
run (the learning-rate schedule then follows the time spent), e.g. on a rented GPU (``training/gpu.sh``).

This module is the command line and a run's set-up (config, corpus, model: resumed, ``--init`` or fresh);
the loop is ``training.loop``, the batches ``training.data``, the held-out scoring ``training.evaluation``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from cosystream.models import load_model
from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel
from training.augment import augment, mel_centres_hz
from training.data import Corpus
from training.loop import Progress, RunConfig, RunLog, Trainer
from training.phonemes import lexicon_lines, read_lexicon, to_units
from training.phonemes import vocabulary as unit_vocabulary
from training.prior import undo_prior

ROOT = Path(__file__).resolve().parent.parent
# A letter model's vocabulary: CTC blank, word separator, apostrophe, a-z (text.py normalizes to these).
LETTERS = ["<blank>", " ", "'", *"abcdefghijklmnopqrstuvwxyz"]


def default_config(**overrides) -> ConvCtcConfig:
    base = json.loads((ROOT / "cosystream" / "models" / "default" / "config.json").read_text())
    base["vocabulary"] = LETTERS
    base.update(overrides)
    return ConvCtcConfig.from_dict(base)


# ---------------------------------------------------------------- training


def feature_stats(model: ConvCtcModel, corpus: Corpus, names: list[str], rng: np.random.Generator, n: int = 400):
    """Per-mel-bin mean and inverse std of log-mel over ``n`` random (augmented) training utterances."""
    items = corpus.items(names)
    picks = rng.choice(len(items), size=min(n, len(items)), replace=False)
    feats = []
    with torch.no_grad():
        for p in picks:
            name, idx, _ = items[int(p)]
            pcm, _ = corpus.get(name, idx)
            if rng.random() < 0.5:
                pcm = augment(pcm, rng)
            feats.append(model.log_mel(torch.from_numpy(pcm)[None])[0])
    allf = torch.cat(feats)
    mean = allf.mean(0)
    std = allf.std(0).clamp_min(1e-3)
    return mean, 1.0 / std


def model_and_optimizer(
    config: ConvCtcConfig, state: dict | None, weight_decay: float, lr: float
) -> tuple[ConvCtcModel, torch.optim.AdamW]:
    """The model (with ``state``'s weights, if given) and its AdamW (no weight decay on norms and biases).

    A ``state`` whose output layer has another vocabulary's size keeps everything else: the output layer
    starts fresh (new output units on a trained network)."""
    model = ConvCtcModel(config)
    if state is not None:
        if state["head.weight"].shape != model.head.weight.shape:
            state = {k: v for k, v in state.items() if not k.startswith("head.")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith("head.") for k in missing):
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.ndim >= 2 and "norm" not in name else no_decay).append(param)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    return model, opt


def deepen(
    config: ConvCtcConfig, weights: dict, dilations: tuple[int, ...], seed: int, lookahead_blocks: int = 0
) -> tuple:
    """``config`` and ``weights`` with residual blocks appended (``dilations`` extends the config's): the new
    blocks start near the identity (their convolutions at 5% of a fresh initialization; exactly zero would
    never train, as ReLU passes no gradient at 0), so a fine-tune starts from the trained model's output.
    ``lookahead_blocks`` of the new blocks (the last ones) are centred: near the identity they delay the
    output, so the fine-tune still starts from the same transcripts."""
    if dilations[: len(config.dilations)] != config.dilations:
        raise SystemExit(f"--config dilations {list(dilations)} must extend the model's {list(config.dilations)}")
    if config.lookahead_blocks or lookahead_blocks > len(dilations) - len(config.dilations):
        raise SystemExit("--config lookahead_blocks: only appended blocks can be centred")
    grown = dataclasses.replace(config, dilations=dilations, lookahead_blocks=lookahead_blocks)
    torch.manual_seed(seed)
    state = ConvCtcModel(grown).state_dict()
    for k, v in weights.items():
        state[k] = v.clone()
    for i in range(len(config.dilations), len(dilations)):
        state[f"blocks.{i}.conv.weight"] *= 0.05
        state[f"blocks.{i}.conv.bias"].zero_()
    return grown, state


def keep_blocks(config: ConvCtcConfig, weights: dict, keep: list[int]) -> tuple:
    """``config`` and ``weights`` with only the residual blocks ``keep`` (indices, increasing), renumbered:
    a smaller, cheaper student that starts from the trained network's blocks (a fine-tune, e.g. distilled
    with ``--teacher``, then teaches the rest of the stack to do without the dropped ones)."""
    n = len(config.dilations)
    if not keep or keep != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= n:
        raise SystemExit(f"--keep-blocks: increasing block indices in 0..{n - 1}, got {keep}")
    if config.lookahead_blocks:
        raise SystemExit("--keep-blocks: the model has centred (lookahead) blocks; keep-blocks is for causal ones")
    small = dataclasses.replace(config, dilations=tuple(config.dilations[i] for i in keep))
    state = {}
    for k, v in weights.items():
        if k.startswith("blocks."):
            _, index, rest = k.split(".", 2)
            if int(index) in keep:
                state[f"blocks.{keep.index(int(index))}.{rest}"] = v.clone()
        else:
            state[k] = v.clone()
    return small, state


# ---------------------------------------------------------------- a run, step by step


def main(argv: list[str] | None = None) -> None:
    """Train a run, or resume it (see the module docstring)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log = RunLog(args.run)
    setup = build_config(args)
    corpus, names = load_corpus(args.corpus)
    teacher = load_teacher(args.teacher, device)
    model, opt, config, progress = build_model(args, setup, corpus, names, device, log, teacher)
    trainer = Trainer(args, setup, config, model, opt, progress, corpus, device, log, teacher)
    trainer.train()
    trainer.finish()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: every flag and its default are stated here, and only here."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--run", type=Path, default=Path("runs/en1"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-steps", type=int, default=9000)
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this step (default: --total-steps; none with --minutes)",
    )
    p.add_argument("--peak-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--batch-seconds", type=float, default=64.0, help="padded audio per batch")
    p.add_argument("--max-utterance-s", type=float, default=12.0)
    p.add_argument("--checkpoint-minutes", type=float, default=4.0)
    p.add_argument(
        "--snapshots-from",
        type=int,
        default=None,
        help="from this step on, every checkpoint is also kept as snap_<step>.pt (for export --average)",
    )
    p.add_argument(
        "--snapshot-progress",
        type=float,
        default=None,
        help="like --snapshots-from, as a fraction of the schedule (steps, or --minutes)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="time-boxed run: stop after this many minutes of training (resumes included); the cosine "
        "schedule runs over this time instead of --total-steps",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="data-loading processes that augment batches (0: in the training process); a batch is the "
        "same whatever the count",
    )
    p.add_argument("--eval-minutes", type=float, default=10.0)
    p.add_argument("--eval-limit", type=int, default=50, help="utterances per group in periodic evals")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--config", type=str, default="{}", help="JSON overrides of the default ConvCtcConfig")
    p.add_argument(
        "--head-only-steps",
        type=int,
        default=0,
        help="train only the output layer (and its norm) for this many steps first, e.g. after --lexicon "
        "gave an --init model new output units; the learning rate then warms up again over --warmup steps",
    )
    p.add_argument(
        "--lexicon",
        type=Path,
        help="train phoneme units: a training.phonemes lexicon file; the vocabulary becomes its units, and "
        "an --init model with other output units gets a fresh output layer",
    )
    p.add_argument("--no-augment", action="store_true")
    p.add_argument(
        "--vtlp",
        type=float,
        default=0.0,
        help="vocal tract length perturbation: warp 80%% of the utterances' spectra by a factor in 1 +- VTLP "
        "(e.g. 0.1; 0 = off)",
    )
    p.add_argument(
        "--channel-eq",
        type=float,
        default=0.0,
        help="colour this share of the utterances with a random microphone/room equalizer curve (tilt, "
        "resonances, low and high cuts) on the log-mel features (e.g. 0.7; 0 = off)",
    )
    p.add_argument(
        "--init",
        type=Path,
        default=None,
        help="fine-tune: a new run starts from the weights and feature normalization of this checkpoint or "
        "model directory (e.g. cosystream/models/default) "
        "(fresh optimizer and schedule); ignored when the run resumes. With --config dilations that extend "
        "the model's, the extra residual blocks are appended, starting near the identity; --config "
        "lookahead_blocks centres the last blocks (appended ones start as a pure delay)",
    )
    p.add_argument(
        "--keep-blocks",
        type=str,
        default=None,
        help="a smaller student: of the --init model's residual blocks keep only these (comma-separated "
        "indices in order, e.g. 0,1,2,3,4); the others are dropped",
    )
    p.add_argument(
        "--teacher",
        type=Path,
        default=None,
        help="distillation: a model directory (e.g. cosystream/models/default) whose frame posteriors the run "
        "learns beside the CTC targets, on the same augmented features (its prior correction taken out)",
    )
    p.add_argument(
        "--distill",
        type=float,
        default=0.5,
        help="with --teacher: the share of the loss that is the KL divergence from the teacher's posteriors "
        "per frame (the CTC loss has the rest)",
    )
    p.add_argument(
        "--bf16", action="store_true", help="bfloat16 autocast for the network (about 2x faster on CPUs with AMX)"
    )
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> RunConfig:
    """The default model config with ``--config``'s overrides, and the targets: letters, or ``--lexicon``'s
    phoneme units."""
    overrides = json.loads(args.config)
    config = default_config(**overrides)
    lexicon, units, digest = None, None, None
    if args.lexicon is not None:
        lexicon = read_lexicon(args.lexicon)
        units = functools.partial(to_units, lexicon=lexicon)
        digest = hashlib.sha256("".join(lexicon_lines(lexicon)).encode()).hexdigest()
    # Fixed by this config (not an --init or resumed one's), drawn on every epoch.
    centres_hz = mel_centres_hz(config.n_mels, config.f_min_hz, config.f_max_hz)
    return RunConfig(config, overrides, lexicon, units, digest, centres_hz)


def load_corpus(directory: Path) -> tuple[Corpus, list[str]]:
    """The training shards in memory, and their names; exits if there are none."""
    corpus = Corpus(directory)
    names = corpus.refresh()
    if not names:
        raise SystemExit(f"no shards under {directory / 'train'}")
    return corpus, names


def load_teacher(directory: Path | None, device: torch.device) -> ConvCtcModel | None:
    """``--teacher``'s model, frozen, in eval mode on ``device``, without its prior correction (the student
    learns the network's posteriors, not the decoding-time correction); None without one."""
    if directory is None:
        return None
    teacher = load_model(directory)
    if not isinstance(teacher, ConvCtcModel):
        raise SystemExit(f"--teacher {directory}: not a conv_ctc model")
    undo_prior(teacher, directory)
    return teacher.eval().requires_grad_(False).to(device)


def build_model(
    args: argparse.Namespace,
    setup: RunConfig,
    corpus: Corpus,
    names: list[str],
    device: torch.device,
    log: RunLog,
    teacher: ConvCtcModel | None = None,
) -> tuple[ConvCtcModel, torch.optim.AdamW, ConvCtcConfig, Progress]:
    """The model and its optimizer on ``device``, their config, and where the run stands: resumed from its
    ``last.pt``, or new (from ``--init``'s weights, or from scratch with features normalized on the corpus,
    or as ``teacher``'s are: both then see the same features)."""
    ck = load_last(args.run / "last.pt", setup.lexicon_digest)
    config, weights = starting_weights(args, setup, ck)
    if teacher is not None and tuple(teacher.vocabulary) != tuple(config.vocabulary):
        raise SystemExit("--teacher: its output units are not the run's (pass the --lexicon it was trained with)")
    model, opt = model_and_optimizer(config, weights, args.weight_decay, args.peak_lr)
    torch.manual_seed(args.seed)
    if ck is not None:
        progress = resume(ck, opt, log)
    else:
        progress = Progress()
        if weights is None and teacher is not None:
            model.features.shift.copy_(teacher.features.shift)
            model.features.scale.copy_(teacher.features.scale)
        elif weights is None:
            shift, scale = feature_stats(model, corpus, names, np.random.default_rng(args.seed))
            model.features.shift.copy_(shift)
            model.features.scale.copy_(scale)
        log(
            {
                "event": "start",
                "init": None if args.init is None else str(args.init),
                "args": {k: str(v) for k, v in vars(args).items()},
                "params": sum(x.numel() for x in model.parameters()),
                "flops_per_frame": model.flops_per_frame(),
                "shards": len(names),
                "device": str(device),
            }
        )
    model.to(device)
    for state in opt.state.values():
        for k, v in state.items():
            if torch.is_tensor(v):
                state[k] = v.to(device)
    return model, opt, config, progress


def load_last(path: Path, lexicon_digest: str | None) -> dict | None:
    """The run's checkpoint to resume from (None: a new run); exits if it was trained on other targets."""
    ck = torch.load(path, weights_only=False) if path.exists() else None
    # Its targets must stay what they were: the same pronunciations (or letters) it started with.
    if ck is not None and ck.get("lexicon", lexicon_digest) != lexicon_digest:
        if not ck["lexicon"]:
            started_with = "letters (no --lexicon)"
        elif lexicon_digest:
            started_with = "another --lexicon"
        else:
            started_with = "a --lexicon"
        raise SystemExit(f"{path} was trained with {started_with}: resume it with the same targets")
    return ck


def starting_weights(
    args: argparse.Namespace, setup: RunConfig, ck: dict | None
) -> tuple[ConvCtcConfig, dict | None]:
    """The config and weights a run starts from: its checkpoint ``ck``, else ``--init``'s (grown by
    ``--config`` dilations or lookahead_blocks), else none (from scratch, on ``setup``'s config)."""
    config, weights = setup.model, None
    if ck is not None:
        config, weights = ConvCtcConfig.from_dict(ck["config"]), ck["model"]
    elif args.init is not None and args.init.is_dir():  # a model directory, e.g. the shipped default model
        shipped = load_model(args.init)
        if undo_prior(shipped, args.init):
            print(f"{args.init}: its prior correction taken out of the output layer before training")
        config, weights = shipped.config, shipped.state_dict()
    elif args.init is not None:
        init = torch.load(args.init, weights_only=False)
        config, weights = ConvCtcConfig.from_dict(init["config"]), init["model"]
    if setup.units is not None and ck is None:  # (a resumed run's config has them already)
        config = dataclasses.replace(config, vocabulary=tuple(unit_vocabulary(setup.lexicon)))
    if setup.units is None and not set(LETTERS) <= set(config.vocabulary):
        raise SystemExit(
            "the model's tokens are not letters (a phoneme model?): pass the --lexicon it was trained with"
        )
    if ck is None and args.keep_blocks is not None:
        if weights is None:
            raise SystemExit("--keep-blocks: needs an --init model to take the blocks from")
        config, weights = keep_blocks(config, weights, [int(i) for i in args.keep_blocks.split(",")])
    deeper = setup.overrides.get("dilations")
    if ck is None and weights is not None and deeper is not None and tuple(deeper) != config.dilations:
        lookahead = setup.overrides.get("lookahead_blocks", 0)
        config, weights = deepen(config, weights, tuple(deeper), args.seed, lookahead)
    elif ck is None and weights is not None and "lookahead_blocks" in setup.overrides:
        # The model's own last blocks centred: their skips move back, and the fine-tune re-learns around them.
        config = dataclasses.replace(config, lookahead_blocks=setup.overrides["lookahead_blocks"])
    return config, weights


def resume(ck: dict, opt: torch.optim.AdamW, log: RunLog) -> Progress:
    """The optimizer's state and the torch RNG restored from ``ck``, and where the run stood."""
    opt.load_state_dict(ck["optimizer"])
    progress = Progress(**{field.name: ck[field.name] for field in dataclasses.fields(Progress)})
    torch.set_rng_state(ck["rng"]["torch_global"])
    log({"event": "resumed", "step": progress.step, "epoch": progress.epoch, "batch_index": progress.batch_index})
    return progress


if __name__ == "__main__":
    main()
