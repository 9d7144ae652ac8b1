"""A minimal SIP user-agent server on UDP and TCP (and TLS, with a certificate) on the same port number
(TLS on its own): answers INVITEs with a receive-only G.711 stream and runs each call as an
:class:`~.call.RtpCall`. A request that came over a connection is answered on it, and the gateway's
BYE goes back on it; over TCP and TLS nothing is retransmitted (RFC 3261 17: reliable transports).

Requests: INVITE (100, 180, then 200 with an SDP answer; 488 without PCMU/PCMA; 486 at
``max_calls``; 503 with a Retry-After while the cosystream server is unreachable or overloaded (its load
service NOT_SERVING: it refuses new realtime sessions), or when it refuses the call's session, which is
opened before the 200 (the server's initial metadata says it has an engine slot): the caller's proxy can try
another gateway rather than get a call hung up at once; re-INVITEs get the same answer and
move the accepted RTP source to their offer's), ACK,
BYE and CANCEL (200 and teardown; a CANCEL that arrives after the 200 is answered 200 and changes
nothing, as RFC 3261 9.2 says), OPTIONS (200); anything else 501. A retransmitted request gets the
response sent before; final INVITE responses are retransmitted until the ACK, and the gateway's own
BYE until its response (RFC 3261 17, on UDP).

Access (docs/SECURITY.md): a request from outside ``config.allow`` is answered 403 Forbidden without
any state kept (other datagrams from there are dropped); with ``sip_user`` set, an INVITE (a re-INVITE
too) without valid digest credentials gets 401 Unauthorized and a challenge, before anything else is
looked at. ACK, BYE, CANCEL and OPTIONS are not challenged (ACK and CANCEL cannot be, RFC 3261 22.1;
BYE and CANCEL must match a dialog or transaction the caller already holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import socket
import ssl
import time
from dataclasses import dataclass, field

import grpc

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import retry_after_s

from . import sip
from .call import CallSlots, MalformedLog, RtpCall
from .config import GatewayConfig
from .output import CallInfo, ResultSink
from .rtp import PortPool
from .sdp import SdpError, answer_sdp, negotiate
from .security import SecurityStats, SipGuard, should_log

logger = logging.getLogger(__name__)

# Retry-After of a 503 (s): while the server cannot be reached, and while it is overloaded (the retry delay
# its own RESOURCE_EXHAUSTED refusals advise, cosystream/engine/headroom.py).
UNREACHABLE_RETRY_AFTER_S = 5
OVERLOADED_RETRY_AFTER_S = 2


def session_refusal(err: grpc.aio.AioRpcError) -> tuple[int, str, int]:
    """The log level, the reason and the Retry-After (s) of a call whose session the server refused: the
    refusal's own retry delay, else by its status (at capacity, or anything else: draining, credentials)."""
    at_capacity = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_s = retry_after_s(err.trailing_metadata())
    if retry_s is None:
        retry_s = OVERLOADED_RETRY_AFTER_S if at_capacity else UNREACHABLE_RETRY_AFTER_S
    why = f"refused its session ({err.code().name}: {' '.join((err.details() or '').split())})"
    return logging.WARNING if at_capacity else logging.ERROR, why, math.ceil(retry_s)


T1_S = 0.5
T2_S = 4.0
TRANSACTION_S = 64 * T1_S  # Timer H / F / J: how long a transaction is remembered
ALLOW = "INVITE, ACK, BYE, CANCEL, OPTIONS"


@dataclass(slots=True, eq=False)
class Transaction:
    """A server transaction: the request and the last response, re-sent when the request is."""

    request: sip.SipMessage
    source: tuple[str, int]
    local_tag: str = ""
    response: bytes = b""
    final: bool = False
    acked: bool = False
    retransmit: asyncio.TimerHandle | None = None
    answer: asyncio.Task | None = None


