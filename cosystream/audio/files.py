"""Whole audio files (uploads, ``cosystream transcribe``) to mono 16-bit PCM: WAV, FLAC, OGG (Vorbis, Opus)
and MP3 through libsndfile (the ``soundfile`` package, whose wheels bundle it), and WAV also by
:mod:`cosystream.audio.wav` for what libsndfile refuses (a streamed WAV whose sizes are 0 or 0xFFFFFFFF).

A file is opened in two steps so that what it costs is known before it is paid: :func:`open_audio` reads
only the header (rate, channels, length) and refuses a rate outside 8-48 kHz, a file with no audio and one
longer than the caller's limit; :meth:`AudioFile.blocks` then decodes it a block at a time, so memory stays
bounded by one block whatever the file's length (a 40 KB WAV that claims 1 Hz would otherwise decode, and
resample, to hours of audio).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from cosystream.audio.codecs import MAX_INPUT_RATE_HZ, MIN_INPUT_RATE_HZ, AudioEncoding, PcmDecoder
from cosystream.audio.wav import WavFormat, is_wav, parse_wav_header

FORMATS = "WAV, FLAC, OGG (Vorbis, Opus) or MP3"
BLOCK_FRAMES = 16_000
"""Samples (per channel) decoded at a time by :meth:`AudioFile.blocks` (1 s at 16 kHz)."""


class UndecodableAudio(ValueError):
    """A file that is not audio this server can decode; the message says why (one line)."""


class AudioTooLong(UndecodableAudio):
    """A file whose audio is longer than the limit it was opened with (``duration_s``, by its header)."""

    def __init__(self, message: str, duration_s: float):
        super().__init__(message)
        self.duration_s = duration_s


@dataclass(frozen=True, slots=True)
class AudioInfo:
    """What a file's header says."""

    sample_rate_hz: int
    channels: int
    frames: int  # samples per channel
    container: str  # "WAV", "FLAC", "OGG", "MP3", ...

    @property
    def duration_s(self) -> float:
        return self.frames / self.sample_rate_hz


class AudioFile:
    """A file whose header was read and checked; :meth:`blocks` decodes it."""

    def __init__(self, data: bytes, info: AudioInfo, wav: tuple[WavFormat, int] | None = None):
        self._data = data
        self.info = info
        self._wav = wav  # (format, offset of the first sample): read by the WAV parser, not libsndfile

    def blocks(self, frames: int = BLOCK_FRAMES, channel: int | None = None) -> Iterator[np.ndarray]:
        """The audio as mono int16 arrays of up to ``frames`` samples each: the channels averaged, or only
        ``channel`` (0-based) of them; no more than the header's length, whatever the body holds."""
        if channel is not None and not 0 <= channel < self.info.channels:
            raise ValueError(f"channel {channel} of a {self.info.channels}-channel file")
        left = self.info.frames
        chunks = (
            self._soundfile_blocks(frames, channel) if self._wav is None else self._wav_blocks(frames, channel)
        )
        for block in chunks:
            if left <= 0:
                break
            block = block[:left]
            left -= len(block)
            if len(block):
                yield block

    def read(self) -> np.ndarray:
        """The whole file as one mono int16 array."""
        return np.concatenate([*self.blocks(), np.zeros(0, np.int16)])

    def _soundfile_blocks(self, frames: int, channel: int | None) -> Iterator[np.ndarray]:
        import soundfile

        try:
            with soundfile.SoundFile(io.BytesIO(self._data)) as f:
                # float32, then int16 here: libsndfile reads a float file as int16 unscaled (every sample 0 or +-1)
                for block in f.blocks(blocksize=frames, dtype="float32", always_2d=True):
                    yield _mono(block if channel is None else block[:, channel : channel + 1])
        except (soundfile.LibsndfileError, RuntimeError) as err:
            raise UndecodableAudio(f"the {self.info.container} audio is damaged: {_reason(err)}") from None

    def _wav_blocks(self, frames: int, channel: int | None) -> Iterator[np.ndarray]:
        wav, offset = self._wav
        width = (2 if wav.encoding == AudioEncoding.LINEAR16 else 1) * wav.channels
        decoder = PcmDecoder(wav.encoding)
        for start in range(offset, len(self._data) - width + 1, frames * width):
            body = self._data[start : start + frames * width]
            samples = decoder.decode(body[: len(body) - len(body) % width])
            if wav.channels > 1:
                by_channel = samples.reshape(-1, wav.channels)
                samples = by_channel.mean(axis=1) if channel is None else by_channel[:, channel]
            yield np.clip(np.round(samples * 32768), -32768, 32767).astype(np.int16)


