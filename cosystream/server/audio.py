"""Client audio to model frames: decode, resample to 16 kHz, cut exact 10 ms frames.

Clients send chunks of any size and any of the wire encodings; everything after this module
sees float32 mono at :data:`SAMPLE_RATE_HZ` in frames of :data:`FRAME_SAMPLES`. Each class
holds the streaming state of one session (a split sample, filter history, a partial frame),
so one instance per stream, fed in order.
"""

from __future__ import annotations

import logging
import math
from enum import IntEnum

import numpy as np
import soxr

from cosystream.frames import FRAME_SAMPLES, SAMPLE_RATE_HZ

logger = logging.getLogger(__name__)

MIN_INPUT_RATE_HZ = 8000
MAX_INPUT_RATE_HZ = 48000

_INT16_SCALE = 1.0 / 32768.0


class AudioEncoding(IntEnum):
    """Sample encoding of client audio; the numbers match the wire proto's enum."""

    UNSPECIFIED = 0
    LINEAR16 = 1
    MULAW = 2
    ALAW = 3


def _mulaw_expand(code: np.ndarray) -> np.ndarray:
    """ITU-T G.711 mu-law expansion of byte codes to 16-bit linear values (int32)."""
    u = ~code.astype(np.int32) & 0xFF
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(u & 0x80, -magnitude, magnitude)


def _alaw_expand(code: np.ndarray) -> np.ndarray:
    """ITU-T G.711 A-law expansion of byte codes to 16-bit linear values (int32)."""
    a = code.astype(np.int32) ^ 0x55
    exponent = (a >> 4) & 0x07
    mantissa = a & 0x0F
    magnitude = np.where(
        exponent == 0,
        (mantissa << 4) + 8,
        ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0),
    )
    return np.where(a & 0x80, magnitude, -magnitude)


_CODES = np.arange(256, dtype=np.uint8)
MULAW_TO_INT16 = _mulaw_expand(_CODES).astype(np.int16)
ALAW_TO_INT16 = _alaw_expand(_CODES).astype(np.int16)
_MULAW_TO_F32 = (MULAW_TO_INT16 * _INT16_SCALE).astype(np.float32)
_ALAW_TO_F32 = (ALAW_TO_INT16 * _INT16_SCALE).astype(np.float32)


