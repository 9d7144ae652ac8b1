"""PcmDecoder, G.711, Resampler and Framer: correctness and the no-buffering-delay property."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import soxr

from cosystream.audio.codecs import (
    ALAW_TO_INT16,
    MULAW_TO_INT16,
    AudioEncoding,
    PcmDecoder,
    encode_alaw,
    encode_mulaw,
)
from cosystream.audio.framing import Framer
from cosystream.audio.resample import Resampler
from cosystream.frames import FRAME_SAMPLES

RATES_HZ = [8000, 11025, 22050, 32000, 44100, 48000]


def _tones(rate_hz: int, seconds: float, freqs_hz: tuple[float, ...] = (1000.0,)) -> np.ndarray:
    t = np.arange(round(rate_hz * seconds)) / rate_hz
    x = sum(0.3 * np.sin(2 * np.pi * f * t + k) for k, f in enumerate(freqs_hz))
    return np.asarray(x, dtype=np.float32)


def _stream(resampler: Resampler, x: np.ndarray, rate_hz: int) -> tuple[np.ndarray, list[int]]:
    """Feed x in 10 ms chunks (boundaries rounded to whole samples); return output and per-chunk sizes."""
    bounds = [round(k * rate_hz / 100) for k in range(len(x) * 100 // rate_hz + 1)]
    outs = [resampler.process(x[a:b]) for a, b in itertools.pairwise(bounds)]
    sizes = [len(y) for y in outs]
    outs.append(resampler.process(x[bounds[-1] :]))
    outs.append(resampler.flush())
    return np.concatenate(outs), sizes


def _peak_hz(y: np.ndarray, rate_hz: int) -> float:
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return float(np.fft.rfftfreq(len(y), 1 / rate_hz)[spectrum.argmax()])


# --- G.711 -----------------------------------------------------------------------------


def test_g711_tables_match_known_values() -> None:
    assert MULAW_TO_INT16[0xFF] == 0
    assert MULAW_TO_INT16[0x00] == -32124
    assert MULAW_TO_INT16[0x80] == 32124
    assert MULAW_TO_INT16[0x7F] == 0
    assert ALAW_TO_INT16[0xD5] == 8
    assert ALAW_TO_INT16[0x55] == -8
    assert ALAW_TO_INT16[0xAA] == 32256
    assert ALAW_TO_INT16[0x2A] == -32256
    # Both laws are odd-symmetric: flipping the sign bit negates the level.
    assert np.array_equal(MULAW_TO_INT16[:128], -MULAW_TO_INT16[128:])
    assert np.array_equal(ALAW_TO_INT16[:128], -ALAW_TO_INT16[128:])


@pytest.mark.parametrize(
    ("encoding", "encode", "table"),
    [(AudioEncoding.MULAW, encode_mulaw, MULAW_TO_INT16), (AudioEncoding.ALAW, encode_alaw, ALAW_TO_INT16)],
)
def test_g711_round_trip(encoding, encode, table) -> None:
    # Every code's own level survives encode -> decode exactly.
    levels = (table / 32768.0).astype(np.float32)
    assert np.array_equal(PcmDecoder(encoding).decode(encode(levels)), levels)
    # Samples within the top level come back within half of the largest step (1024/32768).
    top = table.max() / 32768.0
    x = np.random.default_rng(0).uniform(-top, top, 20000).astype(np.float32)
    y = PcmDecoder(encoding).decode(encode(x))
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.abs(y - x).max() <= 512 / 32768 + 1e-6
    # Beyond it they clip to the top level.
    assert PcmDecoder(encoding).decode(encode(np.array([1.0, -1.0, 5.0], np.float32))).tolist() == [top, -top, top]
    # A speech-level sine keeps G.711's ~38 dB SNR.
    s = _tones(8000, 0.5, (440.0,))
    err = PcmDecoder(encoding).decode(encode(s)) - s
    assert 10 * np.log10(np.mean(s**2) / np.mean(err**2)) > 30


# --- LINEAR16 --------------------------------------------------------------------------


def test_linear16_sample_split_across_chunks() -> None:
    pcm = np.array([0, 1, -1, 32767, -32768, 12345, -12345], dtype="<i2")
    data = pcm.tobytes()
    dec = PcmDecoder(AudioEncoding.LINEAR16)
    parts = [dec.decode(data[:3]), dec.decode(data[3:4]), dec.decode(data[4:4]), dec.decode(data[4:])]
    assert [len(p) for p in parts] == [1, 1, 0, 5]
    assert dec.pending_bytes == 0
    out = np.concatenate(parts)
    assert out.dtype == np.float32
    assert np.array_equal(out, pcm / np.float32(32768.0))
    assert out.max() < 1.0 and out.min() == -1.0


def test_linear16_random_chunking_matches_whole() -> None:
    rng = np.random.default_rng(1)
    data = rng.integers(-32768, 32768, 5000).astype("<i2").tobytes()
    dec = PcmDecoder(AudioEncoding.LINEAR16)
    cuts = np.sort(rng.choice(len(data), 60, replace=False))
    parts = [dec.decode(memoryview(data)[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert np.array_equal(np.concatenate(parts), PcmDecoder(1).decode(data))
    dec.decode(b"\x01")
    assert dec.pending_bytes == 1


def test_unspecified_encoding_is_rejected() -> None:
    with pytest.raises(ValueError, match="UNSPECIFIED"):
        PcmDecoder(AudioEncoding.UNSPECIFIED)
    with pytest.raises(ValueError):
        PcmDecoder(7)


# --- Resampler -------------------------------------------------------------------------


def test_resampler_identity_at_16k_does_not_copy() -> None:
    x = _tones(16000, 0.1)
    r = Resampler(16000)
    assert r.process(x) is x
    assert len(r.flush()) == 0


@pytest.mark.parametrize("rate_hz", [7999, 48001, 96000])
def test_resampler_rejects_unsupported_rates(rate_hz: int) -> None:
    with pytest.raises(ValueError, match="between 8000 and 48000"):
        Resampler(rate_hz)


@pytest.mark.parametrize("rate_hz", RATES_HZ)
def test_resampler_length_and_frequency(rate_hz: int) -> None:
    x = _tones(rate_hz, 1.0)
    y, _ = _stream(Resampler(rate_hz), x, rate_hz)
    assert y.dtype == np.float32
    assert abs(len(y) - len(x) * 16000 / rate_hz) <= 1
    assert abs(_peak_hz(y, 16000) - 1000.0) <= 2.0


@pytest.mark.parametrize("rate_hz", RATES_HZ)
def test_resampler_is_time_aligned_and_chunking_invariant(rate_hz: int) -> None:
    """Streamed output matches an offline high-quality resample with zero lag, however it is chunked.

    Tones stay below 2 kHz: above that, soxr 'QQ' (cubic) droops when upsampling from 8 kHz
    (-0.5 dB at 2 kHz, -1.9 dB at 3 kHz, -2.5 dB at 3.4 kHz), see test_resampler_passband.
    """
    x = _tones(rate_hz, 1.0, (300.0, 1200.0, 1900.0))
    y, _ = _stream(Resampler(rate_hz), x, rate_hz)
    ref = soxr.resample(x, rate_hz, 16000, quality="VHQ")
    inner = slice(500, min(len(y), len(ref)) - 500)
    assert np.abs(y[inner] - ref[inner]).max() < 0.03  # small interpolation error, no shift

    rng = np.random.default_rng(rate_hz)
    r = Resampler(rate_hz)
    parts, pos = [], 0
    while pos < len(x):
        step = int(rng.integers(1, 3000))
        parts.append(r.process(x[pos : pos + step]))
        pos += step
    parts.append(r.flush())
    assert np.array_equal(np.concatenate(parts), y)


@pytest.mark.parametrize("rate_hz", RATES_HZ)
def test_resampler_adds_no_buffering_delay(rate_hz: int) -> None:
    """soxr 'HQ' would hold back ~40-115 ms and release bursts; this chain must not.

    Measured: 8 kHz lags 33 output samples (2.1 ms), 11.025 kHz 25 (1.5 ms), 22.05 kHz 16,
    32/44.1/48 kHz 15 (0.9 ms): the compensated group delay of the anti-alias filter.
    """
    x = _tones(rate_hz, 1.0, (440.0,))
    r = Resampler(rate_hz)
    bounds = [round(k * rate_hz / 100) for k in range(101)]
    fed = produced = 0
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        got = len(r.process(x[a:b]))
        fed += b - a
        produced += got
        if k >= 2:
            expected = (b - a) * 16000 / rate_hz
            assert abs(got - expected) <= 2, f"chunk {k}: {got} samples, expected ~{expected}"
            lag_samples = fed * 16000 / rate_hz - produced
            assert lag_samples < 48, f"output lags input by {lag_samples / 16:.1f} ms"


@pytest.mark.parametrize(
    ("rate_hz", "tone_hz", "max_loss_db"),
    [(8000, 3000, 2.5), (8000, 3400, 4.0), (11025, 4500, 4.0), (22050, 7000, 2.0)],
)
def test_resampler_passband(rate_hz: int, tone_hz: float, max_loss_db: float) -> None:
    """Pins the known droop near the input band edge (cubic interpolation plus the filter)."""
    x = _tones(rate_hz, 0.5, (tone_hz,))
    y, _ = _stream(Resampler(rate_hz), x, rate_hz)
    loss_db = -10 * np.log10(np.mean(y[400:-400] ** 2) / np.mean(x**2))
    assert loss_db < max_loss_db


@pytest.mark.parametrize(("rate_hz", "tone_hz"), [(48000, 12000), (44100, 9500), (32000, 15000), (22050, 9000)])
def test_resampler_suppresses_aliasing(rate_hz: int, tone_hz: float) -> None:
    """Bare soxr 'QQ' folds these tones into the band at full level; the pre-filter must not."""
    x = _tones(rate_hz, 0.5, (tone_hz,))
    y, _ = _stream(Resampler(rate_hz), x, rate_hz)
    ratio_db = 10 * np.log10(np.mean(y[400:-400] ** 2) / np.mean(x**2))
    assert ratio_db < -40


def test_resampler_suppresses_imaging_from_8k() -> None:
    x = _tones(8000, 0.5, (3000.0,))
    y, _ = _stream(Resampler(8000), x, 8000)
    spectrum = np.abs(np.fft.rfft(y[400:-400] * np.hanning(len(y) - 800)))
    freqs = np.fft.rfftfreq(len(y) - 800, 1 / 16000)
    image = spectrum[np.abs(freqs - 5000) < 100].max()
    assert 20 * np.log10(image / spectrum.max()) < -40


def test_resampler_flush_resets_for_reuse() -> None:
    x = _tones(22050, 0.3)
    r = Resampler(22050)
    first, _ = _stream(r, x, 22050)
    second, _ = _stream(r, x, 22050)
    assert np.array_equal(first, second)


# --- Framer ----------------------------------------------------------------------------


def test_framer_cuts_exact_frames_from_any_chunking() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal(160 * 37 + 55).astype(np.float32)
    framer = Framer()
    buf = framer._buf
    frames, pos = [], 0
    while pos < len(x):
        step = int(rng.integers(0, 700))
        chunk = x[pos : pos + step].copy()
        out = framer.push(chunk)
        assert out.shape[1:] == (FRAME_SAMPLES,) and out.dtype == np.float32
        chunk[:] = 0  # the caller may reuse its buffer: returned frames must not alias it
        frames.append(out)
        pos += step
    got = np.concatenate(frames)
    assert got.shape == (37, FRAME_SAMPLES)
    assert np.array_equal(got.reshape(-1), x[: 37 * 160])
    assert framer.pending_samples == 55
    assert framer._buf is buf  # never reallocated

    tail = framer.flush_padded()
    assert tail.shape == (1, FRAME_SAMPLES)
    assert np.array_equal(tail[0, :55], x[-55:]) and not tail[0, 55:].any()
    assert framer.pending_samples == 0
    assert framer.flush_padded().shape == (0, FRAME_SAMPLES)


def test_framer_exact_multiple_leaves_nothing_pending() -> None:
    framer = Framer()
    assert framer.push(np.ones(320, dtype=np.float32)).shape == (2, FRAME_SAMPLES)
    assert framer.pending_samples == 0
    assert framer.push(np.ones(159, dtype=np.float32)).shape == (0, FRAME_SAMPLES)
    assert framer.push(np.ones(1, dtype=np.float32)).shape == (1, FRAME_SAMPLES)


def test_framer_hands_back_views_of_owned_samples_only_when_nothing_is_pending() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(160 * 9 + 40).astype(np.float32)
    framer = Framer()
    owned = x[: 160 * 3 + 40].copy()
    frames = framer.push(owned, owned=True)
    assert np.shares_memory(frames, owned) and frames.shape == (3, FRAME_SAMPLES)  # no copy
    later = x[160 * 3 + 40 :].copy()
    rest = framer.push(later, owned=True)  # 40 samples pending: the first frame spans two chunks, so copied
    assert not np.shares_memory(rest, later)
    got = np.concatenate([frames, rest])
    assert np.array_equal(got.reshape(-1), x[: len(got) * 160])
    assert framer.pending_samples == len(x) - len(got) * 160
    assert not np.shares_memory(framer.push(np.ones(160, np.float32)), framer._buf)
