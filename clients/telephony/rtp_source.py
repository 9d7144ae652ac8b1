"""Which address a call's RTP is taken from (``--rtp-source``).

``sdp``: only the address and port of the caller's SDP (``c=`` and ``m=``); anything else is dropped
before it is parsed. Strict, and wrong for most callers behind a NAT, on a multi-homed host or with a
softphone whose SDP names another interface than the one its packets leave by.

``learn`` (the default), as Asterisk's ``strictrtp`` with probation: packets from the SDP's address and
port are media at once (the signalling vouches for them). Packets from any other source inside
``--allow`` are held while that source is on probation; after ``probation`` packets in sequence the
source is learned, the call locks to it and the held packets are played (no audio is lost to the
learning). Once locked, packets from elsewhere are dropped, unless the locked source has been quiet for
``relearn_quiet_s`` and the new one passes probation (a NAT rebinding, a roaming phone, a media relay
switching over): a source cannot take over a call whose media is still flowing. A re-INVITE that moves
the media starts learning over.

Packet-driven and clock-free (the caller passes the time), so it is tested on hand-built packets.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field

from .rtp import RtpPacket

Address = tuple[str, int]

# Asterisk's rtp.conf default probation: 4 packets in sequence (80 ms of 20 ms packets).
PROBATION_PACKETS = 4
# How long the locked source must have been silent before another may take the call over.
RELEARN_QUIET_S = 1.0


class RtpSource(enum.StrEnum):
    LEARN = "learn"
    SDP = "sdp"


def canonical_host(host: str) -> str:
    """The spelling a socket reports a source address in (``::ffff:127.0.0.1`` stays as it is)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


class Verdict(enum.Enum):
    MEDIA = "media"  # play it (and the packets released with it)
    HELD = "held"  # its source is on probation
    FOREIGN = "foreign"  # from outside --allow (or, with --rtp-source sdp, from elsewhere than the SDP)
    LOCKED_OUT = "locked out"  # the call is locked to another source that is still sending


@dataclass(slots=True)
class _Candidate:
    source: Address
    next_sequence: int
    in_sequence: int = 0
    held: list[RtpPacket] = field(default_factory=list)


class SourceLatch:
    """One call's media source: :meth:`admit` says what to do with each datagram's source and packet.

    ``allowed(host)`` is the ``--allow`` check; the SDP's own host may always be learned from. A
    datagram from a source :meth:`worth_parsing` rejects is dropped unparsed (FOREIGN).
    """

    def __init__(
        self,
        mode: RtpSource,
        allowed: Callable[[str], bool],
        probation: int = PROBATION_PACKETS,
        relearn_quiet_s: float = RELEARN_QUIET_S,
    ):
        self.mode = RtpSource(mode)
        self.allowed = allowed
        self.probation = max(probation, 1)
        self.relearn_quiet_s = relearn_quiet_s
        self.sdp: Address = ("", 0)
        self.locked: Address | None = None
        self.learned = 0  # sources learned over the call (beyond the SDP's own)
        self.dropped = 0  # RTP datagrams that will never be played (held ones count once let go)
        self.dropped_from: Address | None = None  # the source of the last of them
        self._last_locked_s = 0.0
        self._candidate: _Candidate | None = None

    @property
    def pending(self) -> int:
        """Packets held on probation right now (dropped if their source is never learned)."""
        return len(self._candidate.held) if self._candidate is not None else 0

    def expect(self, sdp: Address) -> None:
        """The SDP's address (the offer's, or a re-INVITE's: then learning starts over)."""
        self.sdp = (canonical_host(sdp[0]), sdp[1])
        self.locked = None
        self._forget_candidate()

    def let_go(self) -> int:
        """Drop what is held on probation (the call ends); how many packets that was."""
        pending = self.pending
        self._forget_candidate()
        return pending

    def worth_parsing(self, source: Address) -> bool:
        """Whether a datagram from ``source`` may be media (False: drop it unparsed, as FOREIGN)."""
        return self._current(source) or (self.mode is RtpSource.LEARN and self._may_learn(source[0]))

    def admit(self, source: Address, packet: RtpPacket | None, now: float) -> tuple[Verdict, list[RtpPacket]]:
        """What ``packet`` (None for RTCP) from ``source`` is, and the packets to play now: this one,
        or the held ones of a source that has just passed probation, this one last."""
        if self._current(source):
            self.locked = source
            self._forget_candidate()
            self._last_locked_s = now
            return Verdict.MEDIA, [packet] if packet is not None else []
        if self.mode is RtpSource.SDP or not self._may_learn(source[0]):
            self.dropped += 1
            self.dropped_from = source
            return Verdict.FOREIGN, []
        if packet is None:  # RTCP from a source not (yet) learned: no audio, nothing to count
            return Verdict.HELD, []
        candidate = self._candidate
        if candidate is None or candidate.source != source or packet.sequence != candidate.next_sequence:
            self._forget_candidate()
            candidate = self._candidate = _Candidate(source, packet.sequence)
        candidate.held.append(packet)
        candidate.next_sequence = (packet.sequence + 1) & 0xFFFF
        candidate.in_sequence += 1
        if candidate.in_sequence < self.probation:
            return Verdict.HELD, []
        if self.locked is not None and now - self._last_locked_s < self.relearn_quiet_s:
            # On probation it passed; it takes over with its next packet once the locked source is quiet.
            self.dropped += len(candidate.held)
            self.dropped_from = source
            candidate.held.clear()
            return Verdict.LOCKED_OUT, []
        self.locked, self._candidate, self._last_locked_s = source, None, now
        self.learned += 1
        return Verdict.MEDIA, candidate.held

    def _forget_candidate(self) -> None:
        if self._candidate is not None and self._candidate.held:
            self.dropped += len(self._candidate.held)
            self.dropped_from = self._candidate.source
        self._candidate = None

    def _current(self, source: Address) -> bool:
        return source == self.locked or (self.locked is None and source == self.sdp)

    def _may_learn(self, host: str) -> bool:
        return host == self.sdp[0] or self.allowed(host)
