"""On-the-fly augmentation: every draw of a training utterance is a new version of it.

Waveform (numpy, 16 kHz float32): speed +-15 % (resampling, so pitch moves with it), simple synthetic
reverb, leading/trailing silence, additive coloured noise at 5-30 dB SNR, 8 kHz telephone band with mu-law or
A-law round trips, gain. Features: vocal tract length perturbation (VTLP: the mel filters read a
frequency-warped spectrum, so formants move without pitch or tempo), channel colouring (a random smooth
equalizer curve, as microphones, rooms and codecs impose: spectral tilt, resonances, low and high cuts, added
to the log-mel features, where a filter's gain is an offset) and SpecAugment-style frequency and time masks.
"""

from __future__ import annotations

import numpy as np
import soxr
import torch

from cosystream.models.features import mel_edges_hz, mel_weights

SAMPLE_RATE = 16000


def mu_law_round_trip(x: np.ndarray, mu: float = 255.0) -> np.ndarray:
    """8-bit mu-law (G.711) encode + decode."""
    x = np.clip(x, -1.0, 1.0)
    y = np.sign(x) * np.log1p(mu * np.abs(x)) / np.log1p(mu)
    q = np.round((y + 1.0) * 127.5) / 127.5 - 1.0
    return (np.sign(q) * ((1.0 + mu) ** np.abs(q) - 1.0) / mu).astype(np.float32)


def a_law_round_trip(x: np.ndarray, a: float = 87.6) -> np.ndarray:
    """8-bit A-law (G.711) encode + decode."""
    x = np.clip(x, -1.0, 1.0)
    ax = np.abs(x)
    ln_a = 1.0 + np.log(a)
    y = np.where(ax < 1.0 / a, a * ax / ln_a, (1.0 + np.log(np.maximum(a * ax, 1e-12))) / ln_a)
    y = np.sign(x) * y
    q = np.round((y + 1.0) * 127.5) / 127.5 - 1.0
    aq = np.abs(q)
    out = np.where(aq < 1.0 / ln_a, aq * ln_a / a, np.exp(aq * ln_a - 1.0) / a)
    return (np.sign(q) * out).astype(np.float32)


def telephone(x: np.ndarray, codec: str = "mulaw", rng: np.random.Generator | None = None) -> np.ndarray:
    """16 kHz -> 8 kHz (telephone band) -> codec round trip -> back to 16 kHz."""
    narrow = soxr.resample(x, SAMPLE_RATE, 8000).astype(np.float32)
    if rng is not None:
        # Crude 300 Hz high-pass of a phone line: subtract a one-pole low-passed copy.
        alpha = float(rng.uniform(0.75, 0.85))
        low = _one_pole(narrow, alpha)
        narrow = narrow - low * float(rng.uniform(0.5, 1.0))
    peak = float(np.abs(narrow).max()) + 1e-6
    if peak > 1.0:
        narrow = narrow / peak
    if codec == "mulaw":
        narrow = mu_law_round_trip(narrow)
    elif codec == "alaw":
        narrow = a_law_round_trip(narrow)
    return soxr.resample(narrow, 8000, SAMPLE_RATE).astype(np.float32)[: x.size]


def _one_pole(x: np.ndarray, alpha: float) -> np.ndarray:
    """y[n] = alpha * y[n-1] + (1 - alpha) * x[n], via FFT-free cumulative trick on short blocks."""
    # Exact IIR via scipy would be nicer; an FIR truncation of the impulse response is close enough.
    taps = (1 - alpha) * alpha ** np.arange(48, dtype=np.float32)
    return np.convolve(x, taps)[: x.size].astype(np.float32)


def coloured_noise(n: int, rng: np.random.Generator) -> np.ndarray:
    """White, pink, brown or band-limited hum-like noise, unit RMS."""
    kind = rng.integers(0, 4)
    if kind == 0:
        noise = rng.standard_normal(n).astype(np.float32)
    else:
        nfft = 1 << max(1, (n - 1).bit_length())  # a power of two: odd lengths make the FFT slow
        spec = np.fft.rfft(rng.standard_normal(nfft).astype(np.float32))
        freqs = np.fft.rfftfreq(nfft, 1.0 / SAMPLE_RATE)
        freqs[0] = freqs[1] if n > 1 else 1.0
        if kind == 1:
            spec = spec / np.sqrt(freqs)
        elif kind == 2:
            spec = spec / freqs
        else:
            centre = rng.uniform(200, 3000)
            spec = spec * np.exp(-0.5 * ((freqs - centre) / rng.uniform(100, 800)) ** 2)
        noise = np.fft.irfft(spec, nfft)[:n].astype(np.float32)
    return noise / (np.sqrt(np.mean(noise**2)) + 1e-8)


