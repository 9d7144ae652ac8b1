"""SIP messages (RFC 3261) for a user-agent server on UDP, TCP and TLS: parse messages (a datagram, or
one framed out of a connection by :func:`read_stream_message`), build responses and the few requests
the gateway sends itself (BYE). No transaction state here; see :mod:`.uas`.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass, field

# RFC 3261 7.3.3 compact forms, and the spelling used when the gateway writes a header.
COMPACT_FORMS = {
    "v": "via",
    "f": "from",
    "t": "to",
    "i": "call-id",
    "m": "contact",
    "l": "content-length",
    "c": "content-type",
    "k": "supported",
    "s": "subject",
    "e": "content-encoding",
    "o": "event",
    "r": "refer-to",
    "u": "allow-events",
    "x": "session-expires",
}
REQUIRED_HEADERS = ("via", "from", "to", "call-id", "cseq")
MAGIC_COOKIE = "z9hG4bK"
_TOKEN = re.compile(r"^[A-Za-z0-9.!%*_+`'~-]+$")
MAX_DATAGRAM_BYTES = 65507


class SipError(ValueError):
    """A datagram that is not a SIP message we can act on."""


@dataclass(slots=True)
class SipMessage:
    """One parsed request or response. Header names are lower case, long form, in arrival order."""

    method: str = ""  # requests only
    uri: str = ""  # requests only
    status: int = 0  # responses only
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    @property
    def is_request(self) -> bool:
        return bool(self.method)

    def get(self, name: str, default: str = "") -> str:
        """The first value of header ``name`` (long form, any case)."""
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return default

    def values(self, name: str) -> list[str]:
        """Every value of header ``name``, comma-separated lists split (Via, Route, Record-Route)."""
        name = name.lower()
        return [item for key, value in self.headers if key == name for item in split_list(value)]

    @property
    def call_id(self) -> str:
        return self.get("call-id")

    @property
    def cseq(self) -> tuple[int, str]:
        number, _, method = self.get("cseq").partition(" ")
        return int(number), method.strip().upper()

    @property
    def branch(self) -> str:
        """The top Via's branch, or a key built from RFC 2543 fields when it has none."""
        vias = self.values("via")
        branch = header_params(vias[0]).get("branch", "") if vias else ""
        if branch.startswith(MAGIC_COOKIE):
            return branch
        return f"{self.call_id}|{self.cseq[0]}|{self.from_tag}|{vias[0] if vias else ''}"

    @property
    def from_tag(self) -> str:
        return header_params(self.get("from")).get("tag", "")

    @property
    def to_tag(self) -> str:
        return header_params(self.get("to")).get("tag", "")


