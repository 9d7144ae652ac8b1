"""A resume that lands on another frontend process than the one holding its session.

The frontends of one server share its port (SO_REUSEPORT), so a client that reconnects after a dropped
connection reaches any of them. A session lives in the frontend that opened it (its decoder, endpointer,
VAD, queued results; the engine slot is addressed through that frontend's connection), so rather than move
all of that between processes, the frontend a resume lands on passes the whole call on to the one that
holds it: each frontend also listens on a socket of its own in the server's private run folder
(``StreamOptions.peers``, one per frontend, index-ordered), a session's resume token starts with its
frontend's index (``"3.<random>"``), and :func:`forward` relays the requests one way and the responses,
initial metadata and status the other. The holder sees an ordinary resume: the token, its owner check, the
offsets and the replay are its own. What it costs is one more local hop for a resumed session's messages,
and only for those that landed elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from cosystream.frontend.host import StreamOptions
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

_NOT_FORWARDED = ("user-agent", "content-type", "te", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout")


def token_frontend(token: str) -> int | None:
    """The index of the frontend that issued ``token`` (None: a token without one)."""
    index, dot, _ = token.partition(".")
    return int(index) if dot and index.isdigit() else None


def sibling_holding(token: str, options: StreamOptions) -> int | None:
    """The index of the sibling frontend that holds resume ``token``'s session (None: this frontend, or a token
    that names none of its siblings): where a resume that landed here is passed on."""
    index = token_frontend(token)
    if index is None or index == options.frontend_index or index >= len(options.peers):
        return None
    return index


class Peers:
    """Channels to the server's other frontends, made when first needed (inside the running loop)."""

    def __init__(self, addresses: tuple[str, ...]):
        self.addresses = addresses
        self._stubs: dict[int, pb_grpc.CosyStreamStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, index: int) -> pb_grpc.CosyStreamStub:
        stub = self._stubs.get(index)
        if stub is None:
            options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
            channel = grpc.aio.insecure_channel(self.addresses[index], options=options)
            self._channels.append(channel)
            stub = self._stubs[index] = pb_grpc.CosyStreamStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


async def forward(
    stub: pb_grpc.CosyStreamStub,
    first: pb.StreamingRecognizeRequest,
    requests: AsyncIterator[pb.StreamingRecognizeRequest],
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[pb.StreamingRecognizeResponse]:
    """Relay one stream to the frontend behind ``stub``: ``first`` (the resume's config) and the rest of
    ``requests`` there, its responses back, then its status (a half-close here is one there; a dropped
    connection here cancels the call there, which then holds the session again)."""
    metadata = tuple(
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if not key.startswith(":") and key not in _NOT_FORWARDED
    )
    call = stub.StreamingRecognize(metadata=metadata)

    async def pump() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            await call.write(first)
            async for request in requests:
                await call.write(request)
            # (a dropped connection's requests end as a half-close's do: the holder waits a moment to see
            # which it was, and this handler, cancelled meanwhile, cancels the call there)
            await call.done_writing()

    writer = asyncio.create_task(pump())
    try:
        try:
            metadata_in = await call.initial_metadata()
            if metadata_in:
                await context.send_initial_metadata(tuple(metadata_in))
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as err:
            await context.abort(err.code(), err.details() or "", tuple(err.trailing_metadata() or ()))
    finally:
        writer.cancel()
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
