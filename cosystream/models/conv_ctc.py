"""The default architecture: log-mel features, residual causal convolutions, a CTC head over the vocabulary
(letters, or phonemes with a pronunciation lexicon: the shipped model hears phonemes).

Every layer is causal, so a stream can be stepped 10 ms at a time with explicit caches and reproduce the
offline pass exactly. ``step`` computes each dilated convolution as one matmul over the cached window
(faster than ``conv1d`` on small time extents); ``forward`` uses plain ``conv1d`` with left padding, an
independent path that the streaming tests compare against.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.frames import SAMPLE_RATE_HZ
from cosystream.model_files import ARCHITECTURE_NAMES
from cosystream.models.contract import FRAME_SAMPLES, CacheSpec
from cosystream.models.features import LogMel

HOP_SAMPLES = FRAME_SAMPLES


@dataclass(frozen=True, slots=True)
class _LayerPlan:
    taps: torch.Tensor  # [T * k]: per frame (oldest tap first), its source in cat([past, x], dim=1)
    newest: torch.Tensor  # [W]: the frames of x that are written to the ring


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """For one frame count T, which ring rows every layer reads and writes, as offsets from a
    session's position. Layers are padded to common widths by repeating an entry (a repeated read is
    harmless; a repeated write stores the same frame twice), so one tensor op serves all layers."""

    read_offsets: torch.Tensor  # [layers, R], negative
    write_offsets: torch.Tensor  # [layers, W]
    layers: tuple[_LayerPlan, ...]

    @staticmethod
    def build(shifts: list[list[int]], frames: int, device: torch.device) -> _StepPlan:
        reads, writes, layers = [], [], []
        for layer_shifts in shifts:
            size = layer_shifts[0]  # the oldest tap reaches back the whole ring
            past = sorted({j - s for s in layer_shifts for j in range(frames) if j - s < 0})
            slot_of = {offset: i for i, offset in enumerate(past)}
            taps = [
                slot_of[j - s] if j - s < 0 else len(past) + j - s for j in range(frames) for s in layer_shifts
            ]
            kept = list(range(frames - min(frames, size), frames))
            reads.append(past)
            writes.append(kept)
            layers.append((taps, kept, len(past)))
        width_r, width_w = max(map(len, reads)), max(map(len, writes))
        read_offsets = [r + [r[-1]] * (width_r - len(r)) for r in reads]
        write_offsets = [w + [w[-1]] * (width_w - len(w)) for w in writes]
        plans = []
        for (taps, kept, n_past), padded in zip(layers, read_offsets, strict=True):
            # Taps index cat([past (padded to width_r), x]): shift the x part past the padding.
            taps = [t if t < n_past else t - n_past + len(padded) for t in taps]
            kept = kept + [kept[-1]] * (width_w - len(kept))
            plans.append(_LayerPlan(torch.tensor(taps, device=device), torch.tensor(kept, device=device)))
        return _StepPlan(
            torch.tensor(read_offsets, device=device), torch.tensor(write_offsets, device=device), tuple(plans)
        )


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
    # The last ``lookahead_blocks`` residual blocks are centred: each sees ``(kernel_size - 1) // 2 *
    # dilation`` frames past the one it outputs, and delays the output by as much (``output_delay_frames``).
    lookahead_blocks: int = 0
    architecture: str = field(default="conv_ctc")
    name: str = ARCHITECTURE_NAMES["conv_ctc"]
    language: str = "en-US"

    def __post_init__(self) -> None:
        if len(self.vocabulary) < 2:
            raise ValueError("vocabulary needs a blank (index 0) and at least one symbol")
        if self.window_samples < HOP_SAMPLES:
            raise ValueError(f"window_samples must be >= the {HOP_SAMPLES}-sample hop")
        if self.kernel_size < 1 or any(d < 1 for d in self.dilations):
            raise ValueError("kernel_size and dilations must be >= 1")
        if not 0 <= self.lookahead_blocks <= len(self.dilations):
            raise ValueError("lookahead_blocks must be between 0 and the number of blocks")
        if self.lookahead_blocks and self.kernel_size % 2 == 0:
            raise ValueError("lookahead blocks need an odd kernel_size (a centre tap)")

    @property
    def receptive_field_frames(self) -> int:
        """Frames of past context that reach one output (input conv + blocks + the current frame)."""
        return 1 + (self.kernel_size - 1) * (1 + sum(self.dilations))

    @property
    def output_delay_frames(self) -> int:
        """Frames by which the lookahead blocks delay the output: its right context, a latency cost."""
        centred = self.dilations[len(self.dilations) - self.lookahead_blocks :]
        return (self.kernel_size - 1) // 2 * sum(centred)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConvCtcConfig:
        data = dict(data)
        data["vocabulary"] = tuple(data["vocabulary"])
        data["dilations"] = tuple(data["dilations"])
        return cls(**data)


def quantize_linear(linear: nn.Linear) -> nn.Module:
    """``linear`` dynamically quantized to int8 (``torch.ao.quantization.quantize_dynamic``). torch 2.13 warns
    that its quantized tensors are deprecated; the warning is for library authors, not for operators."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*", category=UserWarning)
        warnings.filterwarnings(
            "ignore", message="torch.ao.quantization is deprecated", category=DeprecationWarning
        )
        qconfig = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
        return torch.ao.quantization.quantize_dynamic(nn.Sequential(linear), qconfig, dtype=torch.qint8)[0]


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
        self.in_channels = in_channels
        # Stored as the streaming step's matmul operand, [k * C_in, C_out], tap-major like the window.
        self.weight = nn.Parameter(torch.empty(kernel_size * in_channels, out_channels))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        bound = 1.0 / (kernel_size * in_channels) ** 0.5
        nn.init.uniform_(self.weight, -bound, bound)
        # Set by ``quantize_int8``: the step's matmul as a dynamically quantized (int8) linear layer.
        self.quantized: nn.Module | None = None

    def quantize_int8(self) -> None:
        """Run the streaming step's matmul in int8 (weights quantized per output channel once, activations
        per step: ``torch.ao.quantization.quantize_dynamic``). The offline ``forward`` stays float32."""
        linear = nn.Linear(self.weight.shape[0], self.weight.shape[1])
        with torch.no_grad():
            linear.weight.copy_(self.weight.t())
            linear.bias.copy_(self.bias)
        self.quantized = quantize_linear(linear)

    def project(self, window: torch.Tensor) -> torch.Tensor:
        """The convolution as a matmul of its input windows ``[N, k * C_in] -> [N, C_out]``, in the weights'
        dtype (int8 layers: float32)."""
        if self.quantized is not None:
            return self.quantized(window)
        return torch.addmm(self.bias, window, self.weight)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Weights saved as [k, C_in, C_out] (before they were stored flat) load as [k * C_in, C_out].
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.dim() == 3:
            state_dict[prefix + "weight"] = weight.flatten(0, 1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def tap_shifts(self) -> list[int]:
        """How many frames back each tap reads, oldest first (the last tap is the current frame)."""
        return [(self.kernel_size - 1 - j) * self.dilation for j in range(self.kernel_size)]

    def step_rows(self, x: torch.Tensor, *where) -> torch.Tensor:
        """Step ``x [B * T, C_in]``: :meth:`window_rows` (same arguments), then the convolution's matmul.
        Returns ``[B * T, C_out]``."""
        return self.project(self.window_rows(x, *where)).to(x.dtype)

    def window_rows(
        self,
        x: torch.Tensor,
        batch: int,
        rings: torch.Tensor,
        read: torch.Tensor,
        write: torch.Tensor,
        plan: _LayerPlan,
    ) -> torch.Tensor:
        """The input windows of ``x [B * T, C_in]`` (frames of B rows, row-major) against ``rings [S, size,
        C_in]``: ``[B * T, k * C_in]``, taps oldest first.

        ``read [B * R]`` are the flat rows (of ``rings.view(-1, C_in)``) of the past frames the taps need,
        ``write [B * W]`` where the newest frames go. Reads happen before writes: a new frame overwrites
        the one ``size`` frames older, which may be one of its own taps.
        """
        channels = self.in_channels
        x = x.to(rings.dtype)  # (a reduced-precision model's rings and matmuls; the rest stays float32)
        flat = rings.view(-1, channels)
        past = flat.index_select(0, read)
        if x.shape[0] == batch and past.shape[0] == batch * (self.kernel_size - 1):  # one frame per row
            window = torch.cat([past.view(batch, -1), x], dim=1)
            flat.index_copy_(0, write, x)
        else:
            source = torch.cat([past.view(batch, -1, channels), x.view(batch, -1, channels)], dim=1)
            window = source.index_select(1, plan.taps).view(x.shape[0], -1)
            flat.index_copy_(0, write, x.view(batch, -1, channels).index_select(1, plan.newest).view(-1, channels))
        return window

    def forward(self, x: torch.Tensor, pad: bool = True) -> torch.Tensor:
        """``[B, T, C_in] -> [B, T, C_out]``, zeros before the start; ``pad=False``: ``x`` carries its own
        ``context`` frames of history and the output is ``context`` frames shorter."""
        padded = F.pad(x.transpose(1, 2).to(self.weight.dtype), (self.context if pad else 0, 0))
        weight = self.weight.view(self.kernel_size, self.in_channels, -1).permute(2, 1, 0)  # conv1d's layout
        return F.conv1d(padded, weight, self.bias, dilation=self.dilation).transpose(1, 2).to(x.dtype)


class ResidualBlock(nn.Module):
    """``x + relu(conv(layer_norm(x)))``: per-frame normalization keeps the block causal.

    A ``centred`` block outputs frame ``t - h`` (``h = context // 2``): ``x[t - h] + relu(conv(...)[t])``, its
    skip connection taken from the centre tap, so it sees ``h`` frames past the frame it outputs. Its ring
    then keeps raw frames, normalized as they are read (the skip needs them raw; zeros before the start).
    """

    def __init__(self, channels: int, kernel_size: int, dilation: int, centred: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.conv = CausalConv(channels, channels, kernel_size, dilation)
        self.centred = centred

    def step_rows(
        self,
        x: torch.Tensor,
        batch: int,
        rings: torch.Tensor,
        read: torch.Tensor,
        write: torch.Tensor,
        plan: _LayerPlan,
    ) -> torch.Tensor:
        if not self.centred:
            return x + torch.relu(self.conv.step_rows(self.norm(x), batch, rings, read, write, plan))
        conv = self.conv
        taps = conv.window_rows(x, batch, rings, read, write, plan).view(x.shape[0], conv.kernel_size, -1)
        taps = taps.to(x.dtype)  # (raw frames, kept in the ring at the weights' dtype)
        out = conv.project(self.norm(taps).flatten(1).to(rings.dtype)).to(x.dtype)
        return taps[:, conv.kernel_size // 2] + torch.relu(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.centred:
            return x + torch.relu(self.conv(self.norm(x)))
        context, frames = self.conv.context, x.shape[1]
        padded = F.pad(x, (0, 0, context, 0))
        if padded.dtype != self.conv.weight.dtype:  # (the ring keeps raw frames at the weights' dtype)
            padded = padded.to(self.conv.weight.dtype).to(x.dtype)
        return padded[:, context // 2 : context // 2 + frames] + torch.relu(
            self.conv(self.norm(padded), pad=False)
        )


class ConvCtcModel(nn.Module):
    """Streaming CTC recognizer over ``config.vocabulary`` (letters or phonemes); implements the streaming-model
    contract (see ``contract.py``)."""

    def __init__(self, config: ConvCtcConfig):
        super().__init__()
        self.config = config
        self.vocabulary: list[str] = list(config.vocabulary)
        self.tail_samples = config.window_samples - HOP_SAMPLES
        self.features = LogMel(
            config.window_samples, config.n_mels, SAMPLE_RATE_HZ, config.f_min_hz, config.f_max_hz
        )
        self.input_conv = CausalConv(config.n_mels, config.channels, config.kernel_size, 1)
        first_centred = len(config.dilations) - config.lookahead_blocks
        self.blocks = nn.ModuleList(
            ResidualBlock(config.channels, config.kernel_size, d, centred=i >= first_centred)
            for i, d in enumerate(config.dilations)
        )
        self.out_norm = nn.LayerNorm(config.channels)
        self.head = nn.Linear(config.channels, len(self.vocabulary))
        if config.kernel_size < 2:
            raise ValueError("kernel_size must be >= 2 (a kernel of 1 has no time context)")
        self.register_buffer("_ring_sizes", torch.tensor([c.context for c in self._convs()]), persistent=False)
        self._plans: dict[tuple[int, torch.device], _StepPlan] = {}

    @property
    def output_delay_frames(self) -> int:
        """Frames by which outputs lag the audio (the lookahead blocks' right context; see the contract)."""
        return self.config.output_delay_frames

    def _convs(self) -> list[CausalConv]:
        return [self.input_conv, *(block.conv for block in self.blocks)]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the matmuls' weights and operands, and of the convolutions' rings: float32, bfloat16 or
        float16 (int8 layers take float32). Everything else stays float32: the audio and its log-mel
        features, the layer norms and the residual sum; each matmul's input is cast to it, its output back."""
        return self.input_conv.weight.dtype

    def cache_specs(self) -> list[CacheSpec]:
        dtype = self.compute_dtype
        audio = self.features.dft_basis.dtype
        specs = [CacheSpec("position", (), torch.int64), CacheSpec("pcm_tail", (self.tail_samples,), audio)]
        specs.append(CacheSpec("input_conv", (self.input_conv.context, self.config.n_mels), dtype))
        specs += [
            CacheSpec(f"block{i}", (block.conv.context, self.config.channels), dtype)
            for i, block in enumerate(self.blocks)
        ]
        return specs

    def init_caches(self, batch: int) -> list[torch.Tensor]:
        device = self.input_conv.weight.device
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
        plan = self._plan(frames, pcm.device)
        # Flat ring rows of every layer at once, [layers, B * R] to read and [layers, B * W] to write.
        batch, layers = pcm.shape[0], len(plan.layers)
        sizes = self._ring_sizes[:, None, None]
        base = slots[None, :, None] * sizes
        read = ((position[None, :, None] + plan.read_offsets[:, None, :]) % sizes + base).view(layers, -1).unbind()
        write = (
            ((position[None, :, None] + plan.write_offsets[:, None, :]) % sizes + base).view(layers, -1).unbind()
        )
        # Frames travel as a flat [B * T, C] matrix: every layer is a 2-D matmul, with no reshaping between.
        x = self.features(windows.reshape(-1, windows.shape[-1]))
        x = torch.relu(self.input_conv.step_rows(x, batch, slab[2], read[0], write[0], plan.layers[0]))
        for layer, (block, rings) in enumerate(zip(self.blocks, slab[3:], strict=True), start=1):
            x = block.step_rows(x, batch, rings, read[layer], write[layer], plan.layers[layer])
        return self.head(self.out_norm(x).to(self.compute_dtype)).view(batch, frames, -1)

    def _plan(self, frames: int, device: torch.device) -> _StepPlan:
        """Index tables for a step of ``frames`` frames (built once per frame count and device)."""
        key = (frames, device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _StepPlan.build([c.tap_shifts() for c in self._convs()], frames, device)
        return plan

    def forward(self, pcm: torch.Tensor) -> torch.Tensor:
        """The offline pass: ``pcm [B, N] -> logits [B, N // 160, V]`` (a trailing partial frame is dropped)."""
        return self.encode(self.log_mel(pcm))

    def log_mel(self, pcm: torch.Tensor) -> torch.Tensor:
        """Offline features: ``pcm [B, N] -> [B, N // 160, n_mels]`` (training augments these)."""
        return self.features(self.windows(pcm))

    def windows(self, pcm: torch.Tensor) -> torch.Tensor:
        """The analysis windows of ``pcm [B, N]``: ``[B, N // 160, window_samples]``, frame ``t`` ending at
        sample ``160 * (t + 1)`` (zeros before the start), as the streaming step sees them."""
        frames = pcm.shape[1] // HOP_SAMPLES
        audio = F.pad(pcm[:, : frames * HOP_SAMPLES], (self.tail_samples, 0))
        return audio.unfold(1, self.config.window_samples, HOP_SAMPLES)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Offline network on features: ``[B, T, n_mels] -> logits [B, T, V]``."""
        x = torch.relu(self.input_conv(features))
        for block in self.blocks:
            x = block(x)
        return self.head(self.out_norm(x).to(self.compute_dtype))

    def flops_per_frame(self) -> int:
        """Multiply-adds x 2 of one 10 ms frame (matmuls only; they dominate)."""
        c = self.config
        feats = 2 * c.window_samples * self.features.dft_basis.shape[1]
        feats += 2 * self.features.n_used_bins * c.n_mels
        convs = sum(2 * conv.weight.numel() for conv in self._convs())
        return feats + convs + 2 * self.config.channels * len(self.vocabulary)
