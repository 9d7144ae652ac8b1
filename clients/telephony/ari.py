"""Asterisk ARI ``externalMedia``: RTP on one UDP port, no SIP (``--ari-rtp-port``).

An ARI application creates an external media channel with ``external_host`` set to the gateway's
address and this port (``POST /channels/externalMedia?app=APP&external_host=GW:PORT&format=ulaw``) and
bridges it with the call; Asterisk then sends the call's audio as plain RTP (G.711 ``ulaw`` or
``alaw``, 20 ms packets) from the channel's own address and port, which it puts in the channel
variables ``UNICASTRTP_LOCAL_ADDRESS`` and ``UNICASTRTP_LOCAL_PORT``. Each such source is one call,
keyed by that address and port (the call's ``call_id`` is ``ADDRESS:PORT``, so the ARI application
can match results to its channel), and one cosystream session.

A source inside ``--allow`` becomes a call after a probation of 4 packets in sequence (held, then
played: no audio lost), as the SIP calls learn theirs (:mod:`.rtp_source`); packets from outside
``--allow`` are dropped and counted. The call then runs as a SIP call's media does (:class:`~.call.
RtpCall`: jitter buffer, silence while no packet comes, DTMF), and ends when its RTP stops for
``--rtp-timeout-s`` (Asterisk sends nothing more once the channel is hung up), with its end line.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

from .call import CallSlots, MalformedLog, RtpCall
from .config import GatewayConfig
from .output import CallInfo, ResultSink
from .rtp import RtpError, parse_rtp
from .rtp_source import PROBATION_PACKETS
from .security import AllowList, SecurityStats, should_log

logger = logging.getLogger(__name__)

CODEC_OF_PAYLOAD_TYPE = {0: "PCMU", 8: "PCMA"}
MAX_ON_PROBATION = 256  # sources on probation at once (the oldest is forgotten beyond)

Address = tuple[str, int]


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: ExternalMediaServer):
        self._server = server

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self._server.on_datagram(data, (addr[0], addr[1]))


class ExternalMediaServer:
    def __init__(
        self,
        config: GatewayConfig,
        stub: pb_grpc.CosyStreamStub,
        sink: ResultSink,
        slots: CallSlots,
        security: SecurityStats,
    ):
        self.config = config
        self._stub = stub
        self._sink = sink
        self._slots = slots
        self.security = security
        self._allow = AllowList(config.allow)
        self._malformed = MalformedLog("ARI RTP", logger)
        self._calls: dict[Address, RtpCall] = {}
        self._tasks: set[asyncio.Task] = set()
        self._probation: OrderedDict[Address, list[bytes]] = OrderedDict()
        self._next_sequence: dict[Address, int] = {}
        self._transport: asyncio.DatagramTransport | None = None
        self._refused = 0
        self.address: Address = (config.bind, config.ari_rtp_port or 0)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=(self.config.bind, self.config.ari_rtp_port or 0)
        )
        self.address = self._transport.get_extra_info("sockname")[:2]
        logger.info("ARI external media: RTP on udp %s:%d, from %s only", *self.address, self._allow.describe())

    async def stop(self) -> None:
        """Stop listening; end every call (its last final flushed)."""
        if self._transport is not None:
            self._transport.close()
        for call in list(self._calls.values()):
            call.hangup("the gateway is stopping")
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.flush_timeout_s + 1)

    def on_datagram(self, data: bytes, source: Address) -> None:
        call = self._calls.get(source)
        if call is not None:
            call.on_datagram(data, source)
            return
        if source[0] not in self._allow:
            self.security.rtp_dropped += 1
            if should_log(self.security.rtp_dropped):
                logger.warning(
                    "ARI external media: dropped RTP from %s:%d, not in --allow %s",
                    *source,
                    self._allow.describe(),
                )
            return
        try:
            packet = parse_rtp(data)
        except RtpError as err:
            self._malformed(source, err)
            return
        if packet is None:  # RTCP before any RTP
            return
        held = self._probation.get(source)
        if held is None or packet.sequence != self._next_sequence.get(source):
            held = self._probation[source] = []
            while len(self._probation) > MAX_ON_PROBATION:
                forgotten, _ = self._probation.popitem(last=False)
                self._next_sequence.pop(forgotten, None)
        held.append(data)
        self._next_sequence[source] = (packet.sequence + 1) & 0xFFFF
        if len(held) < PROBATION_PACKETS:
            return
        del self._probation[source]
        del self._next_sequence[source]
        codec = CODEC_OF_PAYLOAD_TYPE.get(packet.payload_type)
        if codec is None:
            self._refuse(
                source, f"payload type {packet.payload_type} is not G.711 (externalMedia format=ulaw or alaw)"
            )
            return
        if not self._slots.try_acquire():
            self._refuse(source, f"{self._slots.active} calls already (--max-calls)")
            return
        self._open(source, codec, packet.payload_type, held)

    def _refuse(self, source: Address, why: str) -> None:
        self._refused += 1
        if should_log(self._refused):
            logger.warning("ARI external media from %s:%d refused: %s", *source, why)

    def _open(self, source: Address, codec: str, payload_type: int, held: list[bytes]) -> None:
        info = CallInfo(f"{source[0]}:{source[1]}")
        call = RtpCall(
            info, codec, payload_type, self._stub, self.config, self._sink, self._malformed, source, self.security
        )
        self._calls[source] = call
        logger.info("ARI external media call %s: %s", info.call_id, codec)
        task = asyncio.get_running_loop().create_task(self._run(source, call), name=f"ARI call {info.call_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        for data in held:
            call.on_datagram(data, source)

    async def _run(self, source: Address, call: RtpCall) -> None:
        try:
            await call.run_reported()
        finally:
            if self._calls.get(source) is call:
                del self._calls[source]
            self._slots.release()
