"""What the Google and Riva adapters share: a foreign stream run as a native session.

An adapter is not a second engine. Per stream it reads the foreign config, validates it with the foreign
protocol's wording, reads up to the first audio to sniff a WAV header, and then opens a native session in
this process (:class:`~cosystream.server.native.NativeStream`, over the frontend's sessions) with the native
config, and feeds it the audio (downmixed when it has several channels, or one session per channel). Each
native response is translated into zero or more foreign ones. Errors keep the native status codes, except
where a protocol's clients mishandle one before the first response (:class:`AbortGuard`).

Both protocols name their request oneof's fields ``streaming_config`` and ``audio_content``, and their
config fields ``encoding``, ``sample_rate_hertz`` and ``audio_channel_count``, so the audio side is
shared as is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import grpc
import numpy as np

from cosystream.audio.codecs import (
    ALAW_TO_INT16,
    MAX_INPUT_RATE_HZ,
    MIN_INPUT_RATE_HZ,
    MULAW_TO_INT16,
    AudioEncoding,
)
from cosystream.audio.streams import COMPRESSED
from cosystream.audio.wav import WAV_SNIFF_BYTES, WavFormat, is_wav, parse_wav_header
from cosystream.decoding.phrases import MAX_BOOST
from cosystream.server.auth import current_token
from cosystream.server.native import NativeStream, StreamEnded
from cosystream.server.retry import retry_metadata
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1.resume import SESSION_METADATA

log = logging.getLogger(__name__)

MAX_CHANNELS = 8
_REJECTED = {grpc.StatusCode.DEADLINE_EXCEEDED: "idle_timeout"}  # the native servicer's metric labels
DEFAULT_RATE_HZ = 16000  # only for a stream that ends before any audio, so that it ends OK


class CompatError(Exception):
    """A foreign request the adapter refuses; ends the stream with ``code`` (``retry_after_s``: a temporary
    refusal's delay, sent as a RetryInfo)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def trailing_metadata(self) -> tuple:
        return retry_metadata(self.code, self.message, self.retry_after_s)


class AbortGuard:
    """A foreign stream's status and initial metadata, on their way to its call's context.

    Aborts pass through it so that a protocol can replace status codes its clients mishandle before the
    first response (Google's client retries UNAVAILABLE and DEADLINE_EXCEEDED with a half-consumed request
    iterator).
    """

    def __init__(self, context: grpc.aio.ServicerContext, early_codes: Mapping[grpc.StatusCode, grpc.StatusCode]):
        self._context = context
        self._early_codes = early_codes
        self.responded = False
        self._metadata_sent = False

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        if not self.responded:
            code = self._early_codes.get(code, code)
        await self._context.abort(code, details, trailing_metadata)

    async def end(self, ended: StreamEnded) -> None:
        """End the call as the native session ended (nothing if OK)."""
        if ended.code != grpc.StatusCode.OK:
            await self.abort(
                ended.code, ended.message, retry_metadata(ended.code, ended.message, ended.retry_after_s)
            )

    async def announce(self, stream: NativeStream) -> None:
        """Once the session is accepted, its id as the call's initial metadata (once: a stream recognized per
        channel runs a native session per channel, and the call has one set: the first channel's)."""
        if await stream.accepted() and not self._metadata_sent:
            self._metadata_sent = True
            await self._context.send_initial_metadata(((SESSION_METADATA, stream.session_id),))


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """A stream's audio as declared by its config (UNSPECIFIED / 0: not declared) or as resolved."""

    encoding: AudioEncoding
    sample_rate_hz: int
    channels: int


def check_declared(declared: AudioFormat) -> None:
    """Refuse a declared rate or channel count at once, before any audio is read."""
    rate = declared.sample_rate_hz
    if rate and not MIN_INPUT_RATE_HZ <= rate <= MAX_INPUT_RATE_HZ:
        raise CompatError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"sample_rate_hertz={rate} is not supported: use {MIN_INPUT_RATE_HZ} to {MAX_INPUT_RATE_HZ}",
        )
    if not 0 <= declared.channels <= MAX_CHANNELS:
        raise CompatError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"audio_channel_count={declared.channels} is not supported: use 1 to {MAX_CHANNELS}",
        )