def _nearest_code_encoder(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(decision thresholds, codes) so searchsorted picks the code whose level is nearest."""
    order = np.argsort(table, kind="stable")
    levels = table[order]
    thresholds = (levels[:-1] + levels[1:]) * 0.5
    return thresholds.astype(np.float32), order.astype(np.uint8)


_MULAW_ENC = _nearest_code_encoder(_MULAW_TO_F32)
_ALAW_ENC = _nearest_code_encoder(_ALAW_TO_F32)


def _encode(x: np.ndarray, enc: tuple[np.ndarray, np.ndarray]) -> bytes:
    thresholds, codes = enc
    return codes[np.searchsorted(thresholds, np.asarray(x, dtype=np.float32))].tobytes()


def encode_mulaw(x: np.ndarray) -> bytes:
    """Encode float32 samples in [-1, 1] as G.711 mu-law bytes (nearest level, so the
    round trip error is at most half a quantisation step). For tests and clients."""
    return _encode(x, _MULAW_ENC)


def encode_alaw(x: np.ndarray) -> bytes:
    """Encode float32 samples in [-1, 1] as G.711 A-law bytes (nearest level)."""
    return _encode(x, _ALAW_ENC)


class Decoder:
    """Turns wire bytes into float32 mono samples in [-1, 1].

    LINEAR16 is little-endian int16; chunk boundaries need not fall on sample boundaries
    (an odd trailing byte is carried into the next call). G.711 is one byte per sample,
    expanded through a 256-entry table.
    """

    __slots__ = ("_carry", "_table", "encoding")

    def __init__(self, encoding: AudioEncoding | int) -> None:
        self.encoding = AudioEncoding(encoding)
        if self.encoding == AudioEncoding.UNSPECIFIED:
            raise ValueError("audio encoding is UNSPECIFIED: set it to LINEAR16, MULAW or ALAW")
        self._table = {AudioEncoding.MULAW: _MULAW_TO_F32, AudioEncoding.ALAW: _ALAW_TO_F32}.get(self.encoding)
        self._carry = b""

    @property
    def pending_bytes(self) -> int:
        """Bytes held back because they do not yet form a whole sample (0 or 1)."""
        return len(self._carry)

    def decode(self, chunk: bytes | bytearray | memoryview) -> np.ndarray:
        """Decode one chunk; returns a new float32 array (possibly empty)."""
        if self._table is not None:
            return self._table[np.frombuffer(chunk, dtype=np.uint8)]
        if self._carry:
            chunk = self._carry + bytes(chunk)
        whole = len(chunk) & ~1
        self._carry = bytes(chunk[whole:])
        samples = np.frombuffer(chunk, dtype="<i2", count=whole // 2).astype(np.float32)
        samples *= _INT16_SCALE
        return samples


def _lowpass_taps(fs_hz: float, cutoff_hz: float, transition_hz: float, atten_db: float = 60.0) -> np.ndarray:
    """Kaiser-windowed-sinc linear-phase low-pass; odd length so its delay is whole samples."""
    beta = 0.1102 * (atten_db - 8.7)
    n = math.ceil((atten_db - 8.0) / (2.285 * 2.0 * math.pi * transition_hz / fs_hz)) + 1
    n += 1 - n % 2
    m = np.arange(n) - (n - 1) / 2
    fc = cutoff_hz / fs_hz
    taps = 2.0 * fc * np.sinc(2.0 * fc * m) * np.kaiser(n, beta)
    return (taps / taps.sum()).astype(np.float32)


class _StreamingFir:
    """Causal FIR over a stream whose output is realigned with its input.

    The first ``delay`` outputs (the filter's group delay) are dropped and ``flush`` emits
    the last ``delay``, so output sample k lines up with input sample k, at the cost of
    holding back ``delay`` samples (about 1-2 ms here).
    """

    __slots__ = ("_skip", "_taps", "_work", "delay")

    def __init__(self, taps: np.ndarray) -> None:
        self._taps = taps
        self.delay = (len(taps) - 1) // 2
        self._work = np.zeros(len(taps) - 1 + 4096, dtype=np.float32)
        self._skip = self.delay

    def process(self, x: np.ndarray) -> np.ndarray:
        hist = len(self._taps) - 1
        n = len(x)
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        if hist + n > len(self._work):
            grown = np.zeros(max(hist + n, 2 * len(self._work)), dtype=np.float32)
            grown[:hist] = self._work[:hist]
            self._work = grown
        self._work[hist : hist + n] = x
        y = np.convolve(self._work[: hist + n], self._taps, mode="valid")
        # Keep the newest `hist` inputs at the front for the next call (regions may overlap).
        self._work[:hist] = self._work[n : n + hist].copy()
        if self._skip:
            dropped = min(self._skip, n)
            self._skip -= dropped
            y = y[dropped:]
        return y

    def flush(self) -> np.ndarray:
        """Emit the held-back tail (inputs padded with zeros) and reset for a new stream."""
        y = self.process(np.zeros(self.delay, dtype=np.float32))
        self._work[: len(self._taps) - 1] = 0.0
        self._skip = self.delay
        return y


class Resampler:
    """Streaming resampler from ``rate_hz`` to 16 kHz that adds no buffering delay.

    soxr's default 'HQ' quality processes in blocks and holds output back by up to ~115 ms,
    releasing it in bursts; its 'QQ' (cubic) quality returns output for every input sample
    at once but has no anti-aliasing. So QQ does the rate change and a short linear-phase
    low-pass (60 dB, transition band 25% of the lower Nyquist, about 40-90 taps) runs
    before it when downsampling, or after it when upsampling. The filter's group delay is
    compensated, so output stays time-aligned with input; the whole chain lags the input by
    at most ~2 ms (see tests/test_audio.py for the measurement). At 16 kHz input,
    ``process`` returns its argument unchanged (no copy).
    """

    __slots__ = ("_fir_in", "_fir_out", "_soxr", "rate_hz")

    def __init__(self, rate_hz: int) -> None:
        if not MIN_INPUT_RATE_HZ <= rate_hz <= MAX_INPUT_RATE_HZ:
            raise ValueError(
                f"sample rate {rate_hz} Hz is not supported: send audio between "
                f"{MIN_INPUT_RATE_HZ} and {MAX_INPUT_RATE_HZ} Hz"
            )
        self.rate_hz = rate_hz
        self._soxr: soxr.ResampleStream | None = None
        self._fir_in: _StreamingFir | None = None
        self._fir_out: _StreamingFir | None = None
        if rate_hz == SAMPLE_RATE_HZ:
            return
        self._soxr = soxr.ResampleStream(rate_hz, SAMPLE_RATE_HZ, 1, dtype="float32", quality="QQ")
        nyquist_hz = min(rate_hz, SAMPLE_RATE_HZ) / 2
        if rate_hz > SAMPLE_RATE_HZ:
            self._fir_in = _StreamingFir(_lowpass_taps(rate_hz, nyquist_hz, 0.25 * nyquist_hz))
        else:
            self._fir_out = _StreamingFir(_lowpass_taps(SAMPLE_RATE_HZ, nyquist_hz, 0.25 * nyquist_hz))

    def process(self, x: np.ndarray) -> np.ndarray:
        """Resample one chunk of float32 mono samples; returns what is ready now."""
        if self._soxr is None:
            return x
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self._fir_in is not None:
            x = self._fir_in.process(x)
        y = self._soxr.resample_chunk(x)
        if self._fir_out is not None:
            y = self._fir_out.process(y)
        return y

    def flush(self) -> np.ndarray:
        """End of stream: return the held-back tail and reset so the object can be reused."""
        if self._soxr is None:
            return np.zeros(0, dtype=np.float32)
        tail = self._fir_in.flush() if self._fir_in is not None else np.zeros(0, dtype=np.float32)
        y = self._soxr.resample_chunk(tail, last=True)
        self._soxr.clear()
        if self._fir_out is not None:
            y = np.concatenate((self._fir_out.process(y), self._fir_out.flush()))
        return y


class Framer:
    """Cuts a stream of samples into exact frames of ``frame_samples`` (default 10 ms at 16 kHz).

    Only the partial frame (< ``frame_samples`` samples) is kept between calls, in a buffer
    allocated once. ``push`` returns a new ``[n, frame_samples]`` array owned by the caller:
    the frames usually outlive the call (queued for the model), and the copy is the one
    copy needed to make them contiguous anyway.
    """

    __slots__ = ("_buf", "_empty", "_pending", "frame_samples")

    def __init__(self, frame_samples: int = FRAME_SAMPLES) -> None:
        if frame_samples <= 0:
            raise ValueError(f"frame_samples must be positive, got {frame_samples}")
        self.frame_samples = frame_samples
        self._buf = np.zeros(frame_samples, dtype=np.float32)
        self._pending = 0
        self._empty = np.zeros((0, frame_samples), dtype=np.float32)
        self._empty.flags.writeable = False

    @property
    def pending_samples(self) -> int:
        """Samples waiting for the rest of their frame."""
        return self._pending

    def push(self, x: np.ndarray) -> np.ndarray:
        """Add samples; return the ``[n, frame_samples]`` complete frames now available (n may be 0)."""
        size = self.frame_samples
        pending = self._pending
        total = pending + len(x)
        n = total // size
        if n == 0:
            self._buf[pending:total] = x
            self._pending = total
            return self._empty
        frames = np.empty((n, size), dtype=np.float32)
        flat = frames.reshape(-1)
        flat[:pending] = self._buf[:pending]
        used = n * size - pending
        flat[pending:] = x[:used]
        rest = len(x) - used
        self._buf[:rest] = x[used:]
        self._pending = rest
        return frames

    def flush_padded(self) -> np.ndarray:
        """Return the pending samples zero-padded to one frame (``[1, size]``), or ``[0, size]``."""
        if self._pending == 0:
            return self._empty
        frame = np.zeros((1, self.frame_samples), dtype=np.float32)
        frame[0, : self._pending] = self._buf[: self._pending]
        self._pending = 0
        return frame
