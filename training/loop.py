"""The training loop of one run: batches, optimizer steps on the learning-rate schedule, and on the way the
log, held-out evaluations and checkpoints that ``training.train`` resumes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel
from training.augment import apply_masks, colour_features, warped_log_mel
from training.data import BatchSource, Corpus, load_eval, make_batches, one_thread
from training.evaluation import evaluate


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The command line's model config and targets, resolved once, before any weights are loaded."""

    model: ConvCtcConfig  # the default config with --config's overrides (--init or a resume replaces it)
    overrides: dict
    lexicon: dict[str, str] | None  # --lexicon's pronunciations; None: letters
    units: Callable[[str], str] | None  # text -> the lexicon's unit string; None: letters
    lexicon_digest: str | None  # sha256 of the lexicon's lines, kept in checkpoints
    centres_hz: np.ndarray  # the mel filters' centres, where --channel-eq's gains apply


@dataclasses.dataclass
class Progress:
    """Where a run stands: saved in every checkpoint (these keys, in this order) and restored on resume."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    epoch_shards: list[str] | None = None  # the epoch's shards (None: the next batch starts an epoch)
    audio_seen: float = 0.0
    train_seconds: float = 0.0
    best_cer: float = float("inf")


class RunLog:
    """``runs/<name>/log.jsonl``: one JSON record a line, also printed, stamped with the time and the seconds
    since this process started the run."""

    def __init__(self, run: Path):
        run.mkdir(parents=True, exist_ok=True)
        self.path = run / "log.jsonl"
        self.started = time.time()

    def __call__(self, record: dict) -> None:
        record = {"time": round(time.time(), 1), "wall_s": round(time.time() - self.started, 1), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


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


class Trainer:
    """The training loop of one run, and what it keeps between steps: the loss, the held-out groups, the step
    and time budget, and when it last logged, evaluated and checkpointed."""

    def __init__(
        self,
        args: argparse.Namespace,
        setup: RunConfig,
        config: ConvCtcConfig,
        model: ConvCtcModel,
        opt: torch.optim.AdamW,
        progress: Progress,
        corpus: Corpus,
        device: torch.device,
        log: RunLog,
        teacher: ConvCtcModel | None = None,
    ):
        self.args, self.setup, self.config, self.model, self.opt = args, setup, config, model, opt
        self.teacher = teacher  # --teacher: its posteriors are part of the loss (``distillation``)
        self.progress, self.corpus, self.device, self.log = progress, corpus, device, log
        self.vocab = {c: i for i, c in enumerate(config.vocabulary)}
        self.ctc = torch.nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
        self.eval_groups = load_eval(args.corpus, args.eval_limit, setup.units)
        self.last_path = args.run / "last.pt"
        self.budget_s = None if args.minutes is None else args.minutes * 60
        # A time-boxed run stops on time (or at an explicit --max-steps), never at the default --total-steps.
        self.max_steps = args.max_steps or (None if self.budget_s else args.total_steps)
        self.body_frozen = False  # by --head-only-steps
        self.loss_sum = self.loss_n = 0.0  # since the last training log record
        self.last_ckpt = self.last_eval = self.t_interval = time.time()

    def schedule_fraction(self) -> float:
        """How far the learning-rate schedule is: training time over --minutes, or steps over --total-steps."""
        p = self.progress
        return p.train_seconds / self.budget_s if self.budget_s else p.step / max(1, self.args.total_steps)

    def more(self) -> bool:
        """Whether the step and time budgets leave another step."""
        p = self.progress
        return (self.max_steps is None or p.step < self.max_steps) and (
            self.budget_s is None or p.train_seconds < self.budget_s
        )

    def train(self) -> None:
        """Epochs of batches until the budget is spent, evaluating and checkpointing on the way."""
        p = self.progress
        self.last_ckpt = self.last_eval = time.time()
        self.loss_sum = self.loss_n = 0.0
        self.t_interval = time.time()
        self.model.train()
        while self.more():
            batches = self.epoch_batches()
            loader = self.loader(batches)
            t0 = time.time()
            for batch in loader:
                if not self.more():
                    break
                loss = self.step(batch)
                p.step += 1
                p.batch_index += 1
                p.audio_seen += batch["seconds"]
                p.train_seconds += time.time() - t0
                self.loss_sum += loss.detach()  # a device tensor: read (one sync) only when logged
                self.loss_n += 1
                self.after_step()
                t0 = time.time()  # (evaluations and checkpoints do not count as training time)
            del loader
            if p.batch_index >= len(batches):
                p.epoch += 1
                p.epoch_shards = None

    def epoch_batches(self) -> list[list]:
        """The epoch's batch plan: a new epoch takes the shards there are now (and is logged); a resumed
        one keeps its own, and goes on from its ``batch_index``."""
        p, args = self.progress, self.args
        if p.epoch_shards is None:
            p.epoch_shards = self.corpus.refresh()
            p.batch_index = 0
        else:
            self.corpus.refresh()
        epoch_rng = random.Random(args.seed * 7919 + p.epoch)
        batches = make_batches(
            self.corpus.items(p.epoch_shards), args.batch_seconds, args.max_utterance_s, epoch_rng
        )
        if p.batch_index == 0:
            n_utt = sum(len(b) for b in batches)
            self.log(
                {
                    "event": "epoch",
                    "epoch": p.epoch,
                    "shards": len(p.epoch_shards),
                    "utterances": n_utt,
                    "batches": len(batches),
                }
            )
        return batches

    def loader(self, batches: list[list]) -> torch.utils.data.DataLoader:
        """The epoch's batches from ``batch_index`` on, augmented in ``--workers`` processes."""
        args, config, p = self.args, self.config, self.progress
        source = BatchSource(
            self.corpus,
            batches,
            self.vocab,
            config.n_mels,
            args.seed,
            p.epoch,
            p.batch_index,
            not args.no_augment,
            args.vtlp,
            args.channel_eq,
            self.setup.centres_hz,
            self.setup.units,
            config.output_delay_frames,
        )
        return torch.utils.data.DataLoader(
            source,
            batch_size=None,
            num_workers=args.workers,
            pin_memory=self.device.type == "cuda",
            prefetch_factor=4 if args.workers else None,
            worker_init_fn=one_thread if args.workers else None,
        )

    def step(self, batch: dict) -> torch.Tensor:
        """One optimizer step on ``batch`` at the schedule's learning rate; returns the loss (on the device)."""
        args, model, device, step = self.args, self.model, self.device, self.progress.step
        head_only = step < args.head_only_steps
        if head_only != self.body_frozen:
            for name, param in model.named_parameters():
                param.requires_grad_(not head_only or name.startswith(("head.", "out_norm.")))
            self.body_frozen = head_only
            self.log({"event": "body " + ("frozen" if head_only else "trained"), "step": step})
        progress = self.schedule_fraction() if self.budget_s else None
        lr = lr_at(step, args.peak_lr, args.warmup, args.total_steps, progress=progress)
        if args.head_only_steps and step >= args.head_only_steps:
            # The body's fresh AdamW state would take full-size steps at once: warm up again.
            lr *= min(1.0, (step - args.head_only_steps + 1) / args.warmup)
        for group in self.opt.param_groups:
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
        loss = self.ctc(
            log_probs.transpose(0, 1).float().cpu() if device.type != "cuda" else log_probs.transpose(0, 1),
            batch["targets"].to(device) if device.type == "cuda" else batch["targets"],
            batch["in_lengths"],
            batch["tgt_lengths"],
        )
        if self.teacher is not None:
            kl = self.distillation(features, log_probs, batch["in_lengths"])
            loss = (1.0 - args.distill) * loss.to(device) + args.distill * kl
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        self.opt.step()
        return loss

    def distillation(self, features: torch.Tensor, log_probs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The KL divergence from the teacher's posteriors to the student's ``log_probs`` ``[B, T, V]``, per
        frame, averaged over the real (unpadded, ``lengths``) frames; the teacher sees the same ``features``."""
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.bf16):
            teacher_logits = self.teacher.encode(features)
        teacher_lp = teacher_logits.float().log_softmax(-1)
        kl = (teacher_lp.exp() * (teacher_lp - log_probs)).sum(-1)  # [B, T]
        frames = torch.arange(kl.shape[1], device=kl.device)[None, :] < lengths.to(kl.device)[:, None]
        return (kl * frames).sum() / frames.sum().clamp_min(1)

    def after_step(self) -> None:
        """What is due after a step: a training log record every ``--log-every`` steps, an evaluation every
        ``--eval-minutes``, a checkpoint (and snapshot, if asked for) every ``--checkpoint-minutes``."""
        p, args = self.progress, self.args
        if p.step % args.log_every == 0:
            self.log(
                {
                    "event": "train",
                    "step": p.step,
                    "epoch": p.epoch,
                    "loss": round(float(self.loss_sum) / self.loss_n, 4),
                    "lr": round(self.opt.param_groups[0]["lr"], 6),
                    "audio_hours": round(p.audio_seen / 3600, 2),
                    "step_s": round((time.time() - self.t_interval) / self.loss_n, 3),
                }
            )
            self.loss_sum = self.loss_n = 0.0
            self.t_interval = time.time()
        now = time.time()
        if self.eval_groups and now - self.last_eval > args.eval_minutes * 60:
            self.run_eval()
            self.last_eval = time.time()
        if now - self.last_ckpt > args.checkpoint_minutes * 60:
            self.checkpoint(self.last_path)
            snapshot = args.snapshots_from is not None and p.step >= args.snapshots_from
            late = args.snapshot_progress is not None and self.schedule_fraction() >= args.snapshot_progress
            if snapshot or late:
                shutil.copyfile(self.last_path, args.run / f"snap_{p.step}.pt")
            self.last_ckpt = time.time()

    def run_eval(self) -> None:
        """Evaluate on the held-out groups, log it, and keep the weights as ``best.pt`` if their held-out CER
        is the lowest yet."""
        p = self.progress
        t0 = time.time()
        res = evaluate(self.model, self.eval_groups, self.device, examples=2)
        self.log(
            {
                "event": "eval",
                "step": p.step,
                "epoch": p.epoch,
                "audio_hours": round(p.audio_seen / 3600, 2),
                "eval_s": round(time.time() - t0, 1),
                "results": res,
            }
        )
        cer = res["held_out_mean"]["cer"]
        if cer < p.best_cer:
            p.best_cer = cer
            self.checkpoint(self.args.run / "best.pt")
            self.log({"event": "best", "step": p.step, "held_out_mean": res["held_out_mean"]})

    def checkpoint(self, path: Path) -> None:
        """Everything a resume needs: weights, optimizer, config, progress, the torch RNG and the targets."""
        save_checkpoint(
            path,
            model={k: v.cpu() for k, v in self.model.state_dict().items()},
            optimizer=self.opt.state_dict(),
            config=json.loads(self.config.to_json()),
            **dataclasses.asdict(self.progress),
            rng={"torch_global": torch.get_rng_state()},
            lexicon=self.setup.lexicon_digest,  # sha256 of the --lexicon's lines (None: letters)
        )

    def finish(self) -> None:
        """The final checkpoint and evaluation (checkpointed again: it may have found a new best) and the
        ``done`` record."""
        p = self.progress
        self.checkpoint(self.last_path)
        if self.eval_groups:
            self.run_eval()
            self.checkpoint(self.last_path)
        self.log({"event": "done", "step": p.step, "audio_hours": round(p.audio_seen / 3600, 2)})
