"""Who may use the gateway: the ``--allow`` networks (SIP and AudioSocket), SIP digest authentication
(RFC 3261 section 22 with RFC 2617 digest: MD5, ``qop=auth``), and the counts of what was refused.

The third check, RTP only from the call's own source (the SDP's, or one learned inside ``--allow``:
:mod:`.rtp_source`), lives with the media in :class:`~.call.RtpCall`; its drops are counted here too.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import sip
from .config import LOOPBACK, GatewayConfig, Network

logger = logging.getLogger(__name__)

# A header parameter: name=token or name="quoted \"string\"".
_PARAM = re.compile(r'([A-Za-z0-9_-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,]*)')
_HEX32 = re.compile(r"^[0-9a-fA-F]{32}$")
_HEX8 = re.compile(r"^[0-9a-fA-F]{8}$")


def should_log(count: int) -> bool:
    """Log the first 20 of a kind of refusal, then every 1000th: a flood must not flood the log."""
    return count <= 20 or count % 1000 == 0


@dataclass(slots=True)
class SecurityStats:
    """Gateway-wide counts of what the checks refused; logged when the gateway stops (each call's own
    RTP drops are in its "ended" line)."""

    sip_refused: int = 0  # SIP datagrams from outside --allow (requests answered 403, the rest dropped)
    audiosocket_refused: int = 0  # AudioSocket connections from outside --allow (reset)
    auth_challenges: int = 0  # INVITEs without credentials, answered 401
    auth_failures: int = 0  # INVITEs with wrong credentials, answered 401 again
    rtp_dropped: int = 0  # RTP datagrams from elsewhere than the call's source (the SDP's, or the learned one)

    def summary(self) -> str:
        return (
            f"refused {self.sip_refused} SIP datagrams and {self.audiosocket_refused} AudioSocket connections"
            f" from outside --allow, {self.auth_failures} INVITEs with wrong credentials"
            f" ({self.auth_challenges} challenges); dropped {self.rtp_dropped} RTP packets from unnegotiated sources"
        )


class AllowList:
    """The networks the gateway answers; ``host in allow`` for a source address string."""

    def __init__(self, networks: Iterable[Network]):
        self.networks = tuple(networks)

    def __contains__(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone id is not part of it
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
        return any(address in network for network in self.networks)

    def describe(self) -> str:
        """``127.0.0.0/8, ::1``: single hosts without their /32 or /128."""
        return ", ".join(
            str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net) for net in self.networks
        )


# -- digest authentication -------------------------------------------------------------------------


def _md5(text: str) -> str:
    # MD5 is what RFC 2617 digest is; the flag lets it run where FIPS mode forbids MD5 otherwise.
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def digest_response(
    *,
    username: str,
    realm: str,
    password: str,
    method: str,
    uri: str,
    nonce: str,
    nc: str = "",
    cnonce: str = "",
    qop: str = "",
) -> str:
    """The ``response`` of RFC 2617 section 3.2.2 (algorithm MD5): with ``qop`` ``auth``
    MD5(HA1:nonce:nc:cnonce:qop:HA2), without it (RFC 2069) MD5(HA1:nonce:HA2)."""
    ha1 = _md5(f"{username}:{realm}:{password}")
    ha2 = _md5(f"{method}:{uri}")
    if qop:
        return _md5(f"{ha1}:{nonce}:{nc}:{cnonce}:{qop}:{ha2}")
    return _md5(f"{ha1}:{nonce}:{ha2}")


def parse_credentials(value: str) -> dict[str, str] | None:
    """The parameters of a ``Digest`` Authorization header value (names lower case, quotes removed);
    None for another scheme."""
    scheme, _, rest = value.strip().partition(" ")
    if scheme.lower() != "digest":
        return None
    params = {}
    for name, raw in _PARAM.findall(rest):
        if raw.startswith('"'):
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        params[name.lower()] = raw
    return params


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    MISSING = "no credentials"  # none for our realm: challenge
    STALE = "stale nonce"  # the right password, but a nonce that is spent, expired or not ours
    REJECTED = "wrong credentials"


class DigestAuth:
    """Challenges requests (401 with ``WWW-Authenticate``) and checks their ``Authorization``.

    Each challenge gets a fresh random nonce, good for ``lifetime_s`` and for one request: a captured
    INVITE sent again meets a spent nonce. At most ``max_nonces`` are outstanding (the oldest go
    first), so a flood of unauthenticated INVITEs costs bounded memory. A correct answer to a spent or
    expired nonce gets a new challenge with ``stale=TRUE``, on which clients retry without asking
    for the password again. Names and responses are compared in constant time.
    """

    def __init__(
        self,
        user: str,
        password: str,
        realm: str,
        lifetime_s: float = 30.0,
        max_nonces: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.user = user
        self._password = password
        self.realm = realm
        self.lifetime_s = lifetime_s
        self.max_nonces = max_nonces
        self._clock = clock
        self._nonces: dict[str, float] = {}  # nonce -> expiry; insertion order is expiry order

    def challenge(self, stale: bool = False) -> str:
        """A ``WWW-Authenticate`` value with a new nonce."""
        now = self._clock()
        while self._nonces and (len(self._nonces) >= self.max_nonces or next(iter(self._nonces.values())) <= now):
            del self._nonces[next(iter(self._nonces))]
        nonce = secrets.token_hex(16)
        self._nonces[nonce] = now + self.lifetime_s
        return f'Digest realm="{self.realm}", nonce="{nonce}", algorithm=MD5, qop="auth"' + (
            ", stale=TRUE" if stale else ""
        )

    def check(self, request: sip.SipMessage) -> Verdict:
        offered = (parse_credentials(value) for name, value in request.headers if name == "authorization")
        credentials = next((params for params in offered if params and params.get("realm") == self.realm), None)
        if credentials is None:
            return Verdict.MISSING
        nonce = credentials.get("nonce", "")
        expiry = self._nonces.pop(nonce, None)  # one answer per nonce, right or wrong
        if (
            credentials.get("algorithm", "MD5").upper() != "MD5"
            or credentials.get("qop") != "auth"
            or not _HEX8.match(credentials.get("nc", ""))
            or not credentials.get("cnonce")
            or not _HEX32.match(credentials.get("response", ""))
        ):
            return Verdict.REJECTED
        expected = digest_response(
            username=self.user,
            realm=self.realm,
            password=self._password,
            method=request.method,
            uri=credentials.get("uri", ""),
            nonce=nonce,
            nc=credentials["nc"],
            cnonce=credentials["cnonce"],
            qop="auth",
        )
        user_ok = hmac.compare_digest(credentials.get("username", "").encode(), self.user.encode())
        response_ok = hmac.compare_digest(credentials["response"].lower().encode(), expected.encode())
        if not (user_ok and response_ok):
            return Verdict.REJECTED
        if expiry is None or expiry <= self._clock():
            return Verdict.STALE
        return Verdict.ACCEPTED


# -- the SIP side ----------------------------------------------------------------------------------


class SipGuard:
    """The checks :class:`~.uas.SipUas` makes: the source network of every datagram (``source in
    guard.allow``; :meth:`refusal` otherwise) and, with a user configured, the credentials of every
    INVITE (:meth:`challenge`). It counts and logs what it refuses; the UAS sends the answers."""

    def __init__(self, config: GatewayConfig, stats: SecurityStats):
        self.allow = AllowList(config.allow)
        self.auth = (
            DigestAuth(config.sip_user, config.sip_password, config.sip_realm, config.nonce_lifetime_s)
            if config.sip_user
            else None
        )
        self.stats = stats
        self._user_agent = config.user_agent
        self._default_allow = config.allow == LOOPBACK

    def log_policy(self) -> None:
        opening = " (--allow CIDR to open)" if self._default_allow else ""
        logger.info("answering SIP from %s only%s", self.allow.describe(), opening)
        if self.auth is None:
            logger.info("SIP digest authentication off (--sip-user and --sip-password to require it)")
        else:
            logger.info(
                "SIP digest authentication of INVITEs as user %r, realm %r", self.auth.user, self.auth.realm
            )

    def refusal(self, data: bytes, source: tuple[str, int]) -> bytes:
        """What to answer a datagram from outside ``allow``: 403 Forbidden to a request, made without
        any state (a retransmission gets another); nothing (b"") to responses, ACKs and junk."""
        self.stats.sip_refused += 1
        try:
            message = sip.parse(data)
        except sip.SipError:
            message = None
        if should_log(self.stats.sip_refused):
            logger.warning(
                "refused %s from %s:%d: not in --allow %s (%d refused)",
                f"SIP {message.method or 'response'}" if message is not None else "a SIP datagram",
                *source[:2],
                self.allow.describe(),
                self.stats.sip_refused,
            )
        if message is None or not message.is_request or message.method == "ACK":
            return b""
        return sip.response(
            message, 403, "Forbidden", source=source, to_tag=sip.new_tag(), user_agent=self._user_agent
        )

    def challenge(self, request: sip.SipMessage, source: tuple[str, int]) -> str:
        """ "" when ``request`` may go on (authentication off, or valid credentials); otherwise the
        ``WWW-Authenticate`` value of the 401 to answer it with."""
        if self.auth is None:
            return ""
        verdict = self.auth.check(request)
        if verdict is Verdict.ACCEPTED:
            return ""
        if verdict is Verdict.REJECTED:
            self.stats.auth_failures += 1
            if should_log(self.stats.auth_failures):
                logger.warning(
                    "call %s: wrong SIP credentials from %s:%d (%d so far)",
                    request.call_id,
                    *source[:2],
                    self.stats.auth_failures,
                )
        else:
            self.stats.auth_challenges += 1
            logger.debug("call %s: challenged (%s)", request.call_id, verdict.value)
        return self.auth.challenge(stale=verdict is Verdict.STALE)
