"""Whole audio files (uploads) to mono 16-bit PCM: WAV, FLAC, OGG (Vorbis, Opus) and MP3 through libsndfile
(the ``soundfile`` package, whose wheels bundle it), and WAV also by :mod:`cosystream.audio.wav` for what
libsndfile refuses (a streamed WAV whose sizes are 0 or 0xFFFFFFFF).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from cosystream.audio.codecs import MAX_INPUT_RATE_HZ, MIN_INPUT_RATE_HZ, AudioEncoding, PcmDecoder
from cosystream.audio.wav import is_wav, parse_wav_header
from cosystream.frames import SAMPLE_RATE_HZ

FORMATS = "WAV, FLAC, OGG (Vorbis, Opus) or MP3"


class UndecodableAudio(ValueError):
    """A file that is not audio this server can decode; the message says why (one line)."""


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    samples: np.ndarray  # int16, mono
    sample_rate_hz: int
    container: str  # "WAV", "FLAC", "OGG", "MP3", ...

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate_hz

    def pcm16(self) -> bytes:
        return self.samples.astype("<i2", copy=False).tobytes()


def decode_file(data: bytes) -> DecodedAudio:
    """``data`` (a whole file) as mono int16 at a rate the native stream takes (8 to 48 kHz; others are
    resampled to 16 kHz). Raises :class:`UndecodableAudio`."""
    if not data:
        raise UndecodableAudio("the file is empty")
    try:
        decoded = _with_soundfile(data)
    except UndecodableAudio:
        if not is_wav(data):
            raise
        decoded = _with_wav_parser(data)
    if not MIN_INPUT_RATE_HZ <= decoded.sample_rate_hz <= MAX_INPUT_RATE_HZ:
        import soxr

        samples = soxr.resample(decoded.samples, decoded.sample_rate_hz, SAMPLE_RATE_HZ)
        decoded = DecodedAudio(samples.astype(np.int16), SAMPLE_RATE_HZ, decoded.container)
    return decoded


def _with_soundfile(data: bytes) -> DecodedAudio:
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            container = f.format
            rate = f.samplerate
            frames = f.read(dtype="int16", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise UndecodableAudio(
            f"the file is not audio in a format this server decodes ({FORMATS}): {err}"
        ) from None
    samples = frames[:, 0] if frames.shape[1] == 1 else frames.mean(axis=1).astype(np.int16)
    return DecodedAudio(np.ascontiguousarray(samples), rate, container)


def _with_wav_parser(data: bytes) -> DecodedAudio:
    try:
        parsed = parse_wav_header(data)
    except ValueError as err:
        raise UndecodableAudio(f"WAV: {err}") from None
    if parsed is None:
        raise UndecodableAudio("WAV: the file ends inside its header")
    wav, offset = parsed
    body = data[offset:]
    width = 2 if wav.encoding == AudioEncoding.LINEAR16 else 1
    body = body[: len(body) - len(body) % (width * wav.channels)]
    samples = PcmDecoder(wav.encoding).decode(body)
    if wav.channels > 1:
        samples = samples.reshape(-1, wav.channels).mean(axis=1)
    return DecodedAudio(
        np.clip(np.round(samples * 32768), -32768, 32767).astype(np.int16), wav.sample_rate_hz, "WAV"
    )
