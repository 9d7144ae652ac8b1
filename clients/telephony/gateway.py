"""The gateway: one gRPC channel to cosystream, the SIP user-agent server, the optional AudioSocket
listener and ARI external media port, and the result sink they share."""

from __future__ import annotations

import asyncio
import logging
import sys

import grpc

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

from .ari import ExternalMediaServer
from .audiosocket import AudioSocketServer
from .call import CallSlots
from .config import GatewayConfig
from .output import ResultSink
from .security import SecurityStats
from .uas import SipUas

logger = logging.getLogger(__name__)

# Reconnect quickly after a server outage: the default backoff reaches 120 s between attempts.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class Gateway:
    """Telephone calls in, cosystream results out. Create and use inside the running event loop
    (grpc.aio objects belong to the loop that made them)."""

    def __init__(self, config: GatewayConfig, sink: ResultSink | None = None):
        self.config = config
        self.sink = sink or ResultSink(sys.stdout)
        self.slots = CallSlots(config.max_calls)
        self.security = SecurityStats()  # what --allow, digest authentication and the RTP source check refused
        self._channel: grpc.aio.Channel | None = None
        self.sip: SipUas | None = None
        self.audiosocket: AudioSocketServer | None = None
        self.ari: ExternalMediaServer | None = None
        self._watch: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> Gateway:
        self._channel = self.config.asr_connection.aio_channel(self.config.server, options=CHANNEL_OPTIONS)
        self._channel.get_state(try_to_connect=True)
        if self.sink.webhook is not None:
            self.sink.webhook.start()
        self.sip = SipUas(self.config, self._channel, self.sink, self.slots, self.security)
        await self.sip.start()
        if self.config.audiosocket_port is not None:
            self.audiosocket = AudioSocketServer(
                self.config, pb_grpc.CosyStreamStub(self._channel), self.sink, self.slots, self.security
            )
            await self.audiosocket.start()
        if self.config.ari_rtp_port is not None:
            self.ari = ExternalMediaServer(
                self.config, pb_grpc.CosyStreamStub(self._channel), self.sink, self.slots, self.security
            )
            await self.ari.start()
        logger.info("gateway ready: cosystream at %s, at most %d calls", self.config.server, self.config.max_calls)
        self._watch = asyncio.get_running_loop().create_task(self._watch_server())
        return self

    async def _watch_server(self, retry_s: float = 5.0) -> None:
        """Say when cosystream cannot be reached (calls are then refused) and when it answers again; the
        channel itself keeps reconnecting."""
        stub = pb_grpc.CosyStreamStub(self._channel)
        reachable = None
        while True:
            try:
                await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=retry_s)
                if reachable is not True:
                    if reachable is False:
                        logger.warning("cosystream at %s answers again", self.config.server)
                    reachable = True
            except grpc.aio.AioRpcError as err:
                if reachable is not False:
                    logger.warning(
                        "cosystream at %s cannot be reached (%s: %s); calls are refused until it answers, "
                        "retrying every %g s",
                        self.config.server,
                        err.code().name,
                        " ".join((err.details() or "").split()),
                        retry_s,
                    )
                    reachable = False
            await asyncio.sleep(retry_s)

    async def stop(self) -> None:
        """Hang up every call (flushing its last final), then close everything."""
        if self._watch is not None:
            self._watch.cancel()
        if self.sip is not None:
            await self.sip.stop()
        if self.audiosocket is not None:
            await self.audiosocket.stop()
        if self.ari is not None:
            await self.ari.stop()
        if self.sink.webhook is not None:
            await self.sink.webhook.stop()
        if self._channel is not None:
            await self._channel.close()
        logger.info("gateway stopped: %s", self.security.summary())
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
