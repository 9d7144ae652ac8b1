"""``POST /v1/audio/transcriptions`` in OpenAI's shape: a whole file transcribed as one BATCH session.

The multipart form takes ``file`` (WAV, FLAC, OGG or MP3 at 8-48 kHz, up to ``--max-upload-audio-s`` long by
its header; :mod:`cosystream.audio.files`), ``model``,
``language``, ``prompt`` (its words boosted: ``common.prompt_phrases``), ``response_format`` (``json``,
``text``, ``srt``, ``vtt``, ``verbose_json``), ``timestamp_granularities[]`` (``segment``, ``word``;
with ``verbose_json``), ``temperature`` (accepted, unused: decoding is deterministic) and ``stream``
(server-sent events ``transcript.text.delta`` per utterance, then ``transcript.text.done``). Segments are
the utterances the endpointer found; their text is each utterance's final.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass

from aiohttp import BodyPartReader, web

from cosystream.audio.files import AudioFile, AudioInfo, AudioTooLong, UndecodableAudio, open_audio
from cosystream.priority import Priority
from cosystream.server.auth import Token
from cosystream.server.http.common import check_language, native_model, prompt_phrases, seconds
from cosystream.server.http.errors import ApiError, from_status
from cosystream.server.native import NativeStream, StreamEnded
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

log = logging.getLogger(__name__)

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
FEED_FRAMES = 16_000
"""Samples decoded and handed to the session per request (1 s at 16 kHz)."""
FIELD_BYTES = 64 << 10
"""The longest form field other than the file."""


@dataclass(slots=True)
class Form:
    file: bytes = b""
    filename: str = ""
    model: str = ""
    language: str = ""
    prompt: str = ""
    response_format: str = "json"
    granularities: tuple[str, ...] = ()
    stream: bool = False


async def read_form(request: web.Request, max_file_bytes: int) -> Form:
    """The multipart form; raises :class:`ApiError` (400 for a bad form, 413 for a file over the limit)."""
    too_large = ApiError(
        413,
        f"the file is larger than this server's limit of {max_file_bytes} bytes; split it",
        "file_too_large",
        "file",
    )
    if request.content_length is not None and request.content_length > max_file_bytes + FIELD_BYTES:
        raise too_large
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "send the request as multipart/form-data with the audio in the 'file' field", None)
    form = Form()
    granularities: list[str] = []
    seen_file = False
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise ApiError(400, "nested multipart parts are not supported")
            name = part.name or ""
            if name == "file":
                seen_file = True
                form.filename = part.filename or ""
                data = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    data += chunk
                    if len(data) > max_file_bytes:
                        raise too_large
                form.file = bytes(data)
                continue
            value = (await part.read(decode=True))[:FIELD_BYTES].decode("utf-8", "replace").strip()
            if name == "model":
                form.model = value
            elif name == "language":
                form.language = value
            elif name == "prompt":
                form.prompt = value
            elif name == "response_format":
                form.response_format = value or "json"
            elif name in ("timestamp_granularities[]", "timestamp_granularities"):
                granularities.append(value)
            elif name == "stream":
                form.stream = value.lower() in ("true", "1")
            # temperature, chunking_strategy, include[] and others: accepted and not used
    except ValueError as err:  # a malformed multipart body
        raise ApiError(400, f"the multipart form could not be read: {err}") from None
    if not seen_file:
        raise ApiError(400, "the form has no 'file' field: attach the audio as 'file'", None, "file")
    if form.response_format not in RESPONSE_FORMATS:
        raise ApiError(
            400,
            f"response_format {form.response_format!r} is not supported: use {', '.join(RESPONSE_FORMATS)}",
            None,
            "response_format",
        )
    for granularity in granularities:
        if granularity not in GRANULARITIES:
            raise ApiError(
                400,
                f"timestamp_granularities[] {granularity!r}: use {' or '.join(GRANULARITIES)}",
                None,
                "timestamp_granularities",
            )
    form.granularities = tuple(granularities)
    if form.stream and form.response_format not in ("json", "text"):
        raise ApiError(400, "stream=true takes response_format json or text", None, "stream")
    return form


class Transcriber:
    """The handler of ``POST /v1/audio/transcriptions``."""

    def __init__(self, servicer: CosyStreamServicer, max_file_bytes: int, max_audio_s: float):
        self.servicer = servicer
        self.max_file_bytes = max_file_bytes
        self.max_audio_s = max_audio_s

    async def handle(self, request: web.Request, token: Token | None) -> web.StreamResponse:
        """The file's header is checked (rate, length) before anything is decoded, and the session is
        admitted (the token's quota, the engine's room) before the audio is: then it is decoded a second
        at a time into the session, so memory stays flat whatever the file claims."""
        form = await read_form(request, self.max_file_bytes)
        model = native_model(self.servicer, form.model)
        language = check_language(self.servicer, form.language)
        try:
            audio = await asyncio.get_running_loop().run_in_executor(None, open_audio, form.file, self.max_audio_s)
        except UndecodableAudio as err:
            code = "audio_too_long" if isinstance(err, AudioTooLong) else "invalid_audio"
            raise ApiError(400, f"{form.filename or 'file'}: {err}", code, "file") from None
        config = pb.StreamingConfig(
            encoding=pb.LINEAR16,
            sample_rate_hz=audio.info.sample_rate_hz,
            priority=Priority.BATCH,
            model=model,
            enable_word_time_offsets=True,
            enable_automatic_punctuation=True,  # (OpenAI's transcriptions are written text)
            phrases=prompt_phrases(self.servicer, model, form.prompt),
        )
        stream = NativeStream(self.servicer, config, token)
        feeder = asyncio.get_running_loop().create_task(stream.feed(_pcm16(audio)))
        try:
            if form.stream:
                return await self._stream_events(request, stream, audio.info, feeder)
            finals = [result async for result in _finals(stream, feeder)]
        finally:
            feeder.cancel()
        return render(form, finals, audio.info, language)

    async def _stream_events(
        self, request: web.Request, stream: NativeStream, audio: AudioInfo, feeder: asyncio.Task
    ) -> web.StreamResponse:
        """Server-sent events: a delta per utterance's final, then the whole text."""
        results = _finals(stream, feeder)
        try:
            first = await anext(results)  # errors before the first event are HTTP errors
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        texts: list[str] = []

        async def event(body: dict) -> None:
            await response.write(f"data: {json.dumps(body)}\n\n".encode())

        async def delta(result: pb.StreamingResult) -> None:
            if result.transcript:
                await event(
                    {
                        "type": "transcript.text.delta",
                        "delta": (" " if texts else "") + result.transcript,
                        "logprobs": None,
                    }
                )
                texts.append(result.transcript)

        try:
            if first is not None:
                await delta(first)
                async for result in results:
                    await delta(result)
            await event(
                {"type": "transcript.text.done", "text": " ".join(texts), "logprobs": None, "usage": _usage(audio)}
            )
        except ApiError as err:  # the status after the headers went out: an error event, as OpenAI's streams do
            await event({"type": "error", **err.body()})
        await response.write_eof()
        return response


