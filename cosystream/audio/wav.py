"""WAV headers at the start of a stream: sniff, parse, strip.

Riva's file clients send the raw bytes of a ``.wav`` file with the encoding left unspecified (and sometimes
the rate too), and Google accepts WAV headers with LINEAR16 and MULAW; the header is parsed here so the
audio after it can be decoded, and never reaches the decoder itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cosystream.audio.codecs import AudioEncoding

WAV_SNIFF_BYTES = 12  # "RIFF" <size> "WAVE"
MAX_HEADER_BYTES = 1 << 20  # metadata chunks (LIST, bext) before "data" may be long, but not this long

_PCM, _ALAW, _MULAW, _EXTENSIBLE = 0x0001, 0x0006, 0x0007, 0xFFFE


@dataclass(frozen=True, slots=True)
class WavFormat:
    encoding: AudioEncoding
    sample_rate_hz: int
    channels: int


def is_wav(prefix: bytes | bytearray) -> bool:
    """Whether a stream's first :data:`WAV_SNIFF_BYTES` bytes are a RIFF/WAVE header."""
    return len(prefix) >= WAV_SNIFF_BYTES and prefix[:4] == b"RIFF" and prefix[8:12] == b"WAVE"


def parse_wav_header(data: bytes | bytearray) -> tuple[WavFormat, int] | None:
    """Parse the header of a WAV stream that :func:`is_wav` accepted.

    Returns the format and the offset of the first sample, or None when ``data`` ends before the "data"
    chunk starts (read more and call again). The data chunk's size is not used: streamed WAVs often carry
    0 or 0xFFFFFFFF there, so everything after the header is audio. Raises ValueError for a malformed
    header or a sample format other than 16-bit PCM, 8-bit mu-law or 8-bit A-law.
    """
    offset = WAV_SNIFF_BYTES
    wav_format: WavFormat | None = None
    while True:
        if offset > MAX_HEADER_BYTES:
            raise ValueError(f"no WAV data chunk in the first {MAX_HEADER_BYTES} bytes")
        if len(data) < offset + 8:
            return None
        chunk_id, size = struct.unpack_from("<4sI", data, offset)
        body = offset + 8
        if chunk_id == b"data":
            if wav_format is None:
                raise ValueError("the WAV data chunk comes before its fmt chunk")
            return wav_format, body
        if chunk_id == b"fmt ":
            if len(data) < body + min(size, 26):
                return None
            wav_format = _parse_fmt(bytes(data[body : body + size]))
        offset = body + size + (size & 1)  # chunks are padded to an even size


def _parse_fmt(body: bytes) -> WavFormat:
    if len(body) < 16:
        raise ValueError(f"the WAV fmt chunk is {len(body)} bytes; at least 16 expected")
    tag, channels, rate_hz, _, _, bits = struct.unpack_from("<HHIIHH", body)
    if tag == _EXTENSIBLE:
        if len(body) < 26:
            raise ValueError("the WAVE_FORMAT_EXTENSIBLE fmt chunk is truncated")
        (tag,) = struct.unpack_from("<H", body, 24)  # the first two bytes of the sub-format GUID
    encoding = {
        (_PCM, 16): AudioEncoding.LINEAR16,
        (_MULAW, 8): AudioEncoding.MULAW,
        (_ALAW, 8): AudioEncoding.ALAW,
    }
    if (tag, bits) not in encoding:
        raise ValueError(
            f"WAV format tag {tag:#06x} with {bits}-bit samples is not supported: "
            "send 16-bit PCM, 8-bit mu-law or 8-bit A-law"
        )
    if channels < 1:
        raise ValueError("the WAV header says 0 channels")
    return WavFormat(encoding[(tag, bits)], rate_hz, channels)
