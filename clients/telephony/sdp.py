"""SDP offer/answer (RFC 3264) for one receive-only G.711 audio stream.

The gateway only listens, so its answer is ``recvonly`` with one codec, PCMU or PCMA, taken in the
offerer's order of preference, plus ``telephone-event`` when offered (accepted so that callers that
send DTMF keep working; the call reports their digits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_CODECS = ("PCMU", "PCMA")
STATIC_PAYLOAD_TYPES = {0: "PCMU", 8: "PCMA"}
CLOCK_RATE_HZ = 8000
PLAIN_RTP_PROFILES = ("RTP/AVP", "RTP/AVPF")


class SdpError(ValueError):
    """A body that is not a usable session description."""


@dataclass(slots=True)
class Media:
    """One ``m=`` section of an offer."""

    kind: str
    port: int
    proto: str
    formats: list[str]
    address: str = ""
    direction: str = "sendrecv"
    rtpmap: dict[int, str] = field(default_factory=dict)  # payload type -> "NAME/RATE[/CHANNELS]"
    fmtp: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Negotiated:
    """What the answer says: the codec, the DTMF payload type, and where the caller's media is."""

    codec: str  # "PCMU" or "PCMA"
    payload_type: int
    dtmf_payload_type: int | None
    dtmf_fmtp: str
    remote: tuple[str, int]
    direction: str  # of the answer
    media_index: int
    offer: tuple[Media, ...]


def parse_sdp(body: bytes) -> list[Media]:
    """The ``m=`` sections of a session description, with session-level ``c=``/direction inherited."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise SdpError("SDP is not UTF-8") from None
    session_address, session_direction = "", "sendrecv"
    media: list[Media] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        kind, eq, value = line.strip().partition("=")
        if not eq or len(kind) != 1:
            continue
        current = media[-1] if media else None
        if kind == "m":
            parts = value.split()
            if len(parts) < 4 or not parts[1].split("/")[0].isdigit():
                raise SdpError(f"bad m= line {line!r}")
            media.append(
                Media(
                    parts[0], int(parts[1].split("/")[0]), parts[2], parts[3:], session_address, session_direction
                )
            )
        elif kind == "c":
            parts = value.split()
            if len(parts) != 3 or parts[0] != "IN":
                raise SdpError(f"bad c= line {line!r}")
            address = parts[2].split("/")[0]
            if current is None:
                session_address = address
            else:
                current.address = address
        elif kind == "a":
            name, _, attr = value.partition(":")
            if name in ("sendrecv", "sendonly", "recvonly", "inactive"):
                if current is None:
                    session_direction = name
                else:
                    current.direction = name
            elif name in ("rtpmap", "fmtp") and current is not None:
                payload_type, _, rest = attr.partition(" ")
                if payload_type.isdigit():
                    getattr(current, name)[int(payload_type)] = rest.strip()
    if not media:
        raise SdpError("no m= line")
    return media


def negotiate(body: bytes) -> Negotiated | None:
    """Choose the codec for the first usable audio stream of an offer; None when nothing is acceptable."""
    offer = parse_sdp(body)
    for index, media in enumerate(offer):
        if media.kind != "audio" or media.port == 0 or media.proto not in PLAIN_RTP_PROFILES:
            continue
        codec, payload_type, dtmf = None, 0, None
        for fmt in media.formats:
            if not fmt.isdigit():
                continue
            pt = int(fmt)
            name, _, rate = media.rtpmap.get(pt, f"{STATIC_PAYLOAD_TYPES.get(pt, '')}/8000").partition("/")
            rate = rate.split("/")[0]
            if rate != str(CLOCK_RATE_HZ):
                continue
            if codec is None and name.upper() in SUPPORTED_CODECS:
                codec, payload_type = name.upper(), pt
            elif dtmf is None and name.lower() == "telephone-event":
                dtmf = pt
        if codec is None:
            continue
        direction = "recvonly" if media.direction in ("sendrecv", "sendonly") else "inactive"
        return Negotiated(
            codec=codec,
            payload_type=payload_type,
            dtmf_payload_type=dtmf,
            dtmf_fmtp=media.fmtp.get(dtmf, "0-16") if dtmf is not None else "",
            remote=(media.address, media.port),
            direction=direction,
            media_index=index,
            offer=tuple(offer),
        )
    return None


def answer_sdp(negotiated: Negotiated, address: str, port: int, session_id: int, version: int) -> bytes:
    """The answer: the chosen stream on ``address:port``, every other offered stream rejected (port 0)."""
    lines = [
        "v=0",
        f"o=cosystream {session_id} {version} IN IP4 {address}",
        "s=cosystream",
        f"c=IN IP4 {address}",
        "t=0 0",
    ]
    for index, media in enumerate(negotiated.offer):
        if index != negotiated.media_index:
            lines.append(f"m={media.kind} 0 {media.proto} {media.formats[0]}")
            continue
        formats = [str(negotiated.payload_type)]
        if negotiated.dtmf_payload_type is not None:
            formats.append(str(negotiated.dtmf_payload_type))
        lines.append(f"m=audio {port} {media.proto} {' '.join(formats)}")
        lines.append(f"a=rtpmap:{negotiated.payload_type} {negotiated.codec}/{CLOCK_RATE_HZ}")
        if negotiated.dtmf_payload_type is not None:
            lines.append(f"a=rtpmap:{negotiated.dtmf_payload_type} telephone-event/{CLOCK_RATE_HZ}")
            lines.append(f"a=fmtp:{negotiated.dtmf_payload_type} {negotiated.dtmf_fmtp}")
        lines += ["a=ptime:20", f"a={negotiated.direction}"]
    return ("\r\n".join(lines) + "\r\n").encode()
