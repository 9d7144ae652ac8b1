"""Call audio over WebSocket from telephony platforms, transcribed live on the HTTP port.

Two endpoints, each a WebSocket the platform opens to us:

``/v1/media-streams/twilio``: Twilio Media Streams (``<Start><Stream>`` or ``<Connect><Stream>``), as in
https://www.twilio.com/docs/voice/media-streams/websocket-messages: JSON text messages ``connected``,
``start`` (``start.streamSid``, ``callSid``, ``tracks``, ``customParameters``, ``mediaFormat``: base64
``audio/x-mulaw`` at 8000 Hz, mono), ``media`` (``media.track`` ``inbound``/``outbound``, ``chunk``,
``timestamp``, ``payload``), ``dtmf`` (``dtmf.digit``), ``mark`` and ``stop``. Telnyx's media
streaming (https://developers.telnyx.com/docs/voice/programmable-voice/media-streaming) has the same
events with snake_case fields (``stream_id``, ``media_format``, ``call_control_id``; PCMU or PCMA):
they are read too.

``/v1/media-streams/audio-fork``: FreeSWITCH ``mod_audio_fork`` / ``mod_audio_stream`` and jambonz
``listen``: an optional first text message of JSON metadata (jambonz sends ``callSid``, ``from``,
``to``, ``sampleRate``, ``mixType``; FreeSWITCH whatever the ``uuid_audio_fork`` command's metadata
says; Vonage's WebSocket connection, ``{"event": "websocket:connected", "content-type":
"audio/l16;rate=16000"}``), then binary frames of 16-bit little-endian linear PCM at 8 or 16 kHz
(``sampleRate`` or the content type's rate in the metadata, else ``?sample_rate=``, default 8000), one channel, or two interleaved for ``mixType:
"stereo"`` / ``?channels=2`` (the caller left, the other party right).

Every track of a call (Twilio's ``inbound``/``outbound`` of ``both_tracks``, the two channels of a
stereo fork) is its own REALTIME session, so each side's transcript is labelled. Results go back on
the socket as JSON text messages, one per result::

    {"event": "transcript", "track": "inbound", "utterance_index": 0, "is_final": true,
     "text": "...", "start_ms": 480, "end_ms": 2120, "streamSid": "MZ...", "callSid": "CA..."}

(times from the track's first audio), DTMF digits as ``{"event": "dtmf", "track", "digit"}``, and, at
the end, ``{"event": "stopped", "tracks": {"inbound": {"audio_ms", "finals"}}}`` once every track's
last final is out: the stream's end (Twilio's ``stop``, the fork's close frame) half-closes the
sessions and nothing sent is lost. Twilio ignores what a ``<Start><Stream>`` socket is sent; a
``<Connect><Stream>`` (bidirectional) one should not be sent what Twilio does not know: ask such a
socket for ``?results=none``.

Tokens: with tokens on, the upgrade's ``Authorization`` header (``Bearer TOKEN``, or ``Basic`` with the
token as the password, as jambonz's ``wsAuth`` sends) or, since Twilio sends no header of ours, a
``token`` in Twilio's ``customParameters`` (``<Parameter name="token" value="..."/>``) or in the fork's
metadata. A socket that presents none is closed with 1008 at its first message.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from typing import Any

import grpc
import numpy as np
from aiohttp import WSMsgType, web

from cosystream.priority import Priority
from cosystream.server.auth import Token
from cosystream.server.native import NativeStream, StreamEnded
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1.webhook import WebhookPoster

log = logging.getLogger(__name__)

TWILIO_TRACKS = ("inbound", "outbound")
# mediaFormat.encoding (Twilio's MIME type; Telnyx's media_format.encoding names the codec)
MEDIA_ENCODINGS = {"audio/x-mulaw": pb.MULAW, "PCMU": pb.MULAW, "audio/x-alaw": pb.ALAW, "PCMA": pb.ALAW}
FORK_RATES = (8000, 16000)
FLUSH_TIMEOUT_S = 30.0
"""After the stream's end: how long its sessions may take to send their last finals."""
MAX_MESSAGE_BYTES = 1 << 20


