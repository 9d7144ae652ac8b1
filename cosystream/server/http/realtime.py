"""Realtime transcription over WebSocket, in the events of OpenAI's Realtime API (``intent=transcription``).

Client events: ``session.update`` with a transcription session (or the older
``transcription_session.update``), ``input_audio_buffer.append`` (base64 audio), ``.commit`` and ``.clear``.
Server events: ``session.created`` / ``.updated`` (or ``transcription_session.*``, for clients that speak the
older dialect: their ``OpenAI-Beta: realtime=v1`` header or first update says so),
``input_audio_buffer.speech_started`` / ``speech_stopped`` / ``committed`` / ``cleared``,
``conversation.item.input_audio_transcription.delta`` and ``.completed``, and ``error``.

Audio goes to a native stream (:class:`NativeStream`), opened at the first append after the session's
settings and closed by a commit or a clear, so a settings change takes effect at the next buffer. With
``server_vad`` turn detection (the default) every utterance the endpointer finds is an item: its speech
events, interims as deltas, and its final as ``completed``; a commit ends the utterance in progress. With
``turn_detection: null`` nothing ends by itself: a commit ends the buffer, and its item's ``completed`` is
the text of all of it.

Deltas: each ``delta`` extends the item's text, as OpenAI's do, while the interim only grows (greedy
decoding; beam search until it revises a word). When an interim revises earlier text, the delta event
carries ``"replace": true`` and ``delta`` is the whole new text. Every delta also carries ``transcript``, the
item's whole text so far, ``stability`` (the native result's: 1.0 when the text only grows) and ``latency``
(the server's timings, as in the native ``Latency``).

The session's settings (``session.update`` read, ``session.*`` described) are in ``realtime_settings.py``.
A connection opened with ``resumable=true`` survives a dropped WebSocket: ``realtime_resume.py``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
from collections import deque

import grpc
from aiohttp import WebSocketError, WSMsgType, web

from cosystream.server.auth import Token
from cosystream.server.http import HttpConfig
from cosystream.server.http.realtime_buffer import Buffer, new_id
from cosystream.server.http.realtime_resume import (
    PROGRESS_AUDIO_MS,
    PROGRESS_EVENTS,
    REPLAY_EVENTS,
    HeldConnections,
)
from cosystream.server.http.realtime_settings import EventError, Settings, apply_update, describe
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 2.0
"""How long a closing connection waits for its queued events to be sent."""
QUEUED_EVENTS = 256
"""Server events queued for a client that does not read them before the session stops reading its audio."""

# Statuses after which the connection cannot go on: closed with these WebSocket codes.
_FATAL = {
    grpc.StatusCode.UNAVAILABLE: 1012,  # service restart: retry on another server
    grpc.StatusCode.RESOURCE_EXHAUSTED: 1013,  # try again later
    grpc.StatusCode.PERMISSION_DENIED: 1008,  # policy violation
    grpc.StatusCode.UNAUTHENTICATED: 1008,
}


class RealtimeConnection:
    """One WebSocket's transcription session; ``held``: where it is held when its WebSocket drops (None: not
    resumable, it ends with its WebSocket)."""

    def __init__(
        self,
        servicer: CosyStreamServicer,
        ws: web.WebSocketResponse,
        token: Token | None,
        beta: bool,
        idle_timeout_s: float | None = None,  # None: HttpConfig's default; 0: never
        held: HeldConnections | None = None,
    ):
        self.servicer = servicer
        self.ws: web.WebSocketResponse | None = ws  # (None while held)
        self.token = token
        self.beta = beta
        self.session_id = new_id("sess")
        self.settings = Settings()
        self.buffer: Buffer | None = None  # receiving audio
        self.buffers: set[Buffer] = set()  # all with a native stream open (finishing ones too)
        self.ended_ms = 0.0  # audio of the buffers before the current one
        self.last_item: str | None = None
        self.closing: tuple[int, str] | None = None
        # Every event emitted, numbered 1, 2, ... (the last REPLAY_EVENTS kept as sent: event_id, JSON), and
        # one writer per WebSocket sending them in order.
        self.emitted = 0
        self._events: deque[tuple[str, str]] = deque(maxlen=REPLAY_EVENTS)
        self._wake = asyncio.Event()
        self._written = 0  # the last event the writer sent
        self._backlog_from = 0  # (events before this one are a resume's replay, not a client falling behind)
        self._close_at: int | None = None  # the last event sent before the close
        self._writer: asyncio.Task | None = None
        self._closer: asyncio.Task | None = None
        self.idle_timeout_s = HttpConfig().ws_idle_timeout_s if idle_timeout_s is None else idle_timeout_s
        self._active_s = 0.0  # the loop's time of the last event either way
        # Resume (realtime_resume.py): the client's messages taken (and how many of a resume's to skip), what
        # the client was last told, and while held, the expiry timer.
        self.held = held
        self.resume_token = held.add(self) if held is not None else ""
        self.received_events = 0
        self.skip_events = 0
        self.replay_from = 0  # the first WebSocket is sent every event; a resumed one those after this
        self._reported = (0, 0.0)  # (client events, audio ms) as last told
        self.expiry: asyncio.TimerHandle | None = None
        self._parked = asyncio.Event()  # set while held: no WebSocket carries the connection
        self.ended = False
        self._handler: asyncio.Task | None = None  # the task serving the current WebSocket
        self._receiving = False  # (it waits for the client's next message)
        self._letting_go = False  # a resume takes the connection from its current WebSocket

    @property
    def detached(self) -> bool:
        return self._parked.is_set()

    @detached.setter
    def detached(self, value: bool) -> None:
        self._parked.set() if value else self._parked.clear()

    @property
    def audio_ms(self) -> float:
        """The connection's audio so far (every buffer's)."""
        return self.ended_ms + (self.buffer.audio_ms if self.buffer is not None else 0.0)

    # Server events, in order, through one writer.
    def emit(self, event: dict) -> None:
        self._active_s = asyncio.get_running_loop().time()
        event.setdefault("event_id", new_id("event"))
        event = {"type": event.pop("type"), "event_id": event.pop("event_id"), **event}
        self.emitted += 1
        self._events.append((event["event_id"], json.dumps(event)))
        self._wake.set()
        if self.ws is not None and self.emitted - max(self._written, self._backlog_from) > QUEUED_EVENTS:
            log.info("realtime session %s: the client reads no events; closing", self.session_id)
            self.close(1008, "the client does not read its events")

    def event_index(self, event_id: str) -> int | None:
        """The number of the kept event ``event_id`` (None: not one of them)."""
        for back, (kept_id, _) in enumerate(reversed(self._events)):
            if kept_id == event_id:
                return self.emitted - back
        return None

    async def _write(self, ws: web.WebSocketResponse, after: int) -> None:
        """Send ``ws`` the events after number ``after``, as they come, to the close."""
        self._written = after
        with contextlib.suppress(ConnectionError, RuntimeError):
            while True:
                last = self.emitted if self._close_at is None else self._close_at
                while self._written < last:
                    first = self.emitted - len(self._events) + 1
                    await ws.send_str(self._events[self._written + 1 - first][1])
                    self._written += 1
                if self._close_at is not None:
                    return
                self._wake.clear()
                await self._wake.wait()

    def error(self, message: str, code: str, param: str | None = None, event_id: str | None = None) -> None:
        kind = "invalid_request_error" if code not in ("server_error", "internal") else "server_error"
        self.emit(
            {
                "type": "error",
                "error": {"type": kind, "code": code, "message": message, "param": param, "event_id": event_id},
            }
        )

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """A native stream ended with ``code``: say so; close the connection if it cannot go on."""
        self.error(message, code.name.lower() if code != grpc.StatusCode.INTERNAL else "server_error")
        if code in _FATAL:
            self.close(_FATAL[code], message)

    def close(self, code: int, reason: str) -> None:
        """Send what is queued, then close the WebSocket with ``code`` (the client's reading ends). A held
        connection has no WebSocket to tell: it ends."""
        if self.closing is None:
            self.closing = (code, reason[:120])
            self._close_at = self.emitted
            self._wake.set()
            if self.detached:
                log.info("realtime session %s ended while held: %s", self.session_id, reason)
                self.end()
                return
            self._closer = asyncio.get_running_loop().create_task(self._close())

    async def _close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self._writer), CLOSE_WAIT_S)
        code, reason = self.closing
        if self.ws is not None:
            await self.ws.close(code=code, message=reason.encode())

    def buffer_done(self, buffer: Buffer) -> None:
        self.buffers.discard(buffer)
        if self.buffer is buffer:
            self._end_buffer()

    def _end_buffer(self) -> None:
        if self.buffer is not None:
            self.ended_ms += self.buffer.audio_ms
            self.buffer = None

    async def _watch_idle(self) -> None:
        """Close the connection once no event has passed either way for ``idle_timeout_s``: a client that
        sends nothing and is sent nothing holds a connection (and perhaps a slot) for no one. A client
        waiting for the results of audio it sent is not idle while they come, nor while a buffer it
        committed is still being finished (its answer is owed)."""
        loop = asyncio.get_running_loop()
        while self.closing is None:
            if any(buffer is not self.buffer for buffer in self.buffers):
                self._active_s = loop.time()
            left_s = self._active_s + self.idle_timeout_s - loop.time()
            if left_s > 0:
                await asyncio.sleep(left_s)
                continue
            message = f"no event either way for {self.idle_timeout_s:g} s: the idle session is closed"
            log.info("realtime session %s: idle for %g s; closing", self.session_id, self.idle_timeout_s)
            self.error(message, "idle_timeout")
            self.close(1000, f"idle for {self.idle_timeout_s:g} s")

    async def serve(self) -> None:
        """Serve the connection's first WebSocket."""
        name = "transcription_session.created" if self.beta else "session.created"
        self.emit({"type": name, "session": self._describe(self.beta)})
        if self.resume_token:
            self.emit(
                {
                    "type": "cosystream.session.resumable",
                    "resume_token": self.resume_token,
                    "resume_window_s": self.held.window_s,
                }
            )
        await self._serve()

    async def resume(self, ws: web.WebSocketResponse) -> None:
        """Serve a WebSocket that resumed the connection (``HeldConnections.take`` checked it): the events after
        ``replay_from`` again, then on; the first ``skip_events`` of its messages the server has already."""
        self.ws = ws
        self.emit(
            {
                "type": "cosystream.session.resumed",
                "resume_token": self.resume_token,
                "client_events": self.received_events,
                "replayed_events": self.emitted - self.replay_from,
                "audio_ms": round(self.audio_ms),
            }
        )
        await self._serve()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        ws = self.ws
        self._handler, self._letting_go = asyncio.current_task(), False
        self._backlog_from = self.emitted
        self._active_s = loop.time()
        self._writer = loop.create_task(self._write(ws, self.replay_from))
        watchdog = loop.create_task(self._watch_idle()) if self.idle_timeout_s > 0 else None
        dropped = True  # (cancelled: aiohttp cancels the handler of a connection that is lost)
        try:
            while self.closing is None and not self._letting_go:
                self._receiving = True
                try:
                    message = await ws.receive()
                finally:
                    self._receiving = False
                if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    self._active_s = loop.time()
                    await self._message(message)
                elif message.type not in (WSMsgType.PING, WSMsgType.PONG):
                    # A close frame ends the session, as does a protocol error; EOF or a reset is a drop.
                    dropped = message.type == WSMsgType.CLOSED or (
                        message.type == WSMsgType.ERROR and not isinstance(message.data, WebSocketError)
                    )
                    break
        finally:
            if watchdog is not None:
                watchdog.cancel()
            self._handler = None
            if self.held is not None and dropped and self.closing is None and not self.ended:
                self._park()
            else:
                await self._finish()

    async def _message(self, message) -> None:
        """The client's next message (one a resume's client sends again, and the server has, is skipped)."""
        if self.skip_events:
            self.skip_events -= 1
            return
        if message.type == WSMsgType.BINARY:
            self.error("send events as JSON text messages", "invalid_json")
        else:
            await self._event(message.data)
        self.received_events += 1
        if self.resume_token:
            events, audio_ms = self._reported
            if self.audio_ms - audio_ms >= PROGRESS_AUDIO_MS or self.received_events - events >= PROGRESS_EVENTS:
                self._reported = (self.received_events, self.audio_ms)
                self.emit(
                    {
                        "type": "cosystream.session.received",
                        "client_events": self.received_events,
                        "audio_ms": round(self.audio_ms),
                    }
                )

    def _park(self) -> None:
        """The WebSocket went away without a close: hold the connection (its buffers go on) for a resume."""
        if self._writer is not None:
            self._writer.cancel()
        self.ws = None
        self.detached = True
        self.held.park(self)

    async def let_go(self, timeout_s: float) -> bool:
        """A resume takes the connection from its WebSocket, which the server has not seen drop: stop reading it
        (after the message being handled) and hold the connection; True once held."""
        self._letting_go = True
        if self._receiving and self._handler is not None:
            self._handler.cancel()
        try:
            await asyncio.wait_for(self._parked.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def end(self) -> None:
        """Free a held connection (not resumed in time, ended meanwhile, the server stops): its buffers' native
        streams are dropped, their slots freed."""
        self.ended = True
        if self.held is not None:
            self.held.forget(self)
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        for buffer in list(self.buffers):
            buffer.task.cancel()

    async def _finish(self) -> None:
        """The client left (or the server closes): buffers still open are dropped, their slots freed."""
        self.ended = True
        if self.held is not None:
            self.held.forget(self)
        for buffer in list(self.buffers):
            buffer.task.cancel()
        for buffer in list(self.buffers):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await buffer.task
        if self.closing is None:
            self.close(1000, "")
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._closer

    def _describe(self, beta: bool) -> dict:
        return describe(self.settings, self.session_id, self.servicer.options.default_endpointing, beta)

    async def _event(self, text: str) -> None:
        event_id = None
        try:
            try:
                event = json.loads(text)
            except json.JSONDecodeError as err:
                raise EventError(f"the event is not JSON: {err}", "invalid_json") from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise EventError("an event is a JSON object with a string 'type'", "invalid_event", "type")
            event_id = event.get("event_id")
            await self._handle(event["type"], event)
        except EventError as err:
            self.error(err.message, err.code, err.param, event_id)

    async def _handle(self, kind: str, event: dict) -> None:
        if kind in ("session.update", "transcription_session.update"):
            self.settings = apply_update(self.settings, event.get("session"), self.servicer)
            if self.buffer is not None and self.buffer.settings != self.settings:
                self.buffer.commit(asked=False)  # the new settings take effect at the next buffer
                self._end_buffer()
            beta = kind == "transcription_session.update"
            self.emit({"type": kind.replace(".update", ".updated"), "session": self._describe(beta)})
        elif kind == "input_audio_buffer.append":
            audio = event.get("audio")
            if not isinstance(audio, str):
                raise EventError(
                    "input_audio_buffer.append needs 'audio', base64 audio", "missing_required_parameter", "audio"
                )
            try:
                data = base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError):
                raise EventError("'audio' is not valid base64", "invalid_value", "audio") from None
            if self.settings.encoding == pb.LINEAR16 and len(data) % 2:
                raise EventError(
                    f"'audio' holds an odd number of bytes ({len(data)}): 16-bit PCM is 2 bytes a sample, so "
                    "every append must hold whole samples",
                    "invalid_value",
                    "audio",
                )
            if self.buffer is None:
                self.buffer = Buffer(self, self.settings, self.ended_ms)
                self.buffers.add(self.buffer)
            await self.buffer.append(data)
        elif kind == "input_audio_buffer.commit":
            if self.buffer is None:
                raise EventError(
                    "the input audio buffer is empty: nothing to commit", "input_audio_buffer_commit_empty"
                )
            self.buffer.commit(event_id=event.get("event_id"))
            self._end_buffer()
        elif kind == "input_audio_buffer.clear":
            if self.buffer is not None:
                self.buffer.task.cancel()  # its results are dropped and its slot freed
                self._end_buffer()
            self.emit({"type": "input_audio_buffer.cleared"})
        else:
            raise EventError(
                f"event type {kind!r} is not supported in a transcription session (session.update, "
                "input_audio_buffer.append, input_audio_buffer.commit, input_audio_buffer.clear)",
                "invalid_event_type",
                "type",
            )
