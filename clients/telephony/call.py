"""The media side of one SIP call: its RTP port, jitter buffer and cosystream session, and the call's
clock (stalled-buffer release, silence while no packet arrives, the RTP timeout, the flush timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time

import grpc

from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

from .asr import ENCODING_OF_CODEC, SAMPLE_RATE_HZ, AsrStream, streaming_config
from .config import GatewayConfig
from .output import CallInfo, ResultSink
from .rtp import SILENCE_BYTE, JitterBuffer, PortPool, RtpError, RtpPacket, parse_rtp, telephone_event
from .rtp_source import RtpSource, SourceLatch
from .security import AllowList, SecurityStats, should_log

logger = logging.getLogger(__name__)

TICK_S = 0.1
FRAME_SAMPLES = SAMPLE_RATE_HZ // 50  # 20 ms


class CallSlots:
    """The ``--max-calls`` budget, shared by every ingress (SIP, AudioSocket)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0

    def try_acquire(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active = max(self.active - 1, 0)


class MalformedLog:
    """Logs malformed datagrams without letting a flood of them flood the log."""

    def __init__(self, what: str, log: logging.Logger):
        self.what = what
        self.log = log
        self.count = 0

    def __call__(self, source: tuple[str, int], reason: object) -> None:
        self.count += 1
        if self.count <= 20 or self.count % 1000 == 0:
            self.log.warning(
                "ignored malformed %s datagram #%d from %s:%d: %s", self.what, self.count, *source[:2], reason
            )


class _RtpProtocol(asyncio.DatagramProtocol):
    def __init__(self, call: RtpCall):
        self._call = call

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self._call.on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("call %s: RTP socket error: %s", self._call.info.call_id, exc)


class RtpCall:
    """RTP in, through the jitter buffer, to a cosystream session; results to the sink.

    :meth:`run` lasts the whole call. :meth:`hangup` (the caller's BYE, the RTP timeout, shutdown)
    stops the media, flushes the buffer and half-closes the session, and :meth:`run` returns once the
    server sent the last final (or ``flush_timeout_s`` passed). A failed session raises from
    :meth:`run` as ``grpc.aio.AioRpcError``.

    Which datagrams are media is the :class:`~.rtp_source.SourceLatch`'s call (``--rtp-source``):
    by default the source is learned (the SDP's address at once, another inside ``--allow`` after a
    probation of packets in sequence) and the call locks to it; with ``sdp`` only the SDP's address
    and port are media. Everything else is dropped, and counted (``dropped_foreign``, and the
    gateway's total), so nobody can inject audio into a live call.
    """

    def __init__(
        self,
        info: CallInfo,
        codec: str,
        payload_type: int,
        stub: pb_grpc.CosyStreamStub,
        config: GatewayConfig,
        sink: ResultSink,
        malformed: MalformedLog,
        remote: tuple[str, int],
        security: SecurityStats,
        dtmf_payload_type: int | None = None,
    ):
        self.info = info
        self._sink = sink
        self.dtmf_payload_type = dtmf_payload_type
        self._dtmf_seen: set[tuple[int, int]] = set()  # (SSRC, timestamp) of the events already reported
        self.codec = codec
        self.config = config
        self.jitter = JitterBuffer(payload_type, SILENCE_BYTE[codec], depth_packets=max(config.jitter_ms // 20, 0))
        self.asr = AsrStream(
            stub,
            streaming_config(ENCODING_OF_CODEC[codec], config.interim_results, config.phrases, config.vocabulary),
            lambda result: sink.write(info, result),
        )
        self._malformed = malformed
        self._security = security
        self.latch = SourceLatch(RtpSource(config.rtp_source), AllowList(config.allow).__contains__)
        self.expect_from(remote)
        self._drops_logged = 0
        self.port: int | None = None
        self._pool: PortPool | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self.end_reason = ""
        self._started_s = time.monotonic()
        self._last_packet_s: float | None = None
        self._accounted_s = 0.0  # wall time up to which audio (received or filled) was fed
        self._hangup_s: float | None = None
        self._session: asyncio.Future | None = None  # (opened by admit(), before the call is answered)

    async def open(self, host: str, pool: PortPool) -> int | None:
        """Bind an RTP port from ``pool`` (skipping ports something else holds); None when none is free."""
        loop = asyncio.get_running_loop()
        for _ in range(len(pool)):
            port = pool.acquire()
            if port is None:
                break
            try:
                self._transport, _ = await loop.create_datagram_endpoint(
                    lambda: _RtpProtocol(self), local_addr=(host, port)
                )
            except OSError:
                pool.release(port)
                continue
            self.port, self._pool = port, pool
            return port
        return None

    def close(self) -> None:
        """Release the socket and the port (idempotent)."""
        self._security.rtp_dropped += self.latch.let_go()  # held on probation by a source never learned
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._pool is not None and self.port is not None:
            self._pool.release(self.port)
            self._pool = None

    @property
    def hung_up(self) -> bool:
        return self._hangup_s is not None

    @property
    def remote(self) -> tuple[str, int]:
        """Where the call's media comes from: the learned source, else the SDP's address."""
        return self.latch.locked or self.latch.sdp

    def expect_from(self, remote: tuple[str, int]) -> None:
        """Take media from ``remote`` (the offer's, or a re-INVITE's when the media moves: learning
        starts over)."""
        try:
            ipaddress.ip_address(remote[0])
        except ValueError:
            logger.warning(
                "call %s: the SDP's c= address %r is not an IP address%s",
                self.info.call_id,
                remote[0],
                ": every RTP packet will be dropped" if self.config.rtp_source == RtpSource.SDP else "",
            )
        previous = self.latch.sdp
        self.latch.expect(remote)
        if previous != ("", 0) and self.latch.sdp != previous:
            logger.info("call %s: media moves from %s:%d to %s:%d", self.info.call_id, *previous, *self.latch.sdp)

    @property
    def dropped_foreign(self) -> int:
        """RTP datagrams not played because of where they came from (held ones once let go)."""
        return self.latch.dropped + self.latch.pending

    def on_datagram(self, data: bytes, source: tuple[str, int]) -> None:
        if self.hung_up:
            return
        source = (source[0], source[1])
        packet = None
        if self.latch.worth_parsing(source):
            try:
                packet = parse_rtp(data)
            except RtpError as err:
                self._malformed(source, err)
                return
        dropped = self.latch.dropped
        now = time.monotonic()
        _, playable = self.latch.admit(source, packet, now)
        if self.latch.dropped != dropped:
            self._security.rtp_dropped += self.latch.dropped - dropped
            self._log_drop()
        if not playable:
            return
        if self._last_packet_s is None:
            sdp = self.latch.sdp
            learned = "" if source == sdp else f" (learned: the SDP says {sdp[0]}:{sdp[1]})"
            logger.info("call %s: first RTP packet from %s:%d%s", self.info.call_id, *source, learned)
        elif len(playable) > 1:
            logger.info("call %s: media now from %s:%d (learned)", self.info.call_id, *source)
        self._last_packet_s = self._accounted_s = now
        for each in playable:
            if each.payload_type == self.dtmf_payload_type:
                self._dtmf(each)
            for audio in self.jitter.push(each):
                self.asr.feed(audio)

    def _dtmf(self, packet: RtpPacket) -> None:
        """Report an RFC 4733 event once, at its first packet (all of an event's packets, and the three
        copies of its end, share its timestamp)."""
        event = telephone_event(packet.payload)
        if event is None or (packet.ssrc, packet.timestamp) in self._dtmf_seen:
            return
        if len(self._dtmf_seen) > 64:
            self._dtmf_seen.clear()
        self._dtmf_seen.add((packet.ssrc, packet.timestamp))
        logger.info("call %s: DTMF %s", self.info.call_id, event[0])
        self._sink.dtmf(self.info, event[0], self.asr.sent_ms)

    def _log_drop(self) -> None:
        self._drops_logged += 1
        if not should_log(self._drops_logged) or self.latch.dropped_from is None:
            return
        source = self.latch.dropped_from
        logger.warning(
            "call %s: dropped RTP datagram #%d from %s:%d: %s",
            self.info.call_id,
            self.latch.dropped,
            *source,
            self._drop_why(source),
        )

    def _drop_why(self, source: tuple[str, int]) -> str:
        sdp = self.latch.sdp
        if self.latch.mode is RtpSource.SDP:
            return (
                f"--rtp-source sdp takes media only from the SDP's {sdp[0]}:{sdp[1]}"
                " (behind a NAT? --rtp-source learn takes it from where it comes)"
            )
        if not self.latch.worth_parsing(source):
            return "the source is outside --allow"
        if self.latch.locked is not None:
            return f"the call's media comes from {self.latch.locked[0]}:{self.latch.locked[1]}"
        return "its packets broke sequence before it was learned"

    def hangup(self, reason: str) -> None:
        """End the media now; the session flushes and :meth:`run` returns after the last final."""
        if self.hung_up:
            return
        self._hangup_s = time.monotonic()
        self.end_reason = reason
        if self._transport is not None:
            self._transport.close()
        for audio in self.jitter.flush():
            self.asr.feed(audio)
        self.asr.close()

    async def admit(self, timeout_s: float) -> grpc.aio.AioRpcError | None:
        """Open the call's session before the call is answered. None once the server has admitted it, or has
        not answered within ``timeout_s`` (the call goes on, and :meth:`run` says how its session ends); the
        server's refusal otherwise (RESOURCE_EXHAUSTED: at capacity, with a retry delay), for the caller's 503."""
        self._session = session = asyncio.ensure_future(self.asr.run())
        admitted = asyncio.ensure_future(self.asr.admitted.wait())
        try:
            await asyncio.wait({session, admitted}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            admitted.cancel()
        if not session.done() or session.cancelled():
            return None
        err = session.exception()
        if isinstance(err, grpc.aio.AioRpcError) and not self.asr.admitted.is_set():
            return err
        return None  # (it ended at once, admitted: run() reports how)

    def abandon(self) -> None:
        """The call is not answered after all: its session (if :meth:`admit` opened one) is cancelled."""
        if self._session is not None and not self._session.done():
            self._session.cancel()
        self.close()

    async def run(self) -> None:
        self._started_s = time.monotonic()
        session = self._session or asyncio.ensure_future(self.asr.run())
        try:
            while not (await asyncio.wait({session}, timeout=TICK_S))[0]:
                self._tick(session)
            if session.cancelled():
                logger.warning(
                    "call %s: no last final within %g s of the hang-up",
                    self.info.call_id,
                    self.config.flush_timeout_s,
                )
                return
            session.result()
            if not self.end_reason:
                self.end_reason = "the server ended the session"
        finally:
            if not session.done():
                session.cancel()
                with contextlib.suppress(BaseException):
                    await session
            self.close()

    async def run_reported(self) -> None:
        """:meth:`run`, with a failed session or a bug in this call made its end reason (the other calls go
        on); then the call's end line and its "ended" log line (WARNING when it had no usable audio)."""
        call_id = self.info.call_id
        failed = False
        try:
            await self.run()
        except grpc.aio.AioRpcError as err:
            failed = True
            self.end_reason = f"the cosystream session failed: {err.code().name}: {err.details()}"
            logger.error("call %s: %s", call_id, self.end_reason)
        except Exception as err:  # a bug in one call must not end the others
            failed = True
            self.end_reason = f"internal error: {err!r}"
            logger.exception("call %s failed", call_id)
        finally:
            self.close()
            unheard = self.unheard_why()
            reason = f"{self.end_reason}; {unheard}" if unheard else self.end_reason
            self._sink.ended(self.info, reason, self.asr.sent_ms, self.asr.finals, ok=not (unheard or failed))
            if unheard:
                logger.warning(
                    "call %s ended (%s) with no audio: %s: %s", call_id, self.end_reason, unheard, self.summary()
                )
            else:
                logger.info("call %s ended (%s): %s", call_id, self.end_reason, self.summary())

    def _tick(self, session: asyncio.Future) -> None:
        now = time.monotonic()
        if self._hangup_s is not None:
            if now - self._hangup_s > self.config.flush_timeout_s:
                session.cancel()
            return
        idle_s = now - (self._last_packet_s or self._started_s)
        if idle_s >= self.config.rtp_timeout_s:
            if self._last_packet_s is not None:
                what = "RTP stopped"
            elif self.dropped_foreign:
                what = "no usable RTP"
            else:
                what = "no RTP at all"
            self.hangup(f"{what} for {self.config.rtp_timeout_s:g} s")
            return
        if self._last_packet_s is None or idle_s * 1000 < self.config.idle_fill_ms:
            return
        # A stall: play what the jitter buffer holds, then keep the server's clock going with silence
        # so that it can end the utterance while the caller sends nothing.
        for audio in self.jitter.flush():
            self.asr.feed(audio)
        samples = int((now - self._accounted_s) * SAMPLE_RATE_HZ) // FRAME_SAMPLES * FRAME_SAMPLES
        if samples > 0:
            self.asr.feed(self.jitter.fill_silence(samples))
            self._accounted_s += samples / SAMPLE_RATE_HZ

    @property
    def heard(self) -> bool:
        """Whether any usable RTP arrived."""
        return self._last_packet_s is not None

    def unheard_why(self) -> str:
        """Why a call had no usable audio, for its end line and log ("" when it had some)."""
        if self.heard:
            return ""
        if not self.dropped_foreign:
            return "no RTP arrived"
        source = self.latch.dropped_from or ("", 0)
        return (
            f"all {self.dropped_foreign} RTP datagrams were dropped, the last from {source[0]}:{source[1]}"
            f" ({self._drop_why(source)})"
        )

    def summary(self) -> str:
        stats = self.jitter.stats
        sdp = self.latch.sdp
        media = f"media from {self.remote[0]}:{self.remote[1]}"
        if self.remote != sdp:
            media += f" (learned; the SDP said {sdp[0]}:{sdp[1]})"
        return (
            f"{self.asr.sent_ms / 1000:.1f} s of audio, {self.asr.finals} finals, {stats.received} packets"
            f" ({stats.lost} lost, {stats.late} late, {stats.duplicate} duplicate, {stats.reordered} reordered,"
            f" {stats.ssrc_changes} SSRC changes), {media}, {self.dropped_foreign} from elsewhere dropped"
        )