def resolve_format(
    declared: AudioFormat, wav: WavFormat | None, empty: bool, encoding_names: Mapping[AudioEncoding, str]
) -> AudioFormat:
    """The format to decode: the WAV header's where there is one (a declared field must then match it),
    else the declared one, which must be complete."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if wav is not None:
        if declared.encoding not in (AudioEncoding.UNSPECIFIED, wav.encoding):
            raise CompatError(
                bad,
                f"encoding {encoding_names[declared.encoding]} does not match the WAV header "
                f"({encoding_names.get(wav.encoding, wav.encoding.name)}): leave it unspecified or make it match",
            )
        if declared.sample_rate_hz not in (0, wav.sample_rate_hz):
            raise CompatError(
                bad,
                f"sample_rate_hertz={declared.sample_rate_hz} does not match the WAV header "
                f"({wav.sample_rate_hz}): leave it 0 or make it match",
            )
        if declared.channels > 1 and declared.channels != wav.channels:
            raise CompatError(
                bad,
                f"audio_channel_count={declared.channels} does not match the WAV header ({wav.channels})",
            )
        resolved = AudioFormat(wav.encoding, wav.sample_rate_hz, wav.channels)
    elif empty:
        resolved = AudioFormat(
            declared.encoding or AudioEncoding.LINEAR16, declared.sample_rate_hz or DEFAULT_RATE_HZ, 1
        )
    else:
        resolved = AudioFormat(declared.encoding, declared.sample_rate_hz, declared.channels or 1)
    if resolved.encoding == AudioEncoding.UNSPECIFIED:
        names = ", ".join(name for code, name in encoding_names.items() if code)
        raise CompatError(bad, f"encoding is unspecified and the audio has no WAV header: set it to {names}")
    if resolved.sample_rate_hz == 0 and resolved.encoding not in COMPRESSED:  # (compressed: the header's)
        raise CompatError(bad, "sample_rate_hertz is required unless the audio starts with a WAV header")
    check_declared(resolved)
    return resolved


def context_phrases(speech_contexts) -> list[pb.Phrase]:
    """Google's and Riva's ``speech_contexts`` (phrases and a boost each; Riva's word boosting sends them too)
    as phrases. Google's boost is "typically 0 to 20" and Riva's examples use 20 and more (each scale its
    own): a larger one is ours at most."""
    return [
        pb.Phrase(text=phrase, boost=min(context.boost, MAX_BOOST))
        for context in speech_contexts
        for phrase in context.phrases
    ]


class Downmixer:
    """Interleaved multi-channel audio to mono LINEAR16 (the mean of the channels); a frame split across
    chunks is carried to the next one."""

    __slots__ = ("_carry", "_channels", "_frame_bytes", "_table")

    def __init__(self, encoding: AudioEncoding, channels: int):
        self._channels = channels
        self._table = {AudioEncoding.MULAW: MULAW_TO_INT16, AudioEncoding.ALAW: ALAW_TO_INT16}.get(encoding)
        self._frame_bytes = channels * (1 if self._table is not None else 2)
        self._carry = b""

    def push(self, chunk: bytes) -> bytes:
        data = self._carry + chunk if self._carry else chunk
        usable = len(data) - len(data) % self._frame_bytes
        self._carry = data[usable:]
        if not usable:
            return b""
        if self._table is not None:
            samples = self._table[np.frombuffer(data, np.uint8, usable)]
        else:
            samples = np.frombuffer(data, "<i2", usable // 2)
        frames = samples.reshape(-1, self._channels).astype(np.int32)
        return (frames.sum(axis=1) // self._channels).astype("<i2").tobytes()


class ChannelSplitter:
    """Interleaved multi-channel audio to one byte string per channel, each in the audio's own encoding
    (separate recognition per channel); a frame split across chunks is carried to the next one."""

    __slots__ = ("_carry", "_channels", "_dtype", "_frame_bytes")

    def __init__(self, encoding: AudioEncoding, channels: int):
        self._channels = channels
        self._dtype = np.uint8 if encoding in (AudioEncoding.MULAW, AudioEncoding.ALAW) else np.dtype("<i2")
        self._frame_bytes = channels * np.dtype(self._dtype).itemsize
        self._carry = b""

    def push(self, chunk: bytes) -> list[bytes]:
        data = self._carry + chunk if self._carry else chunk
        usable = len(data) - len(data) % self._frame_bytes
        self._carry = data[usable:]
        frames = np.frombuffer(data, self._dtype, usable // np.dtype(self._dtype).itemsize).reshape(
            -1, self._channels
        )
        return [frames[:, k].tobytes() for k in range(self._channels)]


class AudioInput:
    """The requests of one foreign stream after its config, as native requests."""

    def __init__(self, requests: AsyncIterator, idle_timeout_s: float):
        self._requests = requests
        self._idle_timeout_s = idle_timeout_s
        self._head = b""  # audio read while sniffing, header stripped
        self._pending = None  # a non-audio request read while sniffing
        self._ended = False
        self._downmix: Downmixer | None = None
        self.stopped = False  # set to stop forwarding audio (a single utterance has ended)

    async def next_request(self):
        """The next foreign request (None when the client half-closed), within the idle timeout."""
        try:
            return await asyncio.wait_for(anext(self._requests), self._idle_timeout_s)
        except StopAsyncIteration:
            self._ended = True
            return None
        except TimeoutError:
            raise CompatError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no request for {self._idle_timeout_s:g} s: the session was closed",
            ) from None

    @property
    def empty(self) -> bool:
        """The client half-closed before sending any audio."""
        return self._ended and not self._head

    async def sniff(self) -> WavFormat | None:
        """Read up to the first audio bytes; parse and strip a WAV header there. Call once, after the config."""
        head = bytearray()
        while len(head) < WAV_SNIFF_BYTES:
            request = await self.next_request()
            if request is None:
                break
            if not request.HasField("audio_content"):
                self._pending = request
                break
            head += request.audio_content
        wav = None
        if is_wav(head):
            while True:
                try:
                    parsed = parse_wav_header(head)
                except ValueError as err:
                    raise CompatError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
                if parsed is not None:
                    break
                request = await self.next_request()
                if request is None or not request.HasField("audio_content"):
                    raise CompatError(grpc.StatusCode.INVALID_ARGUMENT, "the audio ends inside its WAV header")
                head += request.audio_content
            wav, offset = parsed
            del head[:offset]
        self._head = bytes(head)
        return wav

    def native_config(self, audio: AudioFormat, config: pb.StreamingConfig) -> pb.StreamingConfig:
        """``config`` with the resolved audio format filled in (multi-channel audio downmixed to LINEAR16)."""
        encoding = audio.encoding
        if audio.channels > 1 and encoding not in COMPRESSED:  # (compressed audio: its decoder downmixes)
            self._downmix = Downmixer(encoding, audio.channels)
            encoding = AudioEncoding.LINEAR16
        config.encoding = int(encoding)
        config.sample_rate_hz = audio.sample_rate_hz
        return config

    async def _audio(self) -> AsyncIterator[bytes | str]:
        """The audio after the config (downmixed if :meth:`native_config` says so), to the client's half-close
        or :attr:`stopped`; a request the native API refuses as the reason it does (a str)."""
        if self._head:
            yield self._head
        foreign = self._pending
        while not self.stopped:
            if foreign is None:
                if self._ended:
                    return
                try:
                    foreign = await anext(self._requests)
                except StopAsyncIteration:
                    return
            if foreign.HasField("audio_content"):
                yield foreign.audio_content
            elif foreign.HasField("streaming_config"):
                yield "StreamingConfig may be sent only once, first"
            else:
                yield "empty request: set config, audio or control"
            foreign = None

    async def feed(self, stream: NativeStream, guard: AbortGuard) -> None:
        """Send ``stream`` the audio once it is accepted (its id announced through ``guard``), then
        half-close it."""
        await guard.announce(stream)
        try:
            async for data in self._audio():
                if isinstance(data, str):
                    await stream.refuse(data)
                    return
                if self._downmix is not None:
                    data = self._downmix.push(data)
                await stream.send_audio(data)
        finally:
            stream.half_close()

    async def feed_channels(self, audio: AudioFormat, streams: list[NativeStream], guard: AbortGuard) -> None:
        """Separate recognition per channel: each of ``streams`` (one per channel, mono, in the audio's own
        encoding) its channel's samples, read off the foreign stream once; then half-close them."""
        splitter = ChannelSplitter(audio.encoding, audio.channels)
        await guard.announce(streams[0])
        try:
            async for data in self._audio():
                if isinstance(data, str):  # (every channel refuses it)
                    for stream in streams:
                        await stream.refuse(data)
                    return
                for stream, samples in zip(streams, splitter.push(data), strict=True):
                    await stream.send_audio(samples)
        finally:
            for stream in streams:
                stream.half_close()


class Translation:
    """One foreign stream's mapping, built from its first request (which may be None: no request came).

    Subclasses set ``declared`` (the audio the config declares), ``native_config`` (the rest of the native
    config) and ``encoding_names``, raise :class:`CompatError` for a config they refuse, and translate
    native responses. ``stop_audio`` stops forwarding audio; ``done`` ends the stream with OK.
    """

    declared: AudioFormat
    native_config: pb.StreamingConfig
    encoding_names: Mapping[AudioEncoding, str]
    separate_channels = False  # one native session per channel, results tagged 1..N
    stop_audio = False
    done = False

    def translate(self, response: pb.StreamingRecognizeResponse, channel_tag: int = 0) -> Iterable[Any]:
        """The foreign responses for a native one; ``channel_tag``: its channel (1..N) with separate
        recognition per channel, else 0."""
        raise NotImplementedError


class StreamAdapter:
    """A foreign ``StreamingRecognize`` served by the native servicer."""

    translation: ClassVar[type[Translation]]
    early_codes: ClassVar[Mapping[grpc.StatusCode, grpc.StatusCode]] = MappingProxyType({})

    def __init__(self, servicer: CosyStreamServicer):
        self.servicer = servicer

    def open(self, first) -> Translation:
        return self.translation(first)

    async def StreamingRecognize(self, request_iterator, context):
        guard = AbortGuard(context, self.early_codes)
        audio = AudioInput(aiter(request_iterator), self.servicer.options.idle_timeout_s)
        token = current_token()
        try:
            translation = self.open(await audio.next_request())
            check_declared(translation.declared)
            wav = await audio.sniff()
            audio_format = resolve_format(translation.declared, wav, audio.empty, translation.encoding_names)
        except CompatError as err:
            log.debug("%s refused: %s %s", type(self).__name__, err.code.name, err.message)
            self.servicer.metrics.rejected(_REJECTED.get(err.code, "invalid_argument"))
            await guard.abort(err.code, err.message, err.trailing_metadata())
        if translation.separate_channels and audio_format.channels > 1:
            if audio_format.encoding in COMPRESSED:
                await guard.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"enable_separate_recognition_per_channel: a {translation.encoding_names[audio_format.encoding]}"
                    " stream is recognized downmixed; send LINEAR16 or MULAW for one session per channel",
                )
            async for foreign in self._per_channel(audio, audio_format, translation, guard, token):
                yield foreign
            return
        stream = NativeStream(self.servicer, audio.native_config(audio_format, translation.native_config), token)
        feeder = asyncio.ensure_future(audio.feed(stream, guard))
        responses = stream.responses()
        try:
            async for response in responses:
                for foreign in translation.translate(response):
                    guard.responded = True
                    yield foreign
                audio.stopped = translation.stop_audio
                if translation.done:
                    break
        except StreamEnded as ended:
            await guard.end(ended)
        finally:
            feeder.cancel()
            await responses.aclose()
            await asyncio.gather(feeder, return_exceptions=True)

    async def _per_channel(
        self, audio: AudioInput, audio_format: AudioFormat, translation: Translation, guard: AbortGuard, token
    ) -> AsyncIterator[Any]:
        """Separate recognition per channel: a native session per channel (each a session of its own,
        counted as one), their responses merged in the order they come, tagged with their channel. The
        stream ends when every channel's session has; the first to fail ends them all with its status."""
        config = translation.native_config
        config.encoding = int(audio_format.encoding)
        config.sample_rate_hz = audio_format.sample_rate_hz
        streams = [NativeStream(self.servicer, copy_config(config), token) for _ in range(audio_format.channels)]
        merged: asyncio.Queue = asyncio.Queue()

        async def run(tag: int, stream: NativeStream) -> None:
            try:
                async for response in stream.responses():
                    await merged.put((tag, response))
            except StreamEnded as ended:
                await merged.put((tag, ended))
            except BaseException as err:
                await merged.put((tag, err))
                raise

        tasks = [asyncio.ensure_future(audio.feed_channels(audio_format, streams, guard))]
        tasks += [asyncio.ensure_future(run(tag, stream)) for tag, stream in enumerate(streams, start=1)]
        try:
            running = len(streams)
            while running:
                tag, item = await merged.get()
                if isinstance(item, StreamEnded):
                    await guard.end(item)  # (raises unless OK)
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    for foreign in translation.translate(item, tag):
                        guard.responded = True
                        yield foreign
                    audio.stopped = translation.stop_audio
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def copy_config(config: pb.StreamingConfig) -> pb.StreamingConfig:
    """A copy of ``config`` (one per channel's session: each sets its own audio fields)."""
    copied = pb.StreamingConfig()
    copied.CopyFrom(config)
    return copied