@dataclass(slots=True, eq=False)
class Dialog:
    """One answered call as SIP sees it; ``media`` carries its audio."""

    info: CallInfo
    local_tag: str
    remote_tag: str
    local: str  # the To header the gateway answered with (From of its own requests)
    remote: str  # the caller's From header (To of the gateway's requests)
    remote_target: str
    source: tuple[str, int]
    routes: list[str]
    media: RtpCall
    sdp: bytes
    invite: Transaction
    local_cseq: int = field(default_factory=lambda: secrets.randbelow(1 << 16) + 1)
    bye_received: bool = False
    task: asyncio.Task | None = None
    transport: str = "UDP"  # what the INVITE came over (the gateway's BYE goes back over it)


class _SipProtocol(asyncio.DatagramProtocol):
    def __init__(self, uas: SipUas):
        self._uas = uas

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self._uas.datagram_received(data, addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("SIP socket error: %s", exc)


class SipUas:
    def __init__(
        self,
        config: GatewayConfig,
        channel: grpc.aio.Channel,
        sink: ResultSink,
        slots: CallSlots,
        security: SecurityStats | None = None,
    ):
        self.config = config
        self._channel = channel
        self._stub = pb_grpc.CosyStreamStub(channel)
        self._sink = sink
        self._slots = slots
        self._ports = PortPool(config.rtp_port_min, config.rtp_port_max)
        self._transport: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tls: asyncio.Server | None = None
        self.tls_port: int | None = None
        # Peers connected over TCP or TLS: their messages are answered on their connection.
        self._streams: dict[tuple[str, int], tuple[asyncio.StreamWriter, str]] = {}
        self._transactions: dict[tuple[str, str], Transaction] = {}
        self._dialogs: dict[str, Dialog] = {}
        self._client: dict[str, asyncio.TimerHandle] = {}  # branch of the gateway's BYEs -> retransmit timer
        self._malformed_sip = MalformedLog("SIP", logger)
        self._malformed_rtp = MalformedLog("RTP", logging.getLogger("clients.telephony.call"))
        self._tasks: set[asyncio.Task] = set()
        self.security = security or SecurityStats()
        self._guard = SipGuard(config, self.security)
        self.stopping = False
        self.address: tuple[str, int] = (config.bind, config.sip_port)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _SipProtocol(self), local_addr=(self.config.bind, self.config.sip_port)
        )
        self.address = self._transport.get_extra_info("sockname")[:2]
        self._tcp = await asyncio.start_server(
            lambda r, w: self._connection(r, w, "TCP"), self.config.bind, self.address[1]
        )
        transports = f"udp and tcp {self.address[0]}:{self.address[1]}"
        if self.config.sip_tls_cert:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.sip_tls_cert, self.config.sip_tls_key)
            self._tls = await asyncio.start_server(
                lambda r, w: self._connection(r, w, "TLS"), self.config.bind, self.config.sip_tls_port, ssl=context
            )
            self.tls_port = self._tls.sockets[0].getsockname()[1]
            transports += f", tls {self.address[0]}:{self.tls_port}"
        logger.info("SIP on %s, RTP ports %d-%d", transports, self.config.rtp_port_min, self.config.rtp_port_max)
        self._guard.log_policy()

    async def stop(self) -> None:
        """Refuse new calls, hang up the live ones (BYE, last finals flushed), then close the socket."""
        self.stopping = True
        for dialog in list(self._dialogs.values()):
            dialog.media.hangup("the gateway is stopping")
        for tx in list(self._transactions.values()):
            if tx.answer is not None and not tx.answer.done() and not tx.final:
                tx.answer.cancel()
                self._respond(tx, 503, "Service Unavailable")
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.flush_timeout_s + 1)
        for handle in self._client.values():
            handle.cancel()
        for tx in self._transactions.values():
            if tx.retransmit is not None:
                tx.retransmit.cancel()
        if self._transport is not None:
            self._transport.close()
        for server in (self._tcp, self._tls):
            if server is not None:
                server.close()
        for writer, _ in list(self._streams.values()):
            writer.close()

    # -- connections (TCP, TLS) ----------------------------------------------------------------------

    async def _connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, transport: str
    ) -> None:
        peer = tuple(writer.get_extra_info("peername")[:2])
        if peer[0] not in self._guard.allow:
            self.security.sip_refused += 1
            if should_log(self.security.sip_refused):
                logger.warning("SIP over %s from %s:%d refused: not in --allow", transport, *peer)
            writer.close()
            return
        self._streams[peer] = (writer, transport)
        try:
            while (message := await sip.read_stream_message(reader)) is not None:
                self.datagram_received(message, peer)
        except sip.SipError as err:  # the framing is lost: the connection cannot go on
            self._malformed_sip(peer, err)
        except (ConnectionError, ssl.SSLError) as err:
            logger.debug("SIP over %s from %s:%d: %s", transport, *peer, err)
        finally:
            if self._streams.get(peer, (None,))[0] is writer:
                del self._streams[peer]
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _transport_of(self, peer: tuple[str, int]) -> str:
        """UDP, or TCP/TLS for a peer connected over one."""
        stream = self._streams.get(peer)
        return stream[1] if stream is not None else "UDP"

    # -- datagrams -----------------------------------------------------------------------------------

    def datagram_received(self, data: bytes, source: tuple[str, int]) -> None:
        if not data.strip():
            return  # CRLF keep-alive (RFC 5626)
        if source[0] not in self._guard.allow:
            if reply := self._guard.refusal(data, source):
                self._send(reply, source)
            return
        try:
            message = sip.parse(data)
        except sip.SipError as err:
            self._malformed_sip(source, err)
            return
        try:
            if message.is_request:
                self._on_request(message, source)
            else:
                self._on_response(message)
        except Exception:  # one bad message must not take the calls of others down
            logger.exception("error handling %s from %s:%d", message.method or message.status, *source[:2])

    def _send(self, data: bytes, destination: tuple[str, int]) -> None:
        if (stream := self._streams.get(destination)) is not None:
            if not stream[0].is_closing():
                stream[0].write(data)
        elif self._transport is not None and not self._transport.is_closing():
            self._transport.sendto(data, destination)

    def _respond(self, tx: Transaction, status: int, reason: str, **kwargs) -> None:
        tx.response = sip.response(
            tx.request,
            status,
            reason,
            source=tx.source,
            to_tag=tx.local_tag,
            user_agent=self.config.user_agent,
            **kwargs,
        )
        self._send(tx.response, tx.source)
        if tx.request.method == "INVITE" and status >= 200:
            tx.final = True
            first = T1_S if self._transport_of(tx.source) == "UDP" else TRANSACTION_S  # reliable: wait, no resend
            tx.retransmit = asyncio.get_running_loop().call_later(
                first, self._retransmit, tx, first, time.monotonic()
            )

    def _retransmit(self, tx: Transaction, interval_s: float, since_s: float) -> None:
        """Timer G: re-send a final INVITE response until its ACK, for 64*T1."""
        if tx.acked:
            return
        if time.monotonic() - since_s >= TRANSACTION_S:
            logger.warning("call %s: no ACK for %s", tx.request.call_id, tx.response.split(b"\r\n", 1)[0].decode())
            dialog = self._dialogs.get(tx.request.call_id)
            if dialog is not None and dialog.invite is tx:
                dialog.media.hangup("no ACK")
            return
        if self._transport_of(tx.source) == "UDP":
            self._send(tx.response, tx.source)
        interval_s = min(2 * interval_s, T2_S)
        tx.retransmit = asyncio.get_running_loop().call_later(
            interval_s, self._retransmit, tx, interval_s, since_s
        )

    # -- requests ------------------------------------------------------------------------------------

    def _on_request(self, request: sip.SipMessage, source: tuple[str, int]) -> None:
        if request.method == "ACK":
            self._on_ack(request)
            return
        key = (request.branch, request.method)
        if (tx := self._transactions.get(key)) is not None:
            if tx.response:
                self._send(tx.response, source)  # a retransmission: the same answer again
            return
        tx = Transaction(request, source, local_tag=sip.new_tag())
        self._transactions[key] = tx
        asyncio.get_running_loop().call_later(TRANSACTION_S, self._forget, key, tx)
        if request.get("max-forwards", "70").strip() == "0" and request.method != "CANCEL":
            self._respond(tx, 483, "Too Many Hops")
            return
        required = request.get("require")
        if required and request.method != "CANCEL":
            self._respond(tx, 420, "Bad Extension", headers=[("Unsupported", required)])
            return
        handler = {
            "INVITE": self._on_invite,
            "BYE": self._on_bye,
            "CANCEL": self._on_cancel,
            "OPTIONS": self._on_options,
        }.get(request.method)
        if handler is None:
            self._respond(tx, 501, "Not Implemented", headers=[("Allow", ALLOW)])
        else:
            handler(tx)

    def _forget(self, key: tuple[str, str], tx: Transaction) -> None:
        if self._transactions.get(key) is tx:
            del self._transactions[key]

    def _on_options(self, tx: Transaction) -> None:
        self._respond(
            tx,
            200,
            "OK",
            headers=[("Allow", ALLOW), ("Accept", "application/sdp"), ("Supported", "")],
        )

    def _on_ack(self, ack: sip.SipMessage) -> None:
        tx = self._transactions.get((ack.branch, "INVITE"))  # the ACK of a non-2xx final
        if tx is None:
            dialog = self._dialogs.get(ack.call_id)  # the ACK of a 2xx: a new transaction
            if dialog is None or dialog.local_tag != ack.to_tag:
                return
            tx = dialog.invite
        tx.acked = True
        if tx.retransmit is not None:
            tx.retransmit.cancel()

    def _on_bye(self, tx: Transaction) -> None:
        dialog = self._dialogs.get(tx.request.call_id)
        if dialog is None or tx.request.to_tag != dialog.local_tag:
            self._respond(tx, 481, "Call/Transaction Does Not Exist")
            return
        self._respond(tx, 200, "OK")
        dialog.bye_received = True
        dialog.invite.acked = True  # a BYE implies the caller has the 200
        if dialog.invite.retransmit is not None:
            dialog.invite.retransmit.cancel()
        dialog.media.hangup("the caller hung up")

    def _on_cancel(self, tx: Transaction) -> None:
        invite = self._transactions.get((tx.request.branch, "INVITE"))
        if invite is None:
            self._respond(tx, 481, "Call/Transaction Does Not Exist")
            return
        self._respond(tx, 200, "OK")
        if not invite.final and invite.answer is not None and not invite.answer.done():
            invite.answer.cancel()
            self._respond(invite, 487, "Request Terminated")
            logger.info("call %s: cancelled before the answer", invite.request.call_id)

    def _on_invite(self, tx: Transaction) -> None:
        request = tx.request
        if challenge := self._guard.challenge(request, tx.source):
            self._respond(tx, 401, "Unauthorized", headers=[("WWW-Authenticate", challenge)])
            return
        if request.to_tag:
            self._on_reinvite(tx)
            return
        if request.call_id in self._dialogs:
            self._respond(tx, 482, "Loop Detected")
            return
        self._respond(tx, 100, "Trying")
        if self.stopping:
            self._respond(tx, 503, "Service Unavailable")
            return
        content_type = request.get("content-type").split(";")[0].strip().lower()
        if not request.body or content_type != "application/sdp":
            self._respond(
                tx, 488, "Not Acceptable Here", headers=[("Warning", '399 - "an SDP offer is required"')]
            )
            return
        try:
            negotiated = negotiate(request.body)
        except SdpError as err:
            logger.warning("call %s: bad SDP offer: %s", request.call_id, err)
            negotiated = None
        if negotiated is None:
            self._respond(tx, 488, "Not Acceptable Here", headers=[("Warning", '305 - "PCMU or PCMA required"')])
            return
        if not self._slots.try_acquire():
            logger.warning("call %s: refused, %d calls already", request.call_id, self._slots.active)
            self._respond(tx, 486, "Busy Here")
            return
        task = asyncio.get_running_loop().create_task(
            self._answer(tx, negotiated), name=f"answer {request.call_id}"
        )
        tx.answer = task
        self._track(task)

    def _on_reinvite(self, tx: Transaction) -> None:
        dialog = self._dialogs.get(tx.request.call_id)
        if dialog is None or dialog.local_tag != tx.request.to_tag:
            self._respond(tx, 481, "Call/Transaction Does Not Exist")
            return
        tx.local_tag = dialog.local_tag
        dialog.invite = tx  # its ACK now stops this 200's retransmissions
        if tx.request.body:
            with contextlib.suppress(SdpError):
                if (negotiated := negotiate(tx.request.body)) is not None:
                    dialog.media.expect_from(negotiated.remote)  # the media moved (a PBX's direct media)
        self._respond(tx, 200, "OK", headers=self._answer_headers(tx), body=dialog.sdp)

    def _answer_headers(self, tx: Transaction) -> list[tuple[str, str]]:
        user = tx.request.uri.split(":", 1)[-1].split("@")[0] if "@" in tx.request.uri else ""
        contact = f"sip:{user}@" if user else "sip:"
        transport = self._transport_of(tx.source)
        port = self.tls_port if transport == "TLS" else self.address[1]
        suffix = "" if transport == "UDP" else f";transport={transport.lower()}"
        return [
            ("Contact", f"<{contact}{self._local_ip(tx.source[0])}:{port}{suffix}>"),
            ("Allow", ALLOW),
            ("Content-Type", "application/sdp"),
        ]

    async def _answer(self, tx: Transaction, negotiated) -> None:
        request = tx.request
        info = CallInfo(request.call_id, sip.uri_of(request.get("from")), sip.uri_of(request.get("to")))
        media = RtpCall(
            info,
            negotiated.codec,
            negotiated.payload_type,
            self._stub,
            self.config,
            self._sink,
            self._malformed_rtp,
            negotiated.remote,
            self.security,
            negotiated.dtmf_payload_type,
        )
        answered = False
        try:
            self._respond(tx, 180, "Ringing")
            if self.config.ring_ms:
                await asyncio.sleep(self.config.ring_ms / 1000)
            refusal = await self._server_refusal()
            if refusal is not None:
                self._refuse(tx, info.call_id, refusal)
                return
            host = self._local_ip(tx.source[0])
            port = await media.open(self.config.bind, self._ports)
            if port is None:
                logger.error("call %s: refused, no free RTP port in %d-%d", info.call_id, *self._port_range())
                self._respond(tx, 503, "Service Unavailable", headers=[("Retry-After", "5")])
                return
            refused = await media.admit(self.config.connect_timeout_s)
            if refused is not None:  # (the server's word on this session: at capacity, draining, ...)
                self._refuse(tx, info.call_id, session_refusal(refused))
                return
            sdp = answer_sdp(negotiated, host, port, secrets.randbelow(1 << 31), 1)
            dialog = Dialog(
                info=info,
                local_tag=tx.local_tag,
                remote_tag=request.from_tag,
                local=f"{request.get('to')};tag={tx.local_tag}",
                remote=request.get("from"),
                remote_target=sip.uri_of(request.get("contact")) or sip.uri_of(request.get("from")),
                source=tx.source,
                routes=request.values("record-route"),
                media=media,
                sdp=sdp,
                invite=tx,
                transport=self._transport_of(tx.source),
            )
            self._dialogs[info.call_id] = dialog
            self._respond(tx, 200, "OK", headers=self._answer_headers(tx), body=sdp)
            answered = True
            logger.info(
                "call %s from %s to %s: %s on RTP port %d (SIP over %s)",
                info.call_id,
                info.from_uri,
                info.to_uri,
                negotiated.codec,
                port,
                dialog.transport,
            )
            dialog.task = asyncio.get_running_loop().create_task(self._run(dialog), name=f"call {info.call_id}")
            self._track(dialog.task)
        finally:
            if not answered:
                media.abandon()
                self._slots.release()

    def _refuse(self, tx, call_id: str, refusal: tuple[int, str, int]) -> None:
        """Answer the INVITE 503 with its Retry-After, the log saying why (a :meth:`_server_refusal` or a
        :func:`session_refusal`)."""
        level, why, wait_s = refusal
        logger.log(level, "call %s: refused, the cosystream server %s %s", call_id, self.config.server, why)
        self._respond(tx, 503, "Service Unavailable", headers=[("Retry-After", str(wait_s))])

    async def _server_refusal(self) -> tuple[int, str, int] | None:
        """The log level and why the server would not take this call, and the Retry-After (s) for the
        caller's 503; None: it is reachable, takes the gateway's credentials and is not overloaded. (A call
        it would refuse is not answered: the caller gets 503 rather than a silent call, or one hung up as
        soon as it starts.)"""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), self.config.connect_timeout_s)
            info = await self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.config.connect_timeout_s)
        except TimeoutError:
            return logging.ERROR, "is unreachable", UNREACHABLE_RETRY_AFTER_S
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                logger.error(
                    "cosystream at %s refuses the gateway's credentials (%s: %s): set --token or $COSYSTREAM_TOKEN",
                    self.config.server,
                    err.code().name,
                    " ".join((err.details() or "").split()),
                )
                return logging.ERROR, "refuses the gateway's credentials", UNREACHABLE_RETRY_AFTER_S
            return logging.ERROR, f"is unreachable ({err.code().name})", UNREACHABLE_RETRY_AFTER_S
        load = info.load
        if load.overloaded:  # (it refuses new realtime sessions until its load is back under the limit)
            return (
                logging.WARNING,
                f"is overloaded (engine load {load.engine_load:.2f}, limit {load.admit_load:g})",
                OVERLOADED_RETRY_AFTER_S,
            )
        return None

    async def _run(self, dialog: Dialog) -> None:
        call_id = dialog.info.call_id
        try:
            await dialog.media.run_reported()
        finally:
            if not dialog.bye_received:
                self._send_bye(dialog)
            if self._dialogs.get(call_id) is dialog:
                del self._dialogs[call_id]
            self._slots.release()

    def _send_bye(self, dialog: Dialog) -> None:
        dialog.local_cseq += 1
        branch = sip.new_branch()
        host = self._local_ip(dialog.source[0])
        transport = self._transport_of(dialog.source)
        if transport == "UDP" and dialog.transport != "UDP":
            logger.warning(
                "call %s: no BYE sent, the caller closed its %s connection", dialog.info.call_id, dialog.transport
            )
            return
        data = sip.request(
            "BYE",
            dialog.remote_target,
            via=f"{host}:{self.tls_port if transport == 'TLS' else self.address[1]}",
            transport=transport,
            from_=dialog.local,
            to=dialog.remote,
            call_id=dialog.info.call_id,
            cseq=dialog.local_cseq,
            branch=branch,
            routes=dialog.routes,
            user_agent=self.config.user_agent,
        )
        self._send(data, dialog.source)
        if transport != "UDP":
            return  # reliable: no retransmission, and its response needs no timer to stop
        self._client[branch] = asyncio.get_running_loop().call_later(
            T1_S, self._retransmit_request, branch, data, dialog.source, T1_S, time.monotonic()
        )

    def _retransmit_request(
        self, branch: str, data: bytes, destination: tuple[str, int], interval_s: float, since_s: float
    ) -> None:
        """Timer E: re-send the gateway's BYE until a final response, for 64*T1."""
        if time.monotonic() - since_s >= TRANSACTION_S:
            self._client.pop(branch, None)
            return
        self._send(data, destination)
        interval_s = min(2 * interval_s, T2_S)
        self._client[branch] = asyncio.get_running_loop().call_later(
            interval_s, self._retransmit_request, branch, data, destination, interval_s, since_s
        )

    def _on_response(self, response: sip.SipMessage) -> None:
        if response.status >= 200 and (handle := self._client.pop(response.branch, None)) is not None:
            handle.cancel()

    # -- helpers -------------------------------------------------------------------------------------

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _port_range(self) -> tuple[int, int]:
        return self.config.rtp_port_min, self.config.rtp_port_max

    def _local_ip(self, peer_ip: str) -> str:
        """The address to put in SDP and Contact: the bound one, or the one that routes to the peer."""
        if self.config.bind not in ("", "0.0.0.0"):
            return self.config.bind
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer_ip, 9))
            return probe.getsockname()[0]
        return "127.0.0.1"