def open_audio(data: bytes, max_duration_s: float | None = None) -> AudioFile:
    """``data`` (a whole file), its header read and checked; nothing is decoded yet. Raises
    :class:`UndecodableAudio` for a file that is not audio this server decodes, a rate outside
    8-48 kHz or no audio at all, and :class:`AudioTooLong` past ``max_duration_s``."""
    if not data:
        raise UndecodableAudio("the file is empty")
    try:
        audio = _by_soundfile(data)
    except UndecodableAudio:
        if not is_wav(data):
            raise
        audio = _by_wav_parser(data)
    info = audio.info
    if not MIN_INPUT_RATE_HZ <= info.sample_rate_hz <= MAX_INPUT_RATE_HZ:
        raise UndecodableAudio(
            f"the {info.container} header gives a sample rate of {info.sample_rate_hz} Hz; this server takes "
            f"{MIN_INPUT_RATE_HZ} to {MAX_INPUT_RATE_HZ} Hz (resample it, e.g. sox IN -r 16000 OUT.wav)"
        )
    if info.frames <= 0:
        raise UndecodableAudio(f"the {info.container} file holds no audio")
    if max_duration_s is not None and info.duration_s > max_duration_s:
        raise AudioTooLong(
            f"the audio is {info.duration_s:.1f} s long; this server takes files of up to {max_duration_s:g} s: "
            "split it",
            info.duration_s,
        )
    return audio


def _by_soundfile(data: bytes) -> AudioFile:
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            info = AudioInfo(f.samplerate, f.channels, f.frames, f.format)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise UndecodableAudio(
            f"the file is not audio in a format this server decodes ({FORMATS}): {_reason(err)}"
        ) from None
    return AudioFile(data, info)


def _by_wav_parser(data: bytes) -> AudioFile:
    try:
        parsed = parse_wav_header(data)
    except ValueError as err:
        raise UndecodableAudio(f"WAV: {err}") from None
    if parsed is None:
        raise UndecodableAudio("WAV: the file ends inside its header")
    wav, offset = parsed
    width = (2 if wav.encoding == AudioEncoding.LINEAR16 else 1) * wav.channels
    info = AudioInfo(wav.sample_rate_hz, wav.channels, (len(data) - offset) // width, "WAV")
    return AudioFile(data, info, (wav, offset))


def _mono(block: np.ndarray) -> np.ndarray:
    """float32 ``[frames, channels]`` in [-1, 1] as mono int16 (channels averaged)."""
    mono = block[:, 0] if block.shape[1] == 1 else block.mean(axis=1)
    return np.clip(np.round(mono * 32768), -32768, 32767).astype(np.int16)


def _reason(err: Exception) -> str:
    """libsndfile's own words ("Format not recognised."), without the object repr its message starts with."""
    text = getattr(err, "error_string", "") or str(err)
    if text.startswith("Error opening <"):  # "Error opening <_io.BytesIO object at 0x...>: ..."
        text = text.partition(">: ")[2]
    lines = text.strip().splitlines()  # (mpg123 appends its own notes, a line each)
    return lines[0].strip().rstrip(".") if lines else "not recognised"