async def _finals(stream: NativeStream, feeder: asyncio.Task):
    """The stream's final results in order; raises :class:`ApiError` if it ends with another status than OK,
    or if the feeder found the file damaged part-way."""
    try:
        async for response in stream.responses():
            for result in response.results:
                if result.is_final:
                    yield result
    except StreamEnded as ended:
        if ended.code.name != "OK":
            raise from_status(ended.code, ended.message, ended.retry_after_s) from None
    if feeder.done() and not feeder.cancelled() and (err := feeder.exception()) is not None:
        if isinstance(err, UndecodableAudio):
            raise ApiError(400, f"file: {err}", "invalid_audio", "file") from None
        raise err


def _pcm16(audio: AudioFile):
    """The file as LINEAR16 requests' audio, decoded a block at a time (an undecodable block raises
    :class:`UndecodableAudio`, which :func:`_finals` turns into a 400)."""
    for block in audio.blocks(FEED_FRAMES):
        yield block.astype("<i2", copy=False).tobytes()


def _usage(audio: AudioInfo) -> dict:
    return {"type": "duration", "seconds": math.ceil(audio.duration_s)}


def render(form: Form, finals: list[pb.StreamingResult], audio: AudioInfo, language: str) -> web.Response:
    spoken = [result for result in finals if result.transcript]
    text = " ".join(result.transcript for result in spoken)
    if form.response_format == "text":
        return web.Response(text=text + "\n", content_type="text/plain")
    if form.response_format == "srt":
        return web.Response(text=subtitles(spoken, srt=True), content_type="application/x-subrip")
    if form.response_format == "vtt":
        return web.Response(text=subtitles(spoken, srt=False), content_type="text/vtt")
    if form.response_format == "json":
        return web.json_response({"text": text, "usage": _usage(audio)})
    body: dict = {
        "task": "transcribe",
        "language": _LANGUAGE_NAMES.get(language.split("-")[0].lower(), language),
        "duration": round(audio.duration_s, 3),
        "text": text,
    }
    if not form.granularities or "segment" in form.granularities:
        body["segments"] = [
            {
                "id": index,
                "seek": 0,
                "start": seconds(result.start_ms),
                "end": seconds(result.end_ms),
                "text": " " + result.transcript,
                "tokens": [],
                "temperature": 0.0,
                "avg_logprob": round(math.log(max(result.confidence, 1e-6)), 4),
                "compression_ratio": 1.0,
                "no_speech_prob": 0.0,
            }
            for index, result in enumerate(spoken)
        ]
    if "word" in form.granularities:
        body["words"] = [
            {"word": word.word, "start": seconds(word.start_ms), "end": seconds(word.end_ms)}
            for result in spoken
            for word in result.words
        ]
    body["usage"] = _usage(audio)
    return web.json_response(body)


_LANGUAGE_NAMES = {"en": "english"}  # verbose_json names the language as Whisper does


def subtitles(results: list[pb.StreamingResult], srt: bool) -> str:
    """SubRip (``srt``) or WebVTT cues, one per utterance."""
    separator = "," if srt else "."

    def stamp(ms: int) -> str:
        hours, rest = divmod(int(ms), 3_600_000)
        minutes, rest = divmod(rest, 60_000)
        secs, millis = divmod(rest, 1000)
        return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"

    cues = []
    for index, result in enumerate(results, 1):
        timing = f"{stamp(result.start_ms)} --> {stamp(result.end_ms)}"
        cues.append(f"{index}\n{timing}\n{result.transcript}\n" if srt else f"{timing}\n{result.transcript}\n")
    return "\n".join(cues) if srt else "WEBVTT\n\n" + "\n".join(cues)
