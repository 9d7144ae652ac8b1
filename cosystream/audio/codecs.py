"""Wire audio encodings: LINEAR16 and G.711 (mu-law, A-law) bytes to float32 samples, and back.

Clients send chunks of any size in any of the wire encodings; :class:`PcmDecoder` holds one stream's
state (a 16-bit sample split across chunks), so one instance per stream, fed in order.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

MIN_INPUT_RATE_HZ = 8000
MAX_INPUT_RATE_HZ = 48000

_INT16_SCALE = 1.0 / 32768.0


class AudioEncoding(IntEnum):
    """Sample encoding of client audio; the numbers match the wire proto's enum."""

    UNSPECIFIED = 0
    LINEAR16 = 1
    MULAW = 2
    ALAW = 3
    OGG_OPUS = 4  # compressed (cosystream/audio/streams.py): decoded by their headers
    FLAC = 5
    WEBM_OPUS = 6


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


class PcmDecoder:
    """Turns wire bytes into float32 mono samples in [-1, 1]: int16 levels / 32768, exactly (the VAD takes
    them back to int16 without clipping).

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