def parse(data: bytes) -> SipMessage:
    """Parse one datagram; raise :class:`SipError` when it is not a usable SIP message."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        head, sep, body = data.partition(b"\n\n")
        if not sep:
            raise SipError("no blank line after the headers")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SipError(f"headers are not UTF-8: {err}") from None
    lines: list[str] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if line[:1] in (" ", "\t") and lines:
            lines[-1] += " " + line.strip()  # folded continuation line
        elif line:
            lines.append(line)
    if not lines:
        raise SipError("empty message")
    message = _parse_start_line(lines[0])
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        name = name.strip().lower()
        if not colon or not name or not _TOKEN.match(name):
            raise SipError(f"bad header line {line[:60]!r}")
        message.headers.append((COMPACT_FORMS.get(name, name), value.strip()))
    missing = [name for name in REQUIRED_HEADERS if not message.get(name)]
    if missing:
        raise SipError(f"missing {', '.join(missing)}")
    try:
        number, method = message.cseq
    except ValueError:
        raise SipError(f"bad CSeq {message.get('cseq')!r}") from None
    if not 0 <= number < 2**31 or (message.is_request and method != message.method):
        raise SipError(f"bad CSeq {message.get('cseq')!r}")
    length = message.get("content-length")
    if length:
        if not length.isdigit() or int(length) > len(body):
            raise SipError(f"Content-Length {length} but {len(body)} body bytes")
        body = body[: int(length)]
    message.body = body
    return message


def _parse_start_line(line: str) -> SipMessage:
    parts = line.split(" ", 2)
    if len(parts) != 3:
        raise SipError(f"bad start line {line[:60]!r}")
    if parts[0] == "SIP/2.0":
        if not (parts[1].isdigit() and len(parts[1]) == 3 and 100 <= int(parts[1]) <= 699):
            raise SipError(f"bad status line {line[:60]!r}")
        return SipMessage(status=int(parts[1]), reason=parts[2])
    method, uri, version = parts
    if version.strip() != "SIP/2.0" or not _TOKEN.match(method) or ":" not in uri:
        raise SipError(f"bad request line {line[:60]!r}")
    return SipMessage(method=method.upper(), uri=uri)


def split_list(value: str) -> list[str]:
    """Split a comma-separated header value, ignoring commas inside <...> and quotes."""
    items, depth, quoted, start = [], 0, False, 0
    for i, char in enumerate(value):
        if char == '"':
            quoted = not quoted
        elif not quoted and char == "<":
            depth += 1
        elif not quoted and char == ">":
            depth = max(depth - 1, 0)
        elif not quoted and depth == 0 and char == ",":
            items.append(value[start:i].strip())
            start = i + 1
    items.append(value[start:].strip())
    return [item for item in items if item]


def header_params(value: str) -> dict[str, str]:
    """``;name=value`` parameters of a header value, after the URI (so not the URI's own parameters)."""
    rest = value[value.rindex(">") + 1 :] if ">" in value else value
    params = {}
    for part in rest.split(";")[1:]:
        name, _, param = part.partition("=")
        params[name.strip().lower()] = param.strip()
    return params


def uri_of(value: str) -> str:
    """The URI of a name-addr or addr-spec: ``"Bob" <sip:bob@host>;tag=1`` -> ``sip:bob@host``."""
    if "<" in value and ">" in value:
        return value[value.index("<") + 1 : value.index(">")].strip()
    return value.split(";", 1)[0].strip()


def new_tag() -> str:
    return secrets.token_hex(8)


def new_branch() -> str:
    return MAGIC_COOKIE + secrets.token_hex(10)


def _with_received(via: str, address: tuple[str, int]) -> str:
    """RFC 3261 18.2.1 and RFC 3581: tell the client where its request came from."""
    params = header_params(via)
    if "rport" in params and not params["rport"]:
        via = re.sub(r";\s*rport(?=;|$)", f";rport={address[1]}", via, count=1)
    if "received" not in params:
        via += f";received={address[0]}"
    return via


def response(
    request: SipMessage,
    status: int,
    reason: str,
    *,
    source: tuple[str, int],
    to_tag: str = "",
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    user_agent: str = "",
) -> bytes:
    """A response to ``request`` (RFC 3261 8.2.6): Via, From, Call-ID, CSeq copied; ``to_tag`` added to
    To unless it has one; Record-Route copied into responses that make a dialog."""
    vias = request.values("via")
    lines = [f"SIP/2.0 {status} {reason}", f"Via: {_with_received(vias[0], source)}"]
    lines += [f"Via: {via}" for via in vias[1:]]
    to = request.get("to")
    if to_tag and not request.to_tag and status > 100:
        to += f";tag={to_tag}"
    lines += [f"From: {request.get('from')}", f"To: {to}", f"Call-ID: {request.call_id}"]
    lines.append(f"CSeq: {request.get('cseq')}")
    if request.method == "INVITE" and 100 < status < 300:
        lines += [f"Record-Route: {route}" for route in request.values("record-route")]
    if user_agent:
        lines.append(f"Server: {user_agent}")
    lines += [f"{name}: {value}" for name, value in headers or ()]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def request(
    method: str,
    uri: str,
    *,
    via: str,
    from_: str,
    to: str,
    call_id: str,
    cseq: int,
    branch: str,
    routes: list[str] | None = None,
    user_agent: str = "",
    transport: str = "UDP",
) -> bytes:
    """A request inside a dialog the gateway holds (its BYE). ``via`` is ``host:port`` of the gateway,
    ``transport`` the one it goes over (UDP, TCP, TLS); ``branch`` (from :func:`new_branch`) matches the
    responses to it."""
    lines = [
        f"{method} {uri} SIP/2.0",
        f"Via: SIP/2.0/{transport} {via};branch={branch};rport",
        "Max-Forwards: 70",
    ]
    lines += [f"Route: {route}" for route in routes or ()]
    lines += [f"From: {from_}", f"To: {to}", f"Call-ID: {call_id}", f"CSeq: {cseq} {method}"]
    if user_agent:
        lines.append(f"User-Agent: {user_agent}")
    lines.append("Content-Length: 0")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


MAX_STREAM_MESSAGE_BYTES = 64 << 10
_CONTENT_LENGTH = re.compile(rb"^(?:content-length|l)[ \t]*:[ \t]*(\d+)[ \t]*\r?$", re.IGNORECASE | re.MULTILINE)


async def read_stream_message(reader: asyncio.StreamReader) -> bytes | None:
    """The next SIP message on a TCP or TLS connection (RFC 3261 18.3: framed by Content-Length), or None
    at the connection's end. CRLF keep-alives between messages (RFC 5626) are skipped. Raises
    :class:`SipError` for a message over 64 KiB or a connection cut inside one."""
    try:
        head = b""
        while not head.strip():  # (blank: keep-alives only)
            head = (await reader.readuntil(b"\r\n\r\n")).lstrip(b"\r\n")
        match = _CONTENT_LENGTH.search(head)
        length = int(match.group(1)) if match else 0
        if len(head) + length > MAX_STREAM_MESSAGE_BYTES:
            raise SipError(f"a message of {len(head) + length} bytes (at most {MAX_STREAM_MESSAGE_BYTES})")
        return head + await reader.readexactly(length)
    except asyncio.IncompleteReadError as err:
        if not err.partial.strip():
            return None
        raise SipError("the connection closed inside a message") from None
    except asyncio.LimitOverrunError:
        raise SipError(f"a header block over {MAX_STREAM_MESSAGE_BYTES} bytes") from None