class Refused(Exception):
    """The stream cannot go on: closed with ``code`` (a WebSocket close code) and the message."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _Track:
    """One side of the call: a native stream and the task that relays its results."""

    def __init__(self, socket: MediaSocket, name: str, config: pb.StreamingConfig, token: Token | None):
        self.name = name
        self.stream = NativeStream(socket.servicer, config, token)
        self.finals = 0
        self.sent_bytes = 0
        self.bytes_per_ms = (2 if config.encoding == pb.LINEAR16 else 1) * config.sample_rate_hz // 1000
        self.task = asyncio.get_running_loop().create_task(self._pump(socket))

    @property
    def audio_ms(self) -> int:
        return self.sent_bytes // self.bytes_per_ms

    async def send(self, audio: bytes) -> None:
        self.sent_bytes += len(audio)
        await self.stream.send_audio(audio)

    async def _pump(self, socket: MediaSocket) -> None:
        try:
            async for response in self.stream.responses():
                for result in response.results:
                    self.finals += result.is_final
                    socket.emit(
                        {
                            "event": "transcript",
                            "track": self.name,
                            "utterance_index": result.utterance_index,
                            "is_final": result.is_final,
                            "text": result.transcript,
                            "start_ms": result.start_ms,
                            "end_ms": result.end_ms,
                            **socket.ids,
                        }
                    )
        except StreamEnded as ended:
            if ended.code != grpc.StatusCode.OK:
                socket.fail(ended)


class MediaSocket:
    """One platform WebSocket: its tracks, the results written back, its end."""

    kind = ""

    def __init__(
        self,
        servicer: CosyStreamServicer,
        ws: web.WebSocketResponse,
        token: Token | None,
        authenticate,  # (token string) -> Token; raises on a wrong one
        tokens_on: bool,
        query: dict[str, str],
        webhook: WebhookPoster | None = None,
    ):
        self.servicer = servicer
        self.ws = ws
        self.token = token
        self._authenticate = authenticate
        self._needs_token = tokens_on and token is None
        self.send_results = query.get("results", "socket") != "none"
        self.interim = query.get("interim_results", "false").lower() in ("1", "true", "yes")
        self.query = query
        self.webhook = webhook
        self.tracks: dict[str, _Track] = {}
        self.ids: dict[str, str] = {}
        self.started = time.monotonic()
        self._outbox: asyncio.Queue[dict | None] = asyncio.Queue()
        self._failed: StreamEnded | None = None
        self._writer: asyncio.Task | None = None
        self.ended = False  # the platform said the stream is over (Twilio's stop)

    # What subclasses call.
    def config(self, encoding: int, rate_hz: int) -> pb.StreamingConfig:
        return pb.StreamingConfig(
            encoding=encoding,
            sample_rate_hz=rate_hz,
            priority=Priority.REALTIME,
            interim_results=self.interim,
            enable_automatic_punctuation=True,
        )

    def open_track(self, name: str, config: pb.StreamingConfig) -> _Track:
        track = self.tracks[name] = _Track(self, name, config, self.token)
        return track

    def check_token(self, presented: Any) -> None:
        """The token of the first message, when the upgrade had none and tokens are on."""
        if not self._needs_token:
            return
        if not isinstance(presented, str) or not presented:
            raise Refused(1008, "this server needs a token: an Authorization header, or a 'token' parameter")
        try:
            self.token = self._authenticate(presented)
        except Exception as err:  # (ApiError: its message names the problem)
            raise Refused(1008, str(getattr(err, "message", err))) from None
        self._needs_token = False

    def emit(self, message: dict) -> None:
        if self.send_results or message.get("event") == "error":
            self._outbox.put_nowait(message)
        if self.webhook is not None and message.get("event") != "error":
            self.webhook.post(message)

    def fail(self, ended: StreamEnded) -> None:
        if self._failed is None:
            self._failed = ended
            self.emit({"event": "error", "code": ended.code.name, "message": ended.message})

    # The connection.
    async def serve(self) -> None:
        self._writer = asyncio.get_running_loop().create_task(self._write())
        close_code, reason = 1000, ""
        try:
            async for message in self.ws:
                if message.type == WSMsgType.TEXT:
                    await self.on_text(message.data)
                elif message.type == WSMsgType.BINARY:
                    await self.on_binary(message.data)
                else:
                    break
                if self._failed is not None or self.ended:
                    break
        except Refused as err:
            close_code, reason = err.code, str(err)
            code = "INVALID_ARGUMENT" if err.code == 1003 else "UNAUTHENTICATED"
            self.emit({"event": "error", "code": code, "message": reason})
            log.warning("%s stream %s refused: %s", self.kind, self.ids or "(no ids)", reason)
        finally:
            # (Cancelled here, by a connection lost, the half-closed sessions still end on their own.)
            try:
                await self._finish()
                if self._failed is not None and close_code == 1000:
                    close_code = 1011
                    reason = f"{self._failed.code.name}: {self._failed.message}"
                self._outbox.put_nowait(None)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._writer, 5.0)
                await self.ws.close(code=close_code, message=reason[:120].encode())
            finally:
                self._writer.cancel()

    async def on_text(self, data: str) -> None:
        raise NotImplementedError

    async def on_binary(self, data: bytes) -> None:
        raise NotImplementedError

    async def _finish(self) -> None:
        """Half-close every track and wait (bounded) for their last finals."""
        for track in self.tracks.values():
            track.stream.half_close()
        tasks = [track.task for track in self.tracks.values()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=FLUSH_TIMEOUT_S)
            for task in pending:
                task.cancel()
        summary = {name: {"audio_ms": t.audio_ms, "finals": t.finals} for name, t in self.tracks.items()}
        self.emit({"event": "stopped", "tracks": summary, **self.ids})
        log.info(
            "%s stream %s ended after %.1f s: %s",
            self.kind,
            self.ids.get("streamSid") or self.ids.get("callSid") or "-",
            time.monotonic() - self.started,
            ", ".join(f"{n} {t.audio_ms / 1000:.1f} s of audio, {t.finals} finals" for n, t in self.tracks.items())
            or "no audio",
        )

    async def _write(self) -> None:
        while (message := await self._outbox.get()) is not None:
            if self.ws.closed:
                continue
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(json.dumps(message))


def _json(data: str) -> dict:
    try:
        message = json.loads(data)
    except ValueError:
        raise Refused(1003, "a text message that is not JSON") from None
    if not isinstance(message, dict):
        raise Refused(1003, "a text message that is not a JSON object")
    return message


class TwilioStream(MediaSocket):
    """Twilio Media Streams' messages (the module's docstring)."""

    kind = "Twilio"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.encoding: int | None = None  # set by the start message

    async def on_text(self, data: str) -> None:
        message = _json(data)
        event = message.get("event")
        if event == "connected":
            return
        if event == "start":
            await self._start(message)
        elif event == "media":
            await self._media(message.get("media") or {})
        elif event == "dtmf":
            dtmf = message.get("dtmf") or {}
            digit = str(dtmf.get("digit", ""))
            self.emit({"event": "dtmf", "track": dtmf.get("track", ""), "digit": digit, **self.ids})
        elif event == "stop":
            self.ended = True
        elif event == "mark":
            pass
        else:
            raise Refused(
                1003, f"unknown event {event!r} (Twilio sends connected, start, media, dtmf, mark, stop)"
            )

    async def on_binary(self, data: bytes) -> None:
        raise Refused(1003, "Twilio Media Streams send text messages only")

    async def _start(self, message: dict) -> None:
        start = message.get("start") or {}
        if self.tracks or self.encoding is not None:
            raise Refused(1003, "a second start message")
        parameters = start.get("customParameters") or start.get("custom_parameters") or {}
        self.check_token(parameters.get("token") if isinstance(parameters, dict) else None)
        stream = start.get("streamSid") or message.get("streamSid") or message.get("stream_id", "")
        call = start.get("callSid") or start.get("call_control_id", "")
        self.ids = {"streamSid": str(stream), "callSid": str(call)}
        media_format = start.get("mediaFormat") or start.get("media_format") or {}
        encoding = MEDIA_ENCODINGS.get(str(media_format.get("encoding", "audio/x-mulaw")))
        rate = media_format.get("sampleRate", media_format.get("sample_rate", 8000))
        if encoding is None or rate != 8000 or media_format.get("channels", 1) != 1:
            raise Refused(
                1003,
                f"mediaFormat {media_format}: this endpoint takes audio/x-mulaw (or PCMU, PCMA), 8000 Hz, 1 channel",
            )
        self.encoding = encoding
        tracks = start.get("tracks") or ["inbound"]
        for name in tracks:
            self._track(name)
        log.info("Twilio stream %s of call %s: tracks %s", self.ids["streamSid"], self.ids["callSid"], tracks)

    def _track(self, name: object) -> _Track:
        """The track ``name``, opened at its first mention (Twilio's start lists them; Telnyx's does not)."""
        if name not in TWILIO_TRACKS:
            raise Refused(1003, f"track {name!r} (the tracks are inbound and outbound)")
        track = self.tracks.get(name)
        return track if track is not None else self.open_track(name, self.config(self.encoding, 8000))

    async def _media(self, media: dict) -> None:
        if self.encoding is None:
            raise Refused(1003, "a media message before the start message")
        track = self._track(media.get("track", "inbound"))
        try:
            audio = base64.b64decode(media.get("payload", ""), validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise Refused(1003, "a media payload that is not base64") from None
        await track.send(audio)


class AudioForkStream(MediaSocket):
    """FreeSWITCH mod_audio_fork / jambonz listen (the module's docstring)."""

    kind = "audio fork"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.metadata: dict = {}
        self.channels = 0

    async def on_text(self, data: str) -> None:
        if self.tracks:
            return  # later text messages (jambonz sends none; mod_audio_fork may send more metadata)
        self.metadata = _json(data)
        self._open()

    async def on_binary(self, data: bytes) -> None:
        if not self.tracks:
            self._open()
        if len(data) % (2 * self.channels):
            raise Refused(
                1003, f"a frame of {len(data)} bytes is not whole {self.channels}-channel 16-bit samples"
            )
        if self.channels == 1:
            await self.tracks["inbound"].send(data)
            return
        samples = np.frombuffer(data, dtype="<i2").reshape(-1, 2)
        await self.tracks["inbound"].send(samples[:, 0].tobytes())
        await self.tracks["outbound"].send(samples[:, 1].tobytes())

    def _open(self) -> None:
        self.check_token(self.metadata.get("token"))
        rate = self.metadata.get("sampleRate", self.query.get("sample_rate", 8000))
        content_type = str(self.metadata.get("content-type", ""))  # Vonage: "audio/l16;rate=16000"
        if content_type.lower().startswith("audio/l16") and "rate=" in content_type:
            rate = content_type.split("rate=", 1)[1].split(";", 1)[0]
        try:
            rate = int(rate)
        except (TypeError, ValueError):
            rate = 0
        if rate not in FORK_RATES:
            raise Refused(1003, f"sampleRate {rate}: the audio fork endpoint takes 8000 or 16000 Hz L16")
        mix = str(self.metadata.get("mixType", "")).lower()
        channels = 2 if mix == "stereo" else 1 if mix else self.query.get("channels", "1")
        if str(channels) not in ("1", "2"):
            raise Refused(1003, f"channels {channels}: 1 (mono or mixed) or 2 (stereo)")
        self.channels = int(channels)
        self.ids = {key: str(self.metadata[key]) for key in ("callSid", "callId", "uuid") if key in self.metadata}
        for name in ("inbound", "outbound")[: self.channels]:
            self.open_track(name, self.config(pb.LINEAR16, rate))
        log.info("audio fork stream %s: %d Hz, %d channel(s)", self.ids or "-", rate, self.channels)
