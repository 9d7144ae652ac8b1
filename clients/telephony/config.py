"""The gateway's one configuration object; the CLI (``clients/telephony_gateway.py``) is the only place
that reads flags into it."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from cosystream.v1.client import DEFAULT_SERVER, Connection

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# The default --allow: this host only. Opening the gateway to a network is a deliberate act.
LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Where the gateway listens, where it sends audio, and how calls are timed.

    ``sip_port`` 0 binds an ephemeral port (tests); ``audiosocket_port`` and ``ari_rtp_port`` None turn
    the Asterisk AudioSocket listener and the ARI external media port off, 0 binds an ephemeral one. ``allow`` are the networks whose SIP requests
    and AudioSocket connections are answered; ``sip_user`` and ``sip_password`` (both or neither)
    turn on digest authentication of INVITEs (docs/SECURITY.md).
    """

    server: str = DEFAULT_SERVER
    asr_connection: Connection = field(default_factory=Connection)  # TLS and token for the channel to it
    bind: str = "0.0.0.0"
    sip_port: int = 5060
    rtp_port_min: int = 10000
    rtp_port_max: int = 20000
    max_calls: int = 32
    interim_results: bool = False
    phrases: tuple = ()  # phrase boosting for every call (--phrases FILE): pb.Phrase
    vocabulary: str = ""  # a named vocabulary the server holds, for every call (--vocabulary NAME)
    # No usable RTP for this long ends the call: the gateway sends BYE and flushes the last final.
    rtp_timeout_s: float = 20.0
    # Where a call's RTP is taken from: "learn" (the SDP's address, or a source inside allow that passes
    # probation, then locked) or "sdp" (only the SDP's address and port). See rtp_source.py.
    rtp_source: str = "learn"
    # Reordering window of the jitter buffer: a missing packet is declared lost when this much audio
    # arrived after it.
    jitter_ms: int = 60
    # After this long without a packet (but before rtp_timeout_s), silence is fed in real time so that
    # the server can end the utterance (callers that stop sending during silence, DTX).
    idle_fill_ms: int = 300
    # Time between 180 Ringing and 200 OK; a CANCEL in this window rejects the call with 487.
    ring_ms: int = 0
    # How long the server may take to become reachable before an INVITE is refused with 503.
    connect_timeout_s: float = 2.0
    # After the caller hangs up: how long to wait for the server's last final.
    flush_timeout_s: float = 10.0
    audiosocket_port: int | None = None
    # SIP over TLS (beside UDP and TCP on sip_port): a PEM certificate chain and its key; port 0: any.
    sip_tls_cert: str = ""
    sip_tls_key: str = ""
    sip_tls_port: int = 5061
    # Asterisk ARI externalMedia: plain RTP on this UDP port, a call per source (ari.py); None: off.
    ari_rtp_port: int | None = None
    user_agent: str = "cosystream-telephony"
    allow: tuple[Network, ...] = LOOPBACK
    sip_user: str = ""
    sip_password: str = field(default="", repr=False)
    sip_realm: str = "cosystream"
    # How long the nonce of a 401 challenge may be answered (each is good for one request).
    nonce_lifetime_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.sip_port <= 65535:
            raise ValueError(f"sip_port {self.sip_port} is not a UDP port")
        if not 1024 <= self.rtp_port_min <= self.rtp_port_max <= 65535:
            raise ValueError(
                f"rtp ports {self.rtp_port_min}-{self.rtp_port_max} must be 1024 <= LO <= HI <= 65535"
            )
        if self.rtp_port_min % 2 and self.rtp_port_min == self.rtp_port_max:
            raise ValueError("the RTP port range holds no even port")
        if self.rtp_source not in ("learn", "sdp"):
            raise ValueError(f"rtp_source {self.rtp_source!r} is not learn or sdp")
        if self.max_calls < 1:
            raise ValueError("max_calls must be at least 1")
        if self.rtp_timeout_s <= 0 or self.flush_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.jitter_ms < 0 or self.ring_ms < 0 or self.idle_fill_ms < 20:
            raise ValueError("jitter_ms and ring_ms must be >= 0, idle_fill_ms >= 20")
        if bool(self.sip_tls_cert) != bool(self.sip_tls_key):
            raise ValueError("--sip-tls-cert and --sip-tls-key go together")
        if not 0 <= self.sip_tls_port <= 65535:
            raise ValueError(f"sip_tls_port {self.sip_tls_port} is not a TCP port")
        if self.ari_rtp_port is not None and not 0 <= self.ari_rtp_port <= 65535:
            raise ValueError(f"ari_rtp_port {self.ari_rtp_port} is not a UDP port")
        if self.audiosocket_port is not None and not 0 <= self.audiosocket_port <= 65535:
            raise ValueError(f"audiosocket_port {self.audiosocket_port} is not a TCP port")
        if not self.allow:
            raise ValueError("allow must name at least one network")
        if bool(self.sip_user) != bool(self.sip_password):
            raise ValueError("--sip-user and --sip-password go together")
        if '"' in self.sip_realm or "\\" in self.sip_realm or self.nonce_lifetime_s <= 0:
            raise ValueError("sip_realm must not hold quotes or backslashes, nonce_lifetime_s must be positive")


def parse_port_range(text: str) -> tuple[int, int]:
    """``"10000-20000"`` -> (10000, 20000)."""
    lo, sep, hi = text.partition("-")
    if not sep:
        raise ValueError(f"expected LO-HI, got {text!r}")
    return int(lo), int(hi)


def parse_networks(texts: list[str]) -> tuple[Network, ...]:
    """``["10.0.0.0/8", "192.0.2.7", "2001:db8::/32"]`` -> networks; a bare address is one host, and
    host bits are masked (``10.1.2.3/8`` is ``10.0.0.0/8``)."""
    networks = []
    for text in texts:
        try:
            networks.append(ipaddress.ip_network(text.strip(), strict=False))
        except ValueError:
            raise ValueError(f"--allow {text!r} is not an address or a CIDR network (10.0.0.0/8, ::1)") from None
    return tuple(networks)
