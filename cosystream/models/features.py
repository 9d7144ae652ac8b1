"""Fixed-shape log-mel features, computed on the model's device.

A 25 ms Hann window every 10 ms, as a matmul of each window against a precomputed windowed DFT basis:
no host code, no data-dependent shapes, so the streaming step that uses it can be captured in a CUDA graph.
Frame ``t`` covers samples ``[160 * t - 240, 160 * t + 160)``: it ends at the newest sample, so the
features are causal and a stream needs only a 240-sample tail of past audio to compute the next frame.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def hz_to_mel(hz: float) -> float:
    return 2595.0 * math.log10(1.0 + hz / 700.0)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_edges_hz(n_mels: int, f_min_hz: float, f_max_hz: float) -> torch.Tensor:
    """The ``n_mels + 2`` corner frequencies of the triangular filters (float64): filter ``k`` rises from edge
    ``k``, peaks at ``k + 1`` (its centre) and falls to ``k + 2``."""
    return mel_to_hz(torch.linspace(hz_to_mel(f_min_hz), hz_to_mel(f_max_hz), n_mels + 2, dtype=torch.float64))


def mel_weights(freq_hz: torch.Tensor, n_mels: int, f_min_hz: float, f_max_hz: float) -> torch.Tensor:
    """Each triangular HTK-style mel filter's weight at ``freq_hz [...]`` (float64): ``[..., n_mels]``."""
    edges_hz = mel_edges_hz(n_mels, f_min_hz, f_max_hz)
    lower, centre, upper = edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]
    rising = (freq_hz[..., None] - lower) / (centre - lower)
    falling = (upper - freq_hz[..., None]) / (upper - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


def mel_filterbank(n_mels: int, n_fft: int, sample_rate_hz: int, f_min_hz: float, f_max_hz: float) -> torch.Tensor:
    """Triangular HTK-style mel filters, ``[n_fft // 2 + 1, n_mels]`` (float64)."""
    bin_hz = torch.arange(n_fft // 2 + 1, dtype=torch.float64) * sample_rate_hz / n_fft
    return mel_weights(bin_hz, n_mels, f_min_hz, f_max_hz)


def windowed_dft_basis(window_samples: int, n_fft: int) -> torch.Tensor:
    """``[window_samples, 2 * n_bins]``: Hann-windowed cosine then sine columns (float64)."""
    n = torch.arange(window_samples, dtype=torch.float64)
    hann = 0.5 - 0.5 * torch.cos(2.0 * math.pi * n / window_samples)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    phase = 2.0 * math.pi * n[:, None] * k[None, :] / n_fft
    return torch.cat([hann[:, None] * torch.cos(phase), hann[:, None] * -torch.sin(phase)], dim=1)


class LogMel(nn.Module):
    """``frames [..., window_samples] -> log-mel [..., n_mels]``, normalized with fixed per-bin statistics.

    The normalization (``shift``, ``scale``) is a fixed affine map set from training data, so it needs no
    future frames and streams exactly.
    """

    def __init__(self, window_samples: int, n_mels: int, sample_rate_hz: int, f_min_hz: float, f_max_hz: float):
        super().__init__()
        n_fft = window_samples
        basis = windowed_dft_basis(window_samples, n_fft)
        mel = mel_filterbank(n_mels, n_fft, sample_rate_hz, f_min_hz, f_max_hz)
        # Bins that no mel filter uses cost a matmul column each and contribute nothing: drop them.
        used = torch.nonzero(mel.sum(dim=1) > 0).flatten()
        n_bins = n_fft // 2 + 1
        basis = torch.cat([basis[:, used], basis[:, n_bins + used]], dim=1)
        self.n_used_bins = int(used.numel())
        self.used_bins = used  # DFT bin indices of the spectrum columns (CPU; training warps their frequencies)
        self.register_buffer("dft_basis", basis.float(), persistent=False)
        self.register_buffer("mel_basis", mel[used].float(), persistent=False)
        self.register_buffer("shift", torch.zeros(n_mels))
        self.register_buffer("scale", torch.ones(n_mels))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        # A 2-D matmul over contiguous rows: the strided windows of ``unfold`` make bmm slow.
        if frames.dim() != 2:
            return self.forward(frames.reshape(-1, frames.shape[-1])).unflatten(0, frames.shape[:-1])
        spectrum = frames @ self.dft_basis
        real, imag = spectrum.split(self.n_used_bins, dim=-1)
        power = real * real + imag * imag
        log_mel = torch.log(power @ self.mel_basis + 1e-6)
        return (log_mel - self.shift) * self.scale
