"""One cosystream session per call over the public gRPC API: 20 ms audio chunks in, results out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.resume import ResumableStream

logger = logging.getLogger(__name__)

CHUNK_MS = 20
# Bytes per sample at 8 kHz of the encodings telephony uses.
BYTES_PER_SAMPLE = {pb.MULAW: 1, pb.ALAW: 1, pb.LINEAR16: 2}
ENCODING_OF_CODEC = {"PCMU": pb.MULAW, "PCMA": pb.ALAW}
SAMPLE_RATE_HZ = 8000


def streaming_config(encoding: int, interim_results: bool, phrases=(), vocabulary: str = "") -> pb.StreamingConfig:
    return pb.StreamingConfig(
        encoding=encoding,
        sample_rate_hz=SAMPLE_RATE_HZ,
        priority=pb.REALTIME,
        interim_results=interim_results,
        phrases=phrases,
        vocabulary=vocabulary,
    )


class AsrStream:
    """A REALTIME session for one call.

    :meth:`feed` takes audio of any length from the media side (synchronously, from a datagram
    callback) and queues it as 20 ms chunks; :meth:`close` half-closes, and the server answers with the
    last final; :meth:`run` streams until the server ends the stream and raises
    ``grpc.aio.AioRpcError`` when it ends with an error (server gone, draining, full). A dropped
    connection to the server is resumed (``cosystream.v1.resume``): the call's transcript loses nothing.
    """

    def __init__(
        self,
        stub: pb_grpc.CosyStreamStub,
        config: pb.StreamingConfig,
        on_result: Callable[[pb.StreamingResult], None],
    ):
        self._stream = ResumableStream(stub, config)
        self._config = config
        self._on_result = on_result
        self.chunk_bytes = SAMPLE_RATE_HZ * CHUNK_MS // 1000 * BYTES_PER_SAMPLE[config.encoding]
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._partial = bytearray()
        self.closed = False
        self.sent_bytes = 0
        self.finals = 0

    @property
    def sent_ms(self) -> int:
        return self.sent_bytes * CHUNK_MS // self.chunk_bytes

    def feed(self, audio: bytes) -> None:
        if self.closed or not audio:
            return
        self._partial += audio
        while len(self._partial) >= self.chunk_bytes:
            self._queue.put_nowait(bytes(self._partial[: self.chunk_bytes]))
            del self._partial[: self.chunk_bytes]

    def close(self) -> None:
        """No more audio: send what is left, then half-close."""
        if self.closed:
            return
        self.closed = True
        if self._partial:
            self._queue.put_nowait(bytes(self._partial))
            self._partial.clear()
        self._queue.put_nowait(None)

    async def _audio(self) -> AsyncIterator[bytes]:
        while (chunk := await self._queue.get()) is not None:
            self.sent_bytes += len(chunk)
            yield chunk

    @property
    def admitted(self) -> asyncio.Event:
        """Set once the server has admitted the session (an engine slot given): :meth:`run` is running."""
        return self._stream.admitted

    async def run(self) -> None:
        stream = self._stream
        async for response in stream.recognize(self._audio()):
            for result in response.results:
                if result.is_final:
                    self.finals += 1
                self._on_result(result)
