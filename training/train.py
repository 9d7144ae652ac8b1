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
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from cosystream.models import load_model
from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel
from training.augment import (
    apply_masks,
    augment,
    channel_gains_db,
    colour_features,
    mel_centres_hz,
    spec_masks,
    telephone,
    warp_factors,
    warped_log_mel,
)
from training.corpus import HELD_OUT, load_shard
from training.phonemes import lexicon_lines, read_lexicon, to_units
from training.phonemes import vocabulary as unit_vocabulary

ROOT = Path(__file__).resolve().parent.parent
# A letter model's vocabulary: CTC blank, word separator, apostrophe, a-z (text.py normalizes to these).
LETTERS = ["<blank>", " ", "'", *"abcdefghijklmnopqrstuvwxyz"]
HOP = 160


def default_config(**overrides) -> ConvCtcConfig:
    base = json.loads((ROOT / "cosystream" / "models" / "default" / "config.json").read_text())
    base["vocabulary"] = LETTERS
    base.update(overrides)
    return ConvCtcConfig.from_dict(base)


# ---------------------------------------------------------------- data


class Corpus:
    """All training shards in memory (int16); rescanned for new shards at every epoch."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.shards: dict[str, tuple[np.ndarray, np.ndarray, list[str], list[str]]] = {}

    def refresh(self) -> list[str]:
        for path in sorted((self.directory / "train").glob("shard_*.npz")):
            if path.name.endswith(".tmp.npz") or path.name in self.shards:
                continue
            try:
                self.shards[path.name] = load_shard(path)
            except (OSError, ValueError, KeyError):
                continue  # being written
        return sorted(self.shards)

    def items(self, names: list[str]) -> list[tuple[str, int, int]]:
        """``(shard, index, samples)`` of every utterance in the given shards."""
        out = []
        for name in names:
            _, offsets, _, _ = self.shards[name]
            lengths = np.diff(offsets)
            out += [(name, i, int(n)) for i, n in enumerate(lengths)]
        return out

    def get(self, name: str, index: int) -> tuple[np.ndarray, str]:
        audio, offsets, texts, _ = self.shards[name]
        return audio[offsets[index] : offsets[index + 1]].astype(np.float32) / 32768.0, texts[index]


def make_batches(items, max_seconds: float, max_utterance_s: float, rng: random.Random) -> list[list]:
    """Length-bucketed batches holding at most ``max_seconds`` of (padded) audio, in random order."""
    keyed = sorted(items, key=lambda it: it[2] * rng.uniform(0.9, 1.1))
    keyed = [it for it in keyed if it[2] <= max_utterance_s * 16000]
    batches, current, longest = [], [], 0
    for it in keyed:
        longest_new = max(longest, it[2])
        if current and longest_new * (len(current) + 1) > max_seconds * 16000:
            batches.append(current)
            current, longest_new = [], it[2]
        current.append(it)
        longest = longest_new
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def encode_text(text: str, vocab: dict[str, int]) -> list[int]:
    return [vocab[c] for c in text if c in vocab]


class BatchSource(torch.utils.data.Dataset):
    """Batch ``i`` of an epoch's plan, augmented with a generator seeded from ``(seed, epoch, i)``: the same
    batch whichever process makes it (``--workers``) and after a resume.

    An item is a dict: ``audio [B, N]`` (zero-padded), ``in_lengths`` (frames), ``targets`` (flat),
    ``tgt_lengths``, ``seconds`` (unpadded audio), and ``time_mask [B, T]`` / ``freq_mask [B, n_mels]`` for
    SpecAugment, ``warp [B]`` VTLP factors (``None`` without augmentation or ``vtlp``) and ``colour [B, n_mels]``
    channel gains in dB at ``mel_centres_hz`` (``None`` without augmentation or ``channel_eq``).
    ``tail_frames`` of silence follow every utterance (a model with lookahead outputs that much later)."""

    def __init__(
        self,
        corpus,
        batches,
        vocab,
        n_mels: int,
        seed: int,
        epoch: int,
        first: int,
        augment_on: bool,
        vtlp: float = 0.0,
        channel_eq: float = 0.0,
        mel_centres_hz: np.ndarray | None = None,
        units=None,
        tail_frames: int = 0,
    ):
        self.tail_frames = tail_frames
        self.corpus, self.batches, self.vocab, self.n_mels = corpus, batches, vocab, n_mels
        self.units = units  # text -> the model's unit string (phonemes); None: the text itself
        self.seed, self.epoch, self.first, self.augment_on, self.vtlp = seed, epoch, first, augment_on, vtlp
        self.channel_eq, self.mel_centres_hz = channel_eq, mel_centres_hz

    def __len__(self) -> int:
        return len(self.batches) - self.first

    def __getitem__(self, i: int) -> dict:
        index = self.first + i
        rng = np.random.default_rng([self.seed, self.epoch, index])
        pcms, targets = [], []
        for name, idx, _ in self.batches[index]:
            pcm, text = self.corpus.get(name, idx)
            pcms.append(augment(pcm, rng) if self.augment_on else pcm)
            targets.append(encode_text(text if self.units is None else self.units(text), self.vocab))
        audio = torch.zeros(len(pcms), max(x.size for x in pcms) + self.tail_frames * HOP)
        for row, x in enumerate(pcms):
            audio[row, : x.size] = torch.from_numpy(x)
        frames = [x.size // HOP + self.tail_frames for x in pcms]
        masks = (None, None)
        if self.augment_on:
            masks = tuple(torch.from_numpy(m) for m in spec_masks(frames, self.n_mels, rng, audio.shape[1] // HOP))
        warp = None
        if self.augment_on and self.vtlp > 0:
            warp = torch.from_numpy(warp_factors(len(pcms), rng, self.vtlp))
        colour = None
        if self.augment_on and self.channel_eq > 0:
            colour = torch.from_numpy(channel_gains_db(len(pcms), self.mel_centres_hz, rng, self.channel_eq))
        return {
            "audio": audio,
            "in_lengths": torch.tensor(frames),
            "targets": torch.tensor([c for t in targets for c in t], dtype=torch.long),
            "tgt_lengths": torch.tensor([len(t) for t in targets]),
            "seconds": float(sum(x.size for x in pcms)) / 16000,
            "time_mask": masks[0],
            "freq_mask": masks[1],
            "warp": warp,
            "colour": colour,
        }


def _one_thread(_worker: int) -> None:
    torch.set_num_threads(1)


# ---------------------------------------------------------------- metrics


def edit_distance(a: list, b: list) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def greedy_decode(logits: torch.Tensor, length: int, vocabulary: list[str]) -> str:
    ids = logits[:length].argmax(-1).tolist()
    out, last = [], 0
    for i in ids:
        if i != last and i != 0:
            out.append(vocabulary[i])
        last = i
    return " ".join("".join(out).split())


def load_eval(
    directory: Path, limit: int | None = None, units=None
) -> dict[str, tuple[list[np.ndarray], list[str]]]:
    """The corpus' evaluation groups; ``units`` maps their texts to the model's units (phonemes)."""
    groups = {}
    for path in sorted((directory / "eval").glob("*.npz")):
        audio, offsets, texts, _ = load_shard(path)
        n = len(texts) if limit is None else min(limit, len(texts))
        groups[path.stem] = (
            [audio[offsets[i] : offsets[i + 1]].astype(np.float32) / 32768.0 for i in range(n)],
            texts[:n] if units is None else [units(t) for t in texts[:n]],
        )
    return groups


@torch.no_grad()
def evaluate(
    model: ConvCtcModel,
    groups,
    device,
    telephone_too: bool = True,
    batch_seconds: float = 120.0,
    examples: int = 0,
    decoders=None,
) -> dict:
    """WER/CER per group (``<group>`` at 16 kHz, ``<group>@8k-mulaw`` after a phone round trip).

    Greedy decoding, or ``decoders()`` (a ``cosystream.server.decoding.DecoderFactory``) fed the top-k
    log-probabilities of each frame, as the server does."""
    model.eval()
    results = {}
    conditions = [("", None)] + ([("@8k-mulaw", "mulaw")] if telephone_too else [])
    for name, (audios, texts) in groups.items():
        for suffix, codec in conditions:
            pcms = [a if codec is None else telephone(a * 0.9, codec) for a in audios]
            # Trailing 0.3 s of silence so the causal model can emit the last characters.
            pcms = [np.concatenate([p, np.zeros(4800, np.float32)]) for p in pcms]
            order = sorted(range(len(pcms)), key=lambda i: pcms[i].size)
            hyps: dict[int, str] = {}
            i = 0
            while i < len(order):
                j = i
                while j < len(order) and pcms[order[j]].size * (j - i + 1) <= batch_seconds * 16000:
                    j += 1
                j = max(j, i + 1)
                idx = order[i:j]
                longest = max(pcms[k].size for k in idx)
                batch = torch.zeros(len(idx), longest)
                for row, k in enumerate(idx):
                    batch[row, : pcms[k].size] = torch.from_numpy(pcms[k])
                logits = model(batch.to(device)).cpu()
                for row, k in enumerate(idx):
                    frames = pcms[k].size // HOP
                    if decoders is None:
                        hyps[k] = greedy_decode(logits[row], frames, model.vocabulary)
                        continue
                    best = torch.log_softmax(logits[row, :frames].float(), -1).topk(decoders.config.top_k, -1)
                    decoder = decoders()
                    decoder.push(best.indices.numpy(), best.values.numpy(), 0)
                    decoder.finalize()
                    hyps[k] = decoder.text
                i = j
            words = chars = werr = cerr = 0
            for k, ref in enumerate(texts):
                werr += edit_distance(hyps[k].split(), ref.split())
                cerr += edit_distance(list(hyps[k]), list(ref))
                words += len(ref.split())
                chars += len(ref)
            entry = {"wer": werr / max(1, words), "cer": cerr / max(1, chars), "n": len(texts)}
            if examples:
                entry["examples"] = [[texts[k], hyps[k]] for k in range(min(examples, len(texts)))]
            results[name + suffix] = entry
    held = [v for k, v in results.items() if k.split("@")[0] in HELD_OUT] or list(results.values())
    if held:
        results["held_out_mean"] = {
            "wer": float(np.mean([v["wer"] for v in held])),
            "cer": float(np.mean([v["cer"] for v in held])),
        }
    model.train()
    return results


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


def lr_at(
    step: int, peak: float, warmup: int, total: int, floor: float = 0.03, progress: float | None = None
) -> float:
    """Linear warmup over ``warmup`` steps, then a cosine to ``floor * peak`` over the rest of ``total``
    steps, or, when given, over ``progress`` (0..1, e.g. the fraction of a time budget spent)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if progress is None:
        progress = (step - warmup) / max(1, total - warmup)
    progress = min(1.0, progress)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(path: Path, **state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


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


def main(argv: list[str] | None = None) -> None:
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
        "--bf16", action="store_true", help="bfloat16 autocast for the network (about 2x faster on CPUs with AMX)"
    )
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.run.mkdir(parents=True, exist_ok=True)
    log_path = args.run / "log.jsonl"
    started = time.time()

    def log(record: dict) -> None:
        record = {"time": round(time.time(), 1), "wall_s": round(time.time() - started, 1), **record}
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)

    overrides = json.loads(args.config)
    config = default_config(**overrides)
    units, lexicon_digest = None, None
    if args.lexicon is not None:
        lexicon = read_lexicon(args.lexicon)
        units = functools.partial(to_units, lexicon=lexicon)
        lexicon_digest = hashlib.sha256("".join(lexicon_lines(lexicon)).encode()).hexdigest()
    # The mel filters' centres, where --channel-eq's gains apply: fixed by the config, drawn on every epoch.
    centres_hz = mel_centres_hz(config.n_mels, config.f_min_hz, config.f_max_hz)
    corpus = Corpus(args.corpus)
    names = corpus.refresh()
    if not names:
        raise SystemExit(f"no shards under {args.corpus / 'train'}")

    # Weights: a run resumes from its last.pt, or starts from --init's weights, or from scratch.
    last_path = args.run / "last.pt"
    ck = torch.load(last_path, weights_only=False) if last_path.exists() else None
    # Its targets must stay what they were: the same pronunciations (or letters) it started with.
    if ck is not None and ck.get("lexicon", lexicon_digest) != lexicon_digest:
        if not ck["lexicon"]:
            started_with = "letters (no --lexicon)"
        elif lexicon_digest:
            started_with = "another --lexicon"
        else:
            started_with = "a --lexicon"
        raise SystemExit(f"{last_path} was trained with {started_with}: resume it with the same targets")
    weights = None
    if ck is not None:
        config, weights = ConvCtcConfig.from_dict(ck["config"]), ck["model"]
    elif args.init is not None and args.init.is_dir():  # a model directory, e.g. the shipped default model
        from training.prior import undo_prior

        shipped = load_model(args.init)
        if undo_prior(shipped, args.init):
            print(f"{args.init}: its prior correction taken out of the output layer before training")
        config, weights = shipped.config, shipped.state_dict()
    elif args.init is not None:
        init = torch.load(args.init, weights_only=False)
        config, weights = ConvCtcConfig.from_dict(init["config"]), init["model"]
    if units is not None and ck is None:  # (a resumed run's config has them already)
        config = dataclasses.replace(config, vocabulary=tuple(unit_vocabulary(lexicon)))
    if units is None and not set(LETTERS) <= set(config.vocabulary):
        raise SystemExit(
            "the model's tokens are not letters (a phoneme model?): pass the --lexicon it was trained with"
        )
    vocab = {c: i for i, c in enumerate(config.vocabulary)}
    deeper = overrides.get("dilations")
    if ck is None and weights is not None and deeper is not None and tuple(deeper) != config.dilations:
        config, weights = deepen(config, weights, tuple(deeper), args.seed, overrides.get("lookahead_blocks", 0))
    elif ck is None and weights is not None and "lookahead_blocks" in overrides:
        # The model's own last blocks centred: their skips move back, and the fine-tune re-learns around them.
        config = dataclasses.replace(config, lookahead_blocks=overrides["lookahead_blocks"])
    model, opt = model_and_optimizer(config, weights, args.weight_decay, args.peak_lr)

    torch.manual_seed(args.seed)
    step, epoch, batch_index, audio_seen, train_seconds = 0, 0, 0, 0.0, 0.0
    epoch_shards: list[str] | None = None
    best_cer = float("inf")
    if ck is not None:
        opt.load_state_dict(ck["optimizer"])
        step, epoch, batch_index = ck["step"], ck["epoch"], ck["batch_index"]
        audio_seen, train_seconds, best_cer = ck["audio_seen"], ck["train_seconds"], ck["best_cer"]
        epoch_shards = ck["epoch_shards"]
        torch.set_rng_state(ck["rng"]["torch_global"])
        log({"event": "resumed", "step": step, "epoch": epoch, "batch_index": batch_index})
    else:
        if weights is None:
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
    ctc = torch.nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
    eval_groups = load_eval(args.corpus, args.eval_limit, units)
    budget_s = None if args.minutes is None else args.minutes * 60
    # A time-boxed run stops on time (or at an explicit --max-steps), never at the default --total-steps.
    max_steps = args.max_steps or (None if budget_s else args.total_steps)

    def checkpoint(path: Path) -> None:
        save_checkpoint(
            path,
            model={k: v.cpu() for k, v in model.state_dict().items()},
            optimizer=opt.state_dict(),
            config=json.loads(config.to_json()),
            step=step,
            epoch=epoch,
            batch_index=batch_index,
            epoch_shards=epoch_shards,
            audio_seen=audio_seen,
            train_seconds=train_seconds,
            best_cer=best_cer,
            rng={"torch_global": torch.get_rng_state()},
            lexicon=lexicon_digest,  # sha256 of the --lexicon's lines (None: letters)
        )

    def run_eval() -> None:
        nonlocal best_cer
        t0 = time.time()
        res = evaluate(model, eval_groups, device, examples=2)
        log(
            {
                "event": "eval",
                "step": step,
                "epoch": epoch,
                "audio_hours": round(audio_seen / 3600, 2),
                "eval_s": round(time.time() - t0, 1),
                "results": res,
            }
        )
        cer = res["held_out_mean"]["cer"]
        if cer < best_cer:
            best_cer = cer
            checkpoint(args.run / "best.pt")
            log({"event": "best", "step": step, "held_out_mean": res["held_out_mean"]})

    def progress() -> float:
        return train_seconds / budget_s if budget_s else step / max(1, args.total_steps)

    def more() -> bool:
        return (max_steps is None or step < max_steps) and (budget_s is None or train_seconds < budget_s)

    last_ckpt = last_eval = time.time()
    loss_sum = loss_n = 0.0
    t_interval = time.time()
    body_frozen = False  # by --head-only-steps
    model.train()
    while more():
        if epoch_shards is None:
            epoch_shards = corpus.refresh()
            batch_index = 0
        else:
            corpus.refresh()
        epoch_rng = random.Random(args.seed * 7919 + epoch)
        batches = make_batches(corpus.items(epoch_shards), args.batch_seconds, args.max_utterance_s, epoch_rng)
        if batch_index == 0:
            n_utt = sum(len(b) for b in batches)
            log(
                {
                    "event": "epoch",
                    "epoch": epoch,
                    "shards": len(epoch_shards),
                    "utterances": n_utt,
                    "batches": len(batches),
                }
            )
        source = BatchSource(
            corpus,
            batches,
            vocab,
            config.n_mels,
            args.seed,
            epoch,
            batch_index,
            not args.no_augment,
            args.vtlp,
            args.channel_eq,
            centres_hz,
            units,
            config.output_delay_frames,
        )
        loader = torch.utils.data.DataLoader(
            source,
            batch_size=None,
            num_workers=args.workers,
            pin_memory=device.type == "cuda",
            prefetch_factor=4 if args.workers else None,
            worker_init_fn=_one_thread if args.workers else None,
        )
        t0 = time.time()
        for batch in loader:
            if not more():
                break
            head_only = step < args.head_only_steps
            if head_only != body_frozen:
                for name, param in model.named_parameters():
                    param.requires_grad_(not head_only or name.startswith(("head.", "out_norm.")))
                body_frozen = head_only
                log({"event": "body " + ("frozen" if head_only else "trained"), "step": step})
            lr = lr_at(
                step, args.peak_lr, args.warmup, args.total_steps, progress=progress() if budget_s else None
            )
            if args.head_only_steps and step >= args.head_only_steps:
                # The body's fresh AdamW state would take full-size steps at once: warm up again.
                lr *= min(1.0, (step - args.head_only_steps + 1) / args.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            audio = batch["audio"].to(device, non_blocking=True)
            if batch["warp"] is not None:
                features = warped_log_mel(model, audio, batch["warp"])  # host warps: no sync
            else:
                features = model.log_mel(audio)
            if batch["colour"] is not None:
                features = colour_features(features, batch["colour"].to(device), model.features.scale)
            if batch["time_mask"] is not None:
                features = apply_masks(features, batch["time_mask"].to(device), batch["freq_mask"].to(device))
            # bfloat16 for the network's matmuls (AMX / AVX-512-BF16 on recent x86 CPUs, tensor cores on
            # CUDA), float32 weights, features and loss.
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                logits = model.encode(features)
            log_probs = logits.float().log_softmax(-1)
            loss = ctc(
                log_probs.transpose(0, 1).float().cpu() if device.type != "cuda" else log_probs.transpose(0, 1),
                batch["targets"].to(device) if device.type == "cuda" else batch["targets"],
                batch["in_lengths"],
                batch["tgt_lengths"],
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            step += 1
            batch_index += 1
            audio_seen += batch["seconds"]
            train_seconds += time.time() - t0
            loss_sum += loss.detach()  # a device tensor: read (one sync) only when logged
            loss_n += 1
            if step % args.log_every == 0:
                log(
                    {
                        "event": "train",
                        "step": step,
                        "epoch": epoch,
                        "loss": round(float(loss_sum) / loss_n, 4),
                        "lr": round(opt.param_groups[0]["lr"], 6),
                        "audio_hours": round(audio_seen / 3600, 2),
                        "step_s": round((time.time() - t_interval) / loss_n, 3),
                    }
                )
                loss_sum = loss_n = 0.0
                t_interval = time.time()
            now = time.time()
            if eval_groups and now - last_eval > args.eval_minutes * 60:
                run_eval()
                last_eval = time.time()
            if now - last_ckpt > args.checkpoint_minutes * 60:
                checkpoint(last_path)
                snapshot = args.snapshots_from is not None and step >= args.snapshots_from
                if snapshot or (args.snapshot_progress is not None and progress() >= args.snapshot_progress):
                    shutil.copyfile(last_path, args.run / f"snap_{step}.pt")
                last_ckpt = time.time()
            t0 = time.time()
        del loader
        if batch_index >= len(batches):
            epoch += 1
            epoch_shards = None
    checkpoint(last_path)
    if eval_groups:
        run_eval()
        checkpoint(last_path)
    log({"event": "done", "step": step, "audio_hours": round(audio_seen / 3600, 2)})


if __name__ == "__main__":
    main()
