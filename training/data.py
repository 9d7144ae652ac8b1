"""Training data: the corpus' shards in memory, length-bucketed batches and their seeded augmentation.

Shared by ``training.train`` (batches) and ``training.prior`` (random utterances), which is why it is a
module of its own: neither imports the other.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cosystream.frames import FRAME_SAMPLES
from training.augment import augment, channel_gains_db, spec_masks, warp_factors
from training.corpus import load_shard

HOP = FRAME_SAMPLES  # samples per feature frame (10 ms at 16 kHz)


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


def one_thread(_worker: int) -> None:
    """A data-loading worker's ``worker_init_fn``: one torch thread, so workers do not oversubscribe cores."""
    torch.set_num_threads(1)


def load_eval(
    directory: Path, limit: int | None = None, units: Callable[[str], str] | None = None
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
