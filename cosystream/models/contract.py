"""The streaming-model contract that the engine runs.

A model is a ``torch.nn.Module`` with:

- ``vocabulary``: the output symbols, index 0 = CTC blank (letters, or phonemes when the model directory
  ships a pronunciation lexicon, ``lexicon.tsv.gz``: see ``cosystream.decoding.config``);
- ``cache_specs()``: shape (without the batch dimension) and dtype of each per-session cache;
- ``init_caches(batch)``: zeroed caches in that order;
- ``step(pcm, caches) -> (logits, caches)``: ``pcm`` float ``[B, T * 160]`` in [-1, 1], ``logits [B, T, V]``.
  Pure: no host sync, no data-dependent shapes, so it can be captured in a CUDA graph;
- ``forward(pcm) -> logits [B, N // 160, V]``: the offline pass, which streaming ``step`` over any chunking
  reproduces from frame 0;
- optionally ``output_delay_frames``: how many frames the outputs lag the audio (a model with right
  context; absent: 0). The server sends that much silence after each utterance before its final result,
  so the last words come out, and moves word times back by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from cosystream.frames import FRAME_SAMPLES  # noqa: F401  (re-exported: the unit of every model step)


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """One per-session cache: its name, its shape without the batch dimension, and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@runtime_checkable
class StreamingModel(Protocol):
    vocabulary: list[str]

    def cache_specs(self) -> list[CacheSpec]: ...

    def init_caches(self, batch: int) -> list[torch.Tensor]: ...

    def step(self, pcm: torch.Tensor, caches: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]: ...

    def forward(self, pcm: torch.Tensor) -> torch.Tensor: ...


def output_delay_frames(model: torch.nn.Module) -> int:
    """The model's ``output_delay_frames`` (the contract's optional attribute), 0 where it has none."""
    return int(getattr(model, "output_delay_frames", 0))
