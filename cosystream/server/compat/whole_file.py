"""Whole-file recognition for the Google and Riva adapters: one request's audio run as one BATCH session.

:func:`open_content` decides what a request's audio is before anything is decoded: a container (a WAV
header, or an encoding the protocol declares as a file format: FLAC, OGG Opus, MP3) is opened by
:func:`cosystream.audio.files.open_audio`, which reads only its header; raw PCM / G.711 is measured by its
byte count. Either way a file longer than the caller's limit is refused there, with the caller's words.
:func:`recognize` then runs it through the native servicer in this process (:class:`NativeStream`), so
validation, the token's quota, admission, model selection, idle and drain rules and the freeing of the
engine slot are those of every other session, and returns the finals, one per utterance.
:func:`recognize_channels` runs each channel of a file as a session of its own (separate recognition per
channel), at the same time, and returns their finals tagged by channel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import grpc
import numpy as np

from cosystream.audio.codecs import ALAW_TO_INT16, MULAW_TO_INT16, AudioEncoding
from cosystream.audio.files import AudioFile, AudioTooLong, UndecodableAudio, open_audio
from cosystream.audio.wav import is_wav, parse_wav_header
from cosystream.server.auth import Token
from cosystream.server.compat.bridge import (
    AudioFormat,
    CompatError,
    Downmixer,
    check_declared,
    copy_config,
    resolve_format,
)
from cosystream.server.native import NativeStream, StreamEnded
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

log = logging.getLogger(__name__)

BLOCK_S = 1.0
"""Audio handed to the session per request (decoded a block at a time, so memory stays flat)."""
_BAD = grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class FileLimits:
    """How long a whole-file request's audio may be, by its header or byte count (checked before decoding)."""

    sync_audio_s: float = 60.0  # Google's Recognize and its documented limit (1 minute)
    long_audio_s: float = 3600.0  # LongRunningRecognize and Riva's offline Recognize

    def __post_init__(self) -> None:
        if not 0 < self.sync_audio_s <= self.long_audio_s:
            raise ValueError(
                f"need 0 < sync_audio_s <= long_audio_s, not {self.sync_audio_s}, {self.long_audio_s}"
            )


@dataclass(frozen=True, slots=True)
class FileAudio:
    """A request's audio, measured and not yet decoded: what the native session is told, and its blocks
    (``blocks(None)``: the channels mixed; ``blocks(c)``: channel ``c`` alone, 0-based)."""

    encoding: AudioEncoding  # as the session receives it (LINEAR16 for a decoded container or several channels)
    sample_rate_hz: int
    duration_s: float
    blocks: Callable[[int | None], Iterator[bytes]]
    channels: int = 1


def _raw_blocks(content: bytes, audio: AudioFormat, channel: int | None) -> Iterator[bytes]:
    width = (2 if audio.encoding == AudioEncoding.LINEAR16 else 1) * audio.channels
    step = max(width, int(audio.sample_rate_hz * BLOCK_S) * width)
    downmix = Downmixer(audio.encoding, audio.channels) if audio.channels > 1 and channel is None else None
    usable = len(content) - len(content) % width
    for start in range(0, usable, step):
        block = content[start : min(start + step, usable)]
        if downmix is not None:
            yield downmix.push(block)
        elif channel is not None and audio.channels > 1:
            yield _one_channel(block, audio, channel)
        else:
            yield block


def _one_channel(block: bytes, audio: AudioFormat, channel: int) -> bytes:
    """Channel ``channel`` of interleaved raw frames, as LINEAR16."""
    if audio.encoding == AudioEncoding.LINEAR16:
        samples = np.frombuffer(block, "<i2").reshape(-1, audio.channels)[:, channel]
    else:
        table = MULAW_TO_INT16 if audio.encoding == AudioEncoding.MULAW else ALAW_TO_INT16
        samples = table[np.frombuffer(block, np.uint8).reshape(-1, audio.channels)[:, channel]]
    return samples.astype("<i2").tobytes()


def _container_blocks(audio: AudioFile, channel: int | None) -> Iterator[bytes]:
    for block in audio.blocks(channel=channel):
        yield block.astype("<i2", copy=False).tobytes()


