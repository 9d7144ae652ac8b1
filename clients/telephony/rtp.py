"""RTP (RFC 3550) for a receive-only G.711 stream: packet parsing, a small reordering jitter buffer
that fills losses with silence from the RTP timestamps, and the pool of media ports.

The jitter buffer is packet-driven and pure (no clock, no I/O) so it can be tested on hand-built
packets; the call (:mod:`.call`) adds the clock: it releases a stalled buffer and feeds silence while
no packet arrives.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

RTP_VERSION = 2
HEADER = struct.Struct("!BBHII")
# RTCP packet types 200-204 (SR, RR, SDES, BYE, APP) seen in the second byte: they arrive on the RTP
# port with rtcp-mux, and are ignored.
RTCP_PACKET_TYPES = range(200, 205)
# Silence in each codec: mu-law 0xFF and A-law 0xD5 decode to (nearly) zero.
SILENCE_BYTE = {"PCMU": 0xFF, "PCMA": 0xD5}
# RFC 3550 A.1: how far a sequence number may jump before the source is treated as restarted.
MAX_DROPOUT = 3000
MAX_MISORDER = 100


class RtpError(ValueError):
    """A datagram that is not an RTP packet."""


@dataclass(frozen=True, slots=True)
class RtpPacket:
    payload_type: int
    marker: bool
    sequence: int
    timestamp: int
    ssrc: int
    payload: bytes


def parse_rtp(data: bytes) -> RtpPacket | None:
    """Parse an RTP packet; None for RTCP; raise :class:`RtpError` for anything else."""
    if len(data) < HEADER.size:
        raise RtpError(f"{len(data)} bytes is shorter than an RTP header")
    first, second, sequence, timestamp, ssrc = HEADER.unpack_from(data)
    if first >> 6 != RTP_VERSION:
        raise RtpError(f"RTP version {first >> 6}")
    if second in RTCP_PACKET_TYPES:
        return None
    offset = HEADER.size + 4 * (first & 0x0F)  # CSRC list
    if first & 0x10:  # header extension: 16-bit profile, 16-bit length in 32-bit words
        if len(data) < offset + 4:
            raise RtpError("truncated header extension")
        offset += 4 + 4 * struct.unpack_from("!H", data, offset + 2)[0]
    end = len(data)
    if first & 0x20:  # padding: the last byte counts the padding bytes
        end -= data[-1]
    if offset > end:
        raise RtpError("header, extension and padding longer than the packet")
    return RtpPacket(second & 0x7F, bool(second & 0x80), sequence, timestamp, ssrc, bytes(data[offset:end]))


def _seq_delta(a: int, b: int) -> int:
    """a - b on 16-bit sequence numbers, in [-32768, 32767]."""
    return (a - b + 0x8000) % 0x10000 - 0x8000


def _ts_delta(a: int, b: int) -> int:
    """a - b on 32-bit timestamps."""
    return (a - b + 0x80000000) % 0x100000000 - 0x80000000


@dataclass(slots=True)
class JitterStats:
    received: int = 0
    lost: int = 0
    late: int = 0
    duplicate: int = 0
    reordered: int = 0
    ssrc_changes: int = 0
    restarts: int = 0
    silence_samples: int = 0


class JitterBuffer:
    """Puts one call's packets back in sequence-number order and turns them into a continuous byte
    stream of 8 kHz G.711 (one byte per sample).

    A packet that has not arrived once ``depth_packets`` later ones are held is lost; what it covered
    becomes silence, sized from the RTP timestamps, so the audio keeps the call's timeline (losses,
    and gaps left by DTMF events or by senders that stop during silence). Packets whose payload type
    is not ``payload_type`` (telephone-event, comfort noise) hold their sequence number but carry no
    audio. A new SSRC (a transfer, a media relay switching source) restarts the sequence; late
    packets of the previous SSRC are dropped.
    """

    def __init__(self, payload_type: int, silence_byte: int, depth_packets: int = 3, max_gap_samples: int = 80000):
        self.payload_type = payload_type
        self.depth_packets = depth_packets
        self.max_gap_samples = max_gap_samples
        self._silence = bytes([silence_byte])
        self.stats = JitterStats()
        self._ssrc: int | None = None
        self._previous_ssrc: int | None = None
        self._next_seq = 0
        self._bad_seq: int | None = None
        self._expected_ts: int | None = None
        self._pending: dict[int, RtpPacket] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def push(self, packet: RtpPacket) -> list[bytes]:
        """Add a packet; return the audio it (and the packets it unblocked) makes playable, in order."""
        self.stats.received += 1
        out: list[bytes] = []
        if self._ssrc is None:
            self._restart(packet)
        elif packet.ssrc != self._ssrc:
            if packet.ssrc == self._previous_ssrc:
                self.stats.late += 1
                return out
            out += self.flush()
            self._previous_ssrc = self._ssrc
            self.stats.ssrc_changes += 1
            self._restart(packet)
            self._expected_ts = None  # a new source has its own random timestamp base
        delta = _seq_delta(packet.sequence, self._next_seq)
        if delta < -MAX_MISORDER or delta >= MAX_DROPOUT:
            # RFC 3550 A.1: a big jump is believed only when the next packet follows it in sequence.
            if packet.sequence != self._bad_seq:
                self._bad_seq = (packet.sequence + 1) & 0xFFFF
                self.stats.late += 1
                return out
            out += self.flush()
            self.stats.restarts += 1
            self._restart(packet)
            self._expected_ts = None
            delta = 0
        if delta < 0:
            self.stats.late += 1
            return out
        if packet.sequence in self._pending:
            self.stats.duplicate += 1
            return out
        if self._pending and delta < max(self._deltas()):
            self.stats.reordered += 1
        self._pending[packet.sequence] = packet
        out += self._release()
        while len(self._pending) > self.depth_packets:
            self._skip_to_oldest()
            out += self._release()
        return out

    def flush(self) -> list[bytes]:
        """Release everything held, in order, treating what is missing as lost (a stall or the end)."""
        out: list[bytes] = []
        while self._pending:
            self._skip_to_oldest()
            out += self._release()
        return out

    def fill_silence(self, samples: int) -> bytes:
        """Silence for time that passed with no packets; moves the expected timestamp on, so a later
        packet whose timestamp covers that time gets no second fill."""
        if self._expected_ts is not None:
            self._expected_ts = (self._expected_ts + samples) & 0xFFFFFFFF
        self.stats.silence_samples += samples
        return self._silence * samples

    def _restart(self, packet: RtpPacket) -> None:
        self._ssrc = packet.ssrc
        self._next_seq = packet.sequence
        self._bad_seq = None

    def _deltas(self) -> list[int]:
        return [_seq_delta(seq, self._next_seq) for seq in self._pending]

    def _skip_to_oldest(self) -> None:
        missing = min(self._deltas())
        self.stats.lost += missing
        self._next_seq = (self._next_seq + missing) & 0xFFFF

    def _release(self) -> list[bytes]:
        out: list[bytes] = []
        while (packet := self._pending.pop(self._next_seq, None)) is not None:
            self._next_seq = (self._next_seq + 1) & 0xFFFF
            if packet.payload_type != self.payload_type or not packet.payload:
                continue
            if self._expected_ts is not None:
                gap = _ts_delta(packet.timestamp, self._expected_ts)
                if 0 < gap <= self.max_gap_samples:
                    out.append(self._silence * gap)
                    self.stats.silence_samples += gap
            out.append(packet.payload)
            self._expected_ts = (packet.timestamp + len(packet.payload)) & 0xFFFFFFFF
        return out


# RFC 4733 section 3.2: the events of DTMF, in order.
DTMF_DIGITS = "0123456789*#ABCD"


def telephone_event(payload: bytes) -> tuple[str, bool] | None:
    """An RFC 4733 telephone-event payload's digit and end bit; None for another event (flash, ...) or a
    payload too short."""
    if len(payload) < 4 or payload[0] >= len(DTMF_DIGITS):
        return None
    return DTMF_DIGITS[payload[0]], bool(payload[1] & 0x80)


class PortPool:
    """Even RTP ports of ``[low, high]`` handed out round-robin (RTCP, on port + 1, is not bound)."""

    def __init__(self, low: int, high: int):
        self._free = deque(range(low + (low % 2), high + 1, 2))
        self._used: set[int] = set()

    def __len__(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        if not self._free:
            return None
        port = self._free.popleft()
        self._used.add(port)
        return port

    def release(self, port: int) -> None:
        if port in self._used:
            self._used.discard(port)
            self._free.append(port)
