"""A native stream opened in-process: how the HTTP adapters use the servicer without a gRPC call.

:class:`NativeStream` hands ``CosyStreamServicer.StreamingRecognize`` an async iterator of requests fed by
:meth:`~NativeStream.send` (a bounded queue: a sender faster than its session is read waits, as gRPC flow
control would make it) and a servicer context whose ``abort`` raises :class:`StreamEnded`. The responses
come out of :meth:`~NativeStream.responses`; the stream's end is a :class:`StreamEnded` with the status
(OK after the last final of a half-closed stream). Everything the native API does holds: validation,
admission, quotas, endpointing, idle timeouts, drain, the engine slot freed on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc

from cosystream.server.auth import Token, use_token
from cosystream.server.retry import retry_after_s
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

QUEUED_REQUESTS = 64
"""Requests queued for the servicer before :meth:`NativeStream.send` waits (~0.6-32 s of audio)."""

_HALF_CLOSE = object()


class StreamEnded(Exception):
    """A native stream's end: its status ``code`` (OK: everything sent was transcribed) and message;
    ``retry_after_s``: a temporary refusal's delay (a token's audio quota), else None."""

    def __init__(self, code: grpc.StatusCode, message: str = "", retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class _Context:
    """The part of a ``grpc.aio.ServicerContext`` the servicer uses."""

    def __init__(self):
        self.session_id = ""
        self.answered = asyncio.Event()  # the config was accepted (a session id) or the stream ended

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self.answered.set()
        raise StreamEnded(code, details, retry_after_s(trailing_metadata))

    async def send_initial_metadata(self, metadata) -> None:
        self.session_id = dict(metadata).get("cosystream-session-id", "")
        self.answered.set()


class NativeStream:
    """One ``StreamingRecognize`` of ``servicer``, driven from this process (a task of its event loop).

    Call :meth:`responses` from the task (or a task started by it) that should carry ``token``: the servicer
    reads the caller's token from the task's context.
    """

    def __init__(self, servicer: CosyStreamServicer, config: pb.StreamingConfig, token: Token | None):
        self._servicer = servicer
        self._config = config
        self._token = token
        self._queue: asyncio.Queue = asyncio.Queue(QUEUED_REQUESTS)
        self._context = _Context()
        self._closed = False

    @property
    def session_id(self) -> str:
        return self._context.session_id

    async def accepted(self) -> bool:
        """Wait until the servicer has accepted the stream (its config checked, the token's quota claimed) or
        ended it; True if accepted. Lets a sender refuse before it spends work on audio (a refusal's status
        comes out of :meth:`responses`, which must be being read)."""
        await self._context.answered.wait()
        return bool(self._context.session_id) and not self._closed

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
            await self._queue.put(pb.StreamingRecognizeRequest(audio=audio))

    async def finalize(self) -> None:
        """End the current utterance now (its final follows)."""
        if not self._closed:
            await self._queue.put(pb.StreamingRecognizeRequest(control=pb.Control(type=pb.Control.FINALIZE)))

    def half_close(self) -> None:
        """No more requests: the stream ends OK after the final of everything sent."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(_HALF_CLOSE)
                return
            asyncio.get_running_loop().create_task(self._queue.put(_HALF_CLOSE))

    async def _requests(self) -> AsyncIterator[pb.StreamingRecognizeRequest]:
        yield pb.StreamingRecognizeRequest(config=self._config)
        while (request := await self._queue.get()) is not _HALF_CLOSE:
            yield request

    async def responses(self) -> AsyncIterator[pb.StreamingRecognizeResponse]:
        """The stream's responses; ends by raising :class:`StreamEnded` (OK included). A response that
        carries ``error`` is not yielded: its status is raised."""
        use_token(self._token)
        native = self._servicer.StreamingRecognize(self._requests(), self._context)
        try:
            async for response in native:
                if response.HasField("error"):
                    continue  # the status itself follows as the servicer's abort
                yield response
        finally:
            self._closed = True
            self._context.answered.set()
            await native.aclose()
        raise StreamEnded(grpc.StatusCode.OK)