def reverb(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Convolve with an exponentially decaying noise impulse response (RT60 0.1-0.7 s)."""
    rt60 = rng.uniform(0.1, 0.7)
    length = int(rt60 * SAMPLE_RATE)
    t = np.arange(length, dtype=np.float32) / SAMPLE_RATE
    ir = rng.standard_normal(length).astype(np.float32) * np.exp(-6.9 * t / rt60)
    ir[0] = 0.0
    ir *= rng.uniform(0.2, 0.8) / (np.sqrt(np.sum(ir**2)) + 1e-8)
    ir[0] = 1.0
    size = x.size + length - 1
    nfft = 1 << (size - 1).bit_length()
    wet = np.fft.irfft(np.fft.rfft(x, nfft) * np.fft.rfft(ir, nfft), nfft)[: x.size]
    return wet.astype(np.float32)


def augment(x: np.ndarray, rng: np.random.Generator, strength: float = 1.0) -> np.ndarray:
    """One random version of ``x`` (float32, 16 kHz)."""
    if rng.random() < 0.9 * strength:
        speed = rng.uniform(0.85, 1.15)
        x = soxr.resample(x, SAMPLE_RATE, round(SAMPLE_RATE / speed)).astype(np.float32)
    if rng.random() < 0.3 * strength:
        x = reverb(x, rng)
    lead = int(rng.uniform(0.0, 0.5) * SAMPLE_RATE) if rng.random() < 0.7 else 0
    trail = int(rng.uniform(0.0, 0.5) * SAMPLE_RATE) if rng.random() < 0.7 else 0
    x = np.concatenate([np.zeros(lead, np.float32), x, np.zeros(trail, np.float32)])
    x = x / (np.abs(x).max() + 1e-6)
    if rng.random() < 0.75 * strength:
        snr_db = rng.uniform(5.0, 30.0)
        speech_rms = np.sqrt(np.mean(x**2)) + 1e-8
        x = x + coloured_noise(x.size, rng) * speech_rms * 10 ** (-snr_db / 20)
    else:
        x = x + rng.standard_normal(x.size).astype(np.float32) * 10 ** rng.uniform(-5, -3)
    x = x / (np.abs(x).max() + 1e-6)
    if rng.random() < 0.3 * strength:
        x = telephone(x * 0.9, "mulaw" if rng.random() < 0.6 else "alaw", rng)
    gain = 10 ** (rng.uniform(-30.0, -1.0) / 20)
    return (x * gain).astype(np.float32)


def spec_masks(
    frames: list[int], bins: int, rng: np.random.Generator, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """SpecAugment-style masks for a batch: ``(time [B, T], freq [B, bins])``, True where masked.

    Per utterance two frequency masks of up to 12 bins, and about one time mask per second (up to 25
    frames) inside its ``frames`` valid frames. Drawn on the CPU (in data-loading workers) and applied on
    the training device with one multiply (``apply_masks``)."""
    width = max(frames) if width is None else width
    time = np.zeros((len(frames), width), bool)
    freq = np.zeros((len(frames), bins), bool)
    for b, length in enumerate(frames):
        for _ in range(2):
            w = int(rng.integers(0, 13))
            start = int(rng.integers(0, max(1, bins - w)))
            freq[b, start : start + w] = True
        for _ in range(length // 100):
            w = int(rng.integers(0, 26))
            start = int(rng.integers(0, max(1, length - w)))
            time[b, start : start + w] = True
    return time, freq


def apply_masks(features: torch.Tensor, time: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Zero (the normalized mean) the masked frames and bins of ``features [B, T, bins]``."""
    keep = (~time[:, : features.shape[1], None]) & (~freq[:, None, :])
    return features * keep.to(features.dtype)


def warp_factors(n: int, rng: np.random.Generator, max_warp: float, p: float = 0.8) -> np.ndarray:
    """VTLP factors for ``n`` utterances: uniform in ``1 +- max_warp`` with probability ``p``, else 1."""
    alphas = rng.uniform(1.0 - max_warp, 1.0 + max_warp, n)
    return np.where(rng.random(n) < p, alphas, 1.0).astype(np.float32)


def mel_centres_hz(n_mels: int, f_min_hz: float, f_max_hz: float) -> np.ndarray:
    """The centre frequencies of the model's ``n_mels`` mel filters."""
    return mel_edges_hz(n_mels, f_min_hz, f_max_hz)[1:-1].numpy()


def channel_gains_db(n: int, centres_hz: np.ndarray, rng: np.random.Generator, p: float = 0.8) -> np.ndarray:
    """Random channel colourings for ``n`` utterances, as gains in dB at ``centres_hz``: ``[n, bins]`` float32.

    With probability ``p`` an utterance gets a tilt of -5..+5 dB per octave around 1 kHz (flat beyond three
    octaves), zero to three resonances or notches of -9..+9 dB (Gaussian in log frequency, 0.25-1 octave
    wide, centred 150-6500 Hz), and with probability 0.3 each a low cut (80-400 Hz) and a high cut
    (3-7 kHz) of 12 dB per octave; at most 20 dB either way. Otherwise it stays flat (zeros)."""
    octaves = np.log2(np.maximum(centres_hz, 1.0) / 1000.0)
    gains = np.zeros((n, centres_hz.size), np.float32)
    for row in range(n):
        if rng.random() >= p:
            continue
        db = rng.uniform(-5.0, 5.0) * np.clip(octaves, -3.0, 3.0)
        for _ in range(rng.integers(0, 4)):
            centre = rng.uniform(np.log2(150 / 1000), np.log2(6500 / 1000))
            db = db + rng.uniform(-9.0, 9.0) * np.exp(-0.5 * ((octaves - centre) / rng.uniform(0.25, 1.0)) ** 2)
        if rng.random() < 0.3:
            db = db - 12.0 * np.maximum(0.0, np.log2(rng.uniform(80, 400) / 1000.0) - octaves)
        if rng.random() < 0.3:
            db = db - 12.0 * np.maximum(0.0, octaves - np.log2(rng.uniform(3000, 7000) / 1000.0))
        gains[row] = np.clip(db, -20.0, 20.0)
    return gains


def colour_features(features: torch.Tensor, gains_db: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Normalized log-mel ``features [B, T, bins]`` of audio heard through filters of ``gains_db [B, bins]``.

    The log-mel front end takes the natural log of filter power, so a power gain of ``g`` dB adds
    ``g * ln(10) / 10`` to a bin before normalization, ``scale`` times that after it."""
    return features + (gains_db * (np.log(10.0) / 10.0) * scale)[:, None, :]


def warped_mel_bases(
    alphas: torch.Tensor,
    bin_hz: torch.Tensor,
    n_mels: int,
    f_min_hz: float,
    f_max_hz: float,
    f_hi_hz: float = 6800.0,
    nyquist_hz: float = SAMPLE_RATE / 2,
) -> torch.Tensor:
    """Mel filterbanks ``[B, bins, n_mels]`` over the spectrum bins at ``bin_hz [bins]``, warped by ``alphas
    [B]`` (VTLP), computed on the host (the warps come from the data loader there: no device sync).

    Filter ``k`` of utterance ``b`` weighs bin frequency ``g`` by the unwarped filter's weight at
    ``warp(g)``, with ``warp(g) = alpha * g`` up to ``f_hi * min(alpha, 1) / alpha`` and then linear to the
    Nyquist frequency, which stays put: a formant at ``f`` reads as one at ``alpha * f``. ``alpha = 1``
    gives the model's own filterbank."""
    g = bin_hz.detach().double().cpu()[None, :]
    a = alphas.detach().double().cpu()[:, None]
    knee = f_hi_hz * torch.clamp(a, max=1.0) / a
    above = a * knee + (nyquist_hz - a * knee) * (g - knee) / (nyquist_hz - knee)
    warped = torch.where(g <= knee, a * g, above)
    return mel_weights(warped, n_mels, f_min_hz, f_max_hz).float()


def warped_log_mel(model, pcm: torch.Tensor, alphas: torch.Tensor) -> torch.Tensor:
    """``model.log_mel(pcm)`` with utterance ``b``'s spectrum warped by ``alphas[b]`` before the mel filters.

    Pass ``alphas`` as the host tensor the loader made: the filterbanks are built there and copied to the
    device without waiting for it (a device tensor would cost a device-to-host sync per step)."""
    c, features = model.config, model.features
    spectrum = model.windows(pcm) @ features.dft_basis
    real, imag = spectrum.split(features.n_used_bins, dim=-1)
    power = real * real + imag * imag
    bin_hz = features.used_bins * (SAMPLE_RATE / c.window_samples)
    bases = warped_mel_bases(alphas, bin_hz, c.n_mels, c.f_min_hz, c.f_max_hz)
    if pcm.device.type == "cuda":
        bases = bases.pin_memory().to(pcm.device, non_blocking=True)
    else:
        bases = bases.to(pcm.device)
    log_mel = torch.log(torch.bmm(power, bases) + 1e-6)
    return (log_mel - features.shift) * features.scale
