"""The default architecture: log-mel features, residual causal convolutions, a character CTC head.

Every layer is causal, so a stream can be stepped 10 ms at a time with explicit caches and reproduce the
offline pass exactly. ``step`` computes each dilated convolution as one matmul over the cached window
(faster than ``conv1d`` on small time extents); ``forward`` uses plain ``conv1d`` with left padding, an
independent path that the streaming tests compare against.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.models.contract import CacheSpec
from cosystream.models.features import LogMel

HOP_SAMPLES = 160
SAMPLE_RATE_HZ = 16000


@dataclass(frozen=True, slots=True)
class ConvCtcConfig:
    """Sizes of the default model. Stored as ``config.json`` beside the weights."""

    vocabulary: tuple[str, ...]
    n_mels: int = 80
    window_samples: int = 400
    f_min_hz: float = 20.0
    f_max_hz: float = 7600.0
    channels: int = 192
    kernel_size: int = 3
    dilations: tuple[int, ...] = (1, 2, 4, 8, 16, 1, 2, 4, 8)
    architecture: str = field(default="conv_ctc")
    name: str = "conv-ctc"
    language: str = "en-US"

    def __post_init__(self) -> None:
        if len(self.vocabulary) < 2:
            raise ValueError("vocabulary needs a blank (index 0) and at least one symbol")
        if self.window_samples < HOP_SAMPLES:
            raise ValueError(f"window_samples must be >= the {HOP_SAMPLES}-sample hop")
        if self.kernel_size < 1 or any(d < 1 for d in self.dilations):
            raise ValueError("kernel_size and dilations must be >= 1")

    @property
    def receptive_field_frames(self) -> int:
        """Frames of past context that reach one output (input conv + blocks + the current frame)."""
        return 1 + (self.kernel_size - 1) * (1 + sum(self.dilations))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConvCtcConfig:
        data = dict(data)
        data["vocabulary"] = tuple(data["vocabulary"])
        data["dilations"] = tuple(data["dilations"])
        return cls(**data)


class CausalConv(nn.Module):
    """A causal 1-D convolution over time-major features ``[B, T, C_in] -> [B, T, C_out]``.

    Its streaming cache is a ring of the last ``(kernel_size - 1) * dilation`` input frames
    (``[frames, C_in]``): frame ``f`` lives in row ``f % frames``, so a one-frame step reads ``k - 1`` rows
    and overwrites one, instead of shifting (copying) the whole window.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.context = (kernel_size - 1) * dilation
        # Stored as the matmul operand of ``step``: [k, C_in, C_out] (tap-major, like the window's taps).
        self.weight = nn.Parameter(torch.empty(kernel_size, in_channels, out_channels))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        bound = 1.0 / (kernel_size * in_channels) ** 0.5
        nn.init.uniform_(self.weight, -bound, bound)

    def _matmul(self, taps: torch.Tensor) -> torch.Tensor:
        """``taps [B, T, k * C_in]`` (oldest tap first) -> ``[B, T, C_out]``."""
        out = torch.addmm(self.bias, taps.flatten(0, 1), self.weight.flatten(0, 1))
        return out.unflatten(0, taps.shape[:2])

    def tap_shifts(self) -> list[int]:
        """How many frames back each tap reads, oldest first (the last tap is the current frame)."""
        return [(self.kernel_size - 1 - j) * self.dilation for j in range(self.kernel_size)]

    def step_one(self, x: torch.Tensor, rings: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One frame ``x [B, 1, C_in]``; ``rows [B, k]``: flat rows of ``rings`` for each tap (see below).

        ``rows[:, j]`` is the row of ``rings.view(-1, C_in)`` that holds tap ``j``'s frame; the last tap is
        the current frame, whose row is written. Precomputed for all layers at once by the model, since
        per-layer index arithmetic would cost more than the reads.
        """
        flat = rings.view(-1, rings.shape[-1])
        batch = x.shape[0]
        past = flat.index_select(0, rows[:, :-1].reshape(-1)).view(batch, -1)
        flat.index_copy_(0, rows[:, -1], x[:, 0])
        return self._matmul(torch.cat([past, x[:, 0]], dim=-1).unsqueeze(1))

    def step_slots(
        self, x: torch.Tensor, rings: torch.Tensor, slots: torch.Tensor, position: torch.Tensor
    ) -> torch.Tensor:
        """Step ``x [B, T, C_in]`` for the rows ``slots`` of ``rings [S, size, C_in]``, in place.

        ``position [B]`` is the index of each row's first new frame. Only the rows a step needs are read and
        only the newest frames are written.
        """
        frames = x.shape[1]
        size = self.context
        if size == 0:
            return self._matmul(x)
        # Several frames: read the ring in time order and convolve over [ring, x].
        offsets = torch.arange(size, device=x.device)
        window = torch.cat([rings[slots[:, None], (position[:, None] + offsets) % size], x], dim=1)
        taps = [window[:, j * self.dilation : j * self.dilation + frames] for j in range(self.kernel_size)]
        # Write back the newest min(T, size) frames; distinct rows, so the scatter is deterministic.
        kept = min(frames, size)
        newest = torch.arange(frames - kept, frames, device=x.device)
        rings[slots[:, None], (position[:, None] + newest) % size] = x[:, frames - kept :]
        return self._matmul(torch.cat(taps, dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded = F.pad(x.transpose(1, 2), (self.context, 0))
        weight = self.weight.permute(2, 1, 0)  # conv1d's [C_out, C_in, k]
        return F.conv1d(padded, weight, self.bias, dilation=self.dilation).transpose(1, 2)


class ResidualBlock(nn.Module):
    """``x + relu(conv(layer_norm(x)))``: per-frame normalization keeps the block causal."""

    def __init__(self, channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.conv = CausalConv(channels, channels, kernel_size, dilation)

    def step_slots(
        self, x: torch.Tensor, rings: torch.Tensor, slots: torch.Tensor, position: torch.Tensor
    ) -> torch.Tensor:
        return x + torch.relu(self.conv.step_slots(self.norm(x), rings, slots, position))

    def step_one(self, x: torch.Tensor, rings: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.conv.step_one(self.norm(x), rings, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.conv(self.norm(x)))


class ConvCtcModel(nn.Module):
    """Streaming character CTC recognizer; implements the streaming-model contract (see ``contract.py``)."""

    def __init__(self, config: ConvCtcConfig):
        super().__init__()
        self.config = config
        self.vocabulary: list[str] = list(config.vocabulary)
        self.tail_samples = config.window_samples - HOP_SAMPLES
        self.features = LogMel(
            config.window_samples, config.n_mels, SAMPLE_RATE_HZ, config.f_min_hz, config.f_max_hz
        )
        self.input_conv = CausalConv(config.n_mels, config.channels, config.kernel_size, 1)
        self.blocks = nn.ModuleList(
            ResidualBlock(config.channels, config.kernel_size, d) for d in config.dilations
        )
        self.out_norm = nn.LayerNorm(config.channels)
        self.head = nn.Linear(config.channels, len(self.vocabulary))
        if config.kernel_size < 2:
            raise ValueError("kernel_size must be >= 2 (a kernel of 1 has no time context)")
        convs = self._convs()
        self.register_buffer("_ring_sizes", torch.tensor([c.context for c in convs]), persistent=False)
        self.register_buffer("_tap_shifts", torch.tensor([c.tap_shifts() for c in convs]), persistent=False)

    def _convs(self) -> list[CausalConv]:
        return [self.input_conv, *(block.conv for block in self.blocks)]

    def cache_specs(self) -> list[CacheSpec]:
        dtype = self.head.weight.dtype
        specs = [CacheSpec("position", (), torch.int64), CacheSpec("pcm_tail", (self.tail_samples,), dtype)]
        specs.append(CacheSpec("input_conv", (self.input_conv.context, self.config.n_mels), dtype))
        specs += [
            CacheSpec(f"block{i}", (block.conv.context, self.config.channels), dtype)
            for i, block in enumerate(self.blocks)
        ]
        return specs

    def init_caches(self, batch: int) -> list[torch.Tensor]:
        device = self.head.weight.device
        return [torch.zeros((batch, *s.shape), dtype=s.dtype, device=device) for s in self.cache_specs()]

    def step(self, pcm: torch.Tensor, caches: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``pcm [B, T * 160]`` and caches in ``cache_specs()`` order -> ``(logits [B, T, V], caches)``.

        The caches are updated in place and returned.
        """
        slots = torch.arange(pcm.shape[0], device=pcm.device)
        return self.step_slots(pcm, caches, slots), caches

    def step_slots(self, pcm: torch.Tensor, slab: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """``step`` on rows ``slots`` of batched cache tensors ``slab`` (``[S, *spec.shape]`` each), in place.

        The state slab's "direct" access: a step reads only the cache rows it needs and writes only the new
        ones, instead of gathering and scattering every session's whole cache. Rows of ``slots`` must be
        distinct, except repeats of a scratch row whose contents do not matter (batch padding).
        """
        frames = pcm.shape[1] // HOP_SAMPLES
        positions, tails = slab[0], slab[1]
        position = positions[slots]
        audio = torch.cat([tails[slots], pcm], dim=1)
        tails[slots] = audio[:, frames * HOP_SAMPLES :]
        positions[slots] = position + frames
        windows = audio.unfold(1, self.config.window_samples, HOP_SAMPLES)
        features = self.features(windows)
        if frames == 1:
            # Flat ring rows of every tap of every layer at once: [layers, B, k].
            sizes = self._ring_sizes[:, None, None]
            rows = (position[None, :, None] - self._tap_shifts[:, None, :]) % sizes + slots[None, :, None] * sizes
            x = torch.relu(self.input_conv.step_one(features, slab[2], rows[0]))
            for layer, (block, rings) in enumerate(zip(self.blocks, slab[3:], strict=True), start=1):
                x = block.step_one(x, rings, rows[layer])
        else:
            x = torch.relu(self.input_conv.step_slots(features, slab[2], slots, position))
            for block, rings in zip(self.blocks, slab[3:], strict=True):
                x = block.step_slots(x, rings, slots, position)
        return self.head(self.out_norm(x))

    def forward(self, pcm: torch.Tensor) -> torch.Tensor:
        """The offline pass: ``pcm [B, N] -> logits [B, N // 160, V]`` (a trailing partial frame is dropped)."""
        return self.encode(self.log_mel(pcm))

    def log_mel(self, pcm: torch.Tensor) -> torch.Tensor:
        """Offline features: ``pcm [B, N] -> [B, N // 160, n_mels]`` (training augments these)."""
        frames = pcm.shape[1] // HOP_SAMPLES
        audio = F.pad(pcm[:, : frames * HOP_SAMPLES], (self.tail_samples, 0))
        return self.features(audio.unfold(1, self.config.window_samples, HOP_SAMPLES))

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Offline network on features: ``[B, T, n_mels] -> logits [B, T, V]``."""
        x = torch.relu(self.input_conv(features))
        for block in self.blocks:
            x = block(x)
        return self.head(self.out_norm(x))

    def flops_per_frame(self) -> int:
        """Multiply-adds x 2 of one 10 ms frame (matmuls only; they dominate)."""
        c = self.config
        feats = 2 * c.window_samples * self.features.dft_basis.shape[1]
        feats += 2 * self.features.n_used_bins * c.n_mels
        convs = sum(2 * conv.weight.numel() for conv in self._convs())
        return feats + convs + 2 * self.head.weight.numel()
