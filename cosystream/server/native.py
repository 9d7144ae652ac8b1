"""A native stream opened in-process: how the HTTP and the Google / Riva adapters run a session without a gRPC
call.

:class:`NativeStream` validates a ``StreamingConfig``, has the frontend's host (``frontend/host.py``) admit
and open its session, and feeds it what :meth:`~NativeStream.send_audio` and the others queue (a bounded
queue: a sender faster than its session is read waits, as gRPC flow control would make it). The responses
come out of :meth:`~NativeStream.responses` as the wire API's messages; the stream's end is a
:class:`StreamEnded` with the status (OK after the last final of a half-closed stream). Everything the native
API does holds: validation, admission, quotas, endpointing, idle timeouts, drain, the engine slot freed on
every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import grpc

from cosystream.frontend.live import DONE, LiveSession
from cosystream.frontend.results import Response
from cosystream.frontend.status import Ended, Refused, Status, draining
from cosystream.server.auth import Token
from cosystream.server.messages import STATUS_CODES, response_message
from cosystream.server.servicer import CosyStreamServicer, session_config
from cosystream.v1 import cosystream_pb2 as pb

log = logging.getLogger(__name__)

QUEUED_REQUESTS = 64
"""Requests queued for the session before :meth:`NativeStream.send` waits (~0.6-32 s of audio)."""

_HALF_CLOSE = object()
_FINALIZE = object()


class _Refusal:
    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


class StreamEnded(Exception):
    """A native stream's end: its status ``code`` (OK: everything sent was transcribed) and message;
    ``retry_after_s``: a temporary refusal's delay (a token's audio quota), else None."""

    def __init__(self, code: grpc.StatusCode, message: str = "", retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, end: Ended) -> StreamEnded:
        return cls(STATUS_CODES[end.status], end.message, end.retry_after_s)


class NativeStream:
    """One session of ``servicer``'s host, driven from this process (a task of its event loop), for ``token``
    (None: authentication is off)."""

    def __init__(self, servicer: CosyStreamServicer, config: pb.StreamingConfig, token: Token | None):
        self._host = servicer
        self._config = config
        self._token = token
        self._queue: asyncio.Queue = asyncio.Queue(QUEUED_REQUESTS)
        self._answered = asyncio.Event()  # the config was accepted (a session id) or the stream ended
        self.session_id = ""
        self._closed = False

    async def accepted(self) -> bool:
        """Wait until the host has accepted the stream (its config checked, the token's quota claimed) or
        ended it; True if accepted. Lets a sender refuse before it spends work on audio (a refusal's status
        comes out of :meth:`responses`, which must be being read)."""
        await self._answered.wait()
        return bool(self.session_id) and not self._closed

    async def feed(self, blocks: Iterator[bytes]) -> None:
        """Once the stream is accepted, send each block ``blocks`` yields (it is advanced in an executor
        thread, so decoding runs off the loop), then half-close. An exception from ``blocks`` half-closes
        the stream where it got to, and is raised."""
        if not await self.accepted():
            return
        loop = asyncio.get_running_loop()
        try:
            while (block := await loop.run_in_executor(None, next, blocks, None)) is not None:
                await self.send_audio(block)
        finally:
            self.half_close()

    async def send_audio(self, audio: bytes) -> None:
        if audio and not self._closed:
            await self._queue.put(audio)

    async def finalize(self) -> None:
        """End the current utterance now (its final follows)."""
        if not self._closed:
            await self._queue.put(_FINALIZE)

    async def refuse(self, message: str) -> None:
        """End the session INVALID_ARGUMENT with ``message`` (a request its client may not send), after what was
        sent before it."""
        if not self._closed:
            self._closed = True
            await self._queue.put(_Refusal(message))

    def half_close(self) -> None:
        """No more requests: the stream ends OK after the final of everything sent."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(_HALF_CLOSE)
                return
            asyncio.get_running_loop().create_task(self._queue.put(_HALF_CLOSE))

    async def _open(self) -> LiveSession:
        host = self._host
        try:
            if host.draining:
                raise draining()
            config = await host.admit(session_config(host, self._config), self._token)
            return LiveSession(host, config, self._token)
        except Refused as refused:
            host.count_refusal(refused, self._token)
            raise StreamEnded.of(refused.ended) from None

    async def _read(self, stream: LiveSession) -> None:
        """Feed the session what was queued, to the half-close (then flush to its last final)."""
        try:
            while True:
                await stream.wait_for_room()
                item = await self._queue.get()
                if item is _HALF_CLOSE:
                    break
                if isinstance(item, _Refusal):
                    stream.fail(Status.INVALID_ARGUMENT, item.message)
                    return
                stream.heard()
                if not (stream.finalize() if item is _FINALIZE else await stream.feed(item)):
                    return  # (the session reads no more)
            stream.finish()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "session %s: reading requests failed", stream.session_id, extra={"session_id": stream.session_id}
            )
            stream.fail(Status.INTERNAL, "the server failed to process the audio")

    async def responses(self) -> AsyncIterator[pb.StreamingRecognizeResponse]:
        """The stream's responses; ends by raising :class:`StreamEnded` (OK included)."""
        try:
            stream = await self._open()
        except BaseException:
            self._answered.set()
            raise
        host = self._host
        try:
            host.start(stream)
            self.session_id = stream.session_id
            self._answered.set()
            stream.attach(asyncio.create_task(self._read(stream)))
            while (item := await stream.responses.get()) is not DONE:
                if isinstance(item, Ended):
                    stream.outcome = item.status.name
                    raise StreamEnded.of(item)
                if isinstance(item, Response):
                    yield response_message(item)
        except Refused as refused:  # by the token's quotas
            stream.outcome = refused.status.name
            host.count_refusal(refused, stream.token)
            raise StreamEnded.of(refused.ended) from None
        except (asyncio.CancelledError, GeneratorExit):
            stream.outcome = "cancelled"
            raise
        finally:
            self._closed = True
            self._answered.set()
            host.close(stream)
        raise StreamEnded(grpc.StatusCode.OK)