def open_content(
    content: bytes,
    declared: AudioFormat,
    container: bool,
    encoding_names: Mapping[AudioEncoding, str],
    max_audio_s: float,
    too_long: str,
) -> FileAudio:
    """Measure ``content``; ``container``: the config declared a file format. Raises :class:`CompatError`
    (INVALID_ARGUMENT) for audio that cannot be decoded, a declared field that contradicts a WAV header, and
    audio longer than ``max_audio_s`` (the message then ends with ``too_long``)."""
    if not content:
        raise CompatError(_BAD, "the audio content is empty: send the audio in content")
    check_declared(declared)
    if not container and not is_wav(content):
        audio = resolve_format(declared, None, False, encoding_names)
        width = (2 if audio.encoding == AudioEncoding.LINEAR16 else 1) * audio.channels
        duration_s = len(content) // width / audio.sample_rate_hz
        if duration_s > max_audio_s:
            raise CompatError(_BAD, f"the audio is {duration_s:.1f} s long; {too_long}")
        encoding = AudioEncoding.LINEAR16 if audio.channels > 1 else audio.encoding
        return FileAudio(
            encoding,
            audio.sample_rate_hz,
            duration_s,
            lambda channel: _raw_blocks(content, audio, channel),
            audio.channels,
        )
    if is_wav(content):
        try:
            parsed = parse_wav_header(content)
        except ValueError:
            parsed = None  # a WAV header libsndfile may still read; open_audio says why if not
        if parsed is not None:
            resolve_format(declared, parsed[0], False, encoding_names)
    try:
        audio_file = open_audio(content, max_audio_s)
    except AudioTooLong as err:
        raise CompatError(_BAD, f"the audio is {err.duration_s:.1f} s long; {too_long}") from None
    except UndecodableAudio as err:
        raise CompatError(_BAD, f"the audio content: {err}") from None
    info = audio_file.info
    if declared.sample_rate_hz not in (0, info.sample_rate_hz):
        raise CompatError(
            _BAD,
            f"sample_rate_hertz={declared.sample_rate_hz} does not match the {info.container} header "
            f"({info.sample_rate_hz}): leave it 0 or make it match",
        )
    if declared.channels > 1 and declared.channels != info.channels:
        raise CompatError(
            _BAD,
            f"audio_channel_count={declared.channels} does not match the {info.container} header ({info.channels})",
        )
    return FileAudio(
        AudioEncoding.LINEAR16,
        info.sample_rate_hz,
        info.duration_s,
        lambda channel: _container_blocks(audio_file, channel),
        info.channels,
    )


async def recognize(
    servicer: CosyStreamServicer,
    audio: FileAudio,
    config: pb.StreamingConfig,
    token: Token | None,
    admitted: asyncio.Event | None = None,
    on_final: Callable[[pb.StreamingResult], None] | None = None,
    channel: int | None = None,
) -> list[pb.StreamingResult]:
    """The finals of ``audio`` (its channels mixed, or ``channel`` alone) run as one BATCH session with
    ``config`` (its audio fields are set here). Sets ``admitted`` once the servicer accepted the session
    (quota claimed). Raises :class:`CompatError` with the session's status if it ends otherwise than OK, or
    INVALID_ARGUMENT if the audio turns out damaged part-way. Cancelling it ends the session (its slot is
    freed)."""
    config.encoding = int(audio.encoding)
    config.sample_rate_hz = audio.sample_rate_hz
    config.priority = pb.BATCH
    stream = NativeStream(servicer, config, token)
    loop = asyncio.get_running_loop()
    feeder = loop.create_task(stream.feed(audio.blocks(channel)))
    watcher = None if admitted is None else loop.create_task(_when_accepted(stream, admitted))
    finals: list[pb.StreamingResult] = []
    try:
        async for response in stream.responses():
            for result in response.results:
                if result.is_final:
                    finals.append(result)
                    if on_final is not None:
                        on_final(result)
    except StreamEnded as ended:
        if ended.code != grpc.StatusCode.OK:
            raise CompatError(ended.code, ended.message, ended.retry_after_s) from None
    finally:
        feeder.cancel()
        if watcher is not None:
            watcher.cancel()
    if feeder.done() and not feeder.cancelled() and (err := feeder.exception()) is not None:
        if isinstance(err, UndecodableAudio):
            raise CompatError(_BAD, f"the audio content: {err}") from None
        raise err
    return finals


async def recognize_channels(
    servicer: CosyStreamServicer,
    audio: FileAudio,
    config: pb.StreamingConfig,
    token: Token | None,
    admitted: asyncio.Event | None = None,
    on_final: Callable[[pb.StreamingResult], None] | None = None,
) -> list[tuple[int, pb.StreamingResult]]:
    """Each channel of ``audio`` as a BATCH session of its own, all at once (each counts against the
    token's ``max_sessions`` and the engine's slots): ``(channel_tag, final)`` pairs, channel_tag 1..N, in
    the order the finals end (ties by channel). ``admitted`` is set once every channel's session is
    accepted; the first failure ends every channel's session and is raised as :func:`recognize` raises it."""
    loop = asyncio.get_running_loop()
    accepted = [asyncio.Event() for _ in range(audio.channels)]
    runs = [
        loop.create_task(recognize(servicer, audio, copy_config(config), token, accepted[c], on_final, c))
        for c in range(audio.channels)
    ]
    watcher = None
    if admitted is not None:

        async def all_accepted() -> None:
            await asyncio.gather(*(event.wait() for event in accepted))
            admitted.set()

        watcher = loop.create_task(all_accepted())
    try:
        results = await asyncio.gather(*runs)
    finally:
        for run in runs:
            run.cancel()
        if watcher is not None:
            watcher.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
    tagged = [(tag, final) for tag, finals in enumerate(results, 1) for final in finals]
    return sorted(tagged, key=lambda pair: (pair[1].end_ms, pair[0]))


async def _when_accepted(stream: NativeStream, admitted: asyncio.Event) -> None:
    if await stream.accepted():
        admitted.set()
