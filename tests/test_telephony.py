"""Telephony gateway (``clients/telephony_gateway.py``).

First the pure pieces on hand-built input (SIP, SDP, RTP, the jitter buffer); then end to end on
loopback: a cosystream server in this process, the gateway as a subprocess through its command line,
and real peers (baresip, GStreamer) or crafted SIP and RTP from Python. The model may be untrained,
so these tests pin structure (a final per utterance, the call's ids, times near the speech), never
the words.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest

from clients.telephony import sip
from clients.telephony.rtp import JitterBuffer, PortPool, RtpPacket, parse_rtp
from clients.telephony.rtp_source import RtpSource, SourceLatch, Verdict
from clients.telephony.sdp import answer_sdp, negotiate
from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from tests.servers import WebhookServer
from tests.speech import encode, needs_espeak, silence, speech

REPO = Path(__file__).resolve().parent.parent
GATEWAY = REPO / "clients" / "telephony_gateway.py"
RATE_HZ = 8000
SENTENCE = "please call me back tomorrow morning"
OTHER = "the meeting moved to four o'clock"


# -- SIP and SDP -----------------------------------------------------------------------------------

OFFER = (
    b"v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    b"m=audio 4000 RTP/AVP 96 8 0 101\r\na=rtpmap:96 opus/48000/2\r\na=rtpmap:8 PCMA/8000\r\n"
    b"a=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\na=sendrecv\r\n"
    b"m=video 4002 RTP/AVP 97\r\na=rtpmap:97 VP8/90000\r\n"
)


def invite_bytes(body: bytes = OFFER, *, compact: bool = False) -> bytes:
    names = (
        ("v", "f", "t", "i", "l", "c")
        if compact
        else ("Via", "From", "To", "Call-ID", "Content-Length", "Content-Type")
    )
    via, from_, to, call_id, length, ctype = names
    return (
        "INVITE sip:asr@127.0.0.1 SIP/2.0\r\n"
        f"{via}: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bKabc;rport\r\n"
        "Via: SIP/2.0/UDP proxy.example;branch=z9hG4bKdef, SIP/2.0/UDP 10.0.0.9;branch=z9hG4bKghi\r\n"
        f'{from_}: "Alice, A." <sip:alice@example.com>;tag=a1\r\n'
        f"{to}: <sip:asr@127.0.0.1>\r\n"
        f"{call_id}: c1@example\r\nCSeq: 7 INVITE\r\nSubject: a folded\r\n header\r\n"
        f"{ctype}: application/sdp\r\n{length}: {len(body)}\r\n\r\n"
    ).encode() + body


@pytest.mark.parametrize("compact", [False, True])
def test_parse_invite(compact):
    message = sip.parse(invite_bytes(compact=compact) + b"trailing bytes past Content-Length")
    assert (message.method, message.uri, message.call_id, message.cseq) == (
        "INVITE",
        "sip:asr@127.0.0.1",
        "c1@example",
        (7, "INVITE"),
    )
    assert message.branch == "z9hG4bKabc" and message.from_tag == "a1" and message.to_tag == ""
    assert len(message.values("via")) == 3 and message.get("subject") == "a folded header"
    assert message.body == OFFER
    assert sip.uri_of(message.get("from")) == "sip:alice@example.com"


def test_response_copies_the_transaction_and_tags_the_dialog():
    request = sip.parse(invite_bytes())
    response = sip.parse(sip.response(request, 200, "OK", source=("127.0.0.1", 5999), to_tag="t1", body=b"x"))
    assert response.status == 200 and response.body == b"x"
    vias = response.values("via")
    assert len(vias) == 3 and "rport=5999" in vias[0] and "received=127.0.0.1" in vias[0]
    assert response.to_tag == "t1" and response.from_tag == "a1" and response.cseq == (7, "INVITE")
    trying = sip.parse(sip.response(request, 100, "Trying", source=("127.0.0.1", 5999), to_tag="t1"))
    assert trying.to_tag == ""  # RFC 3261 8.2.6.2: no tag on 100


@pytest.mark.parametrize(
    "datagram",
    [
        b"",
        b"\x00\xff" * 40,
        b"hello world\r\n\r\n",
        b"INVITE sip:a@b SIP/2.0\r\nVia: SIP/2.0/UDP x;branch=z9hG4bK1\r\n\r\n",  # no From/To/Call-ID/CSeq
        invite_bytes().replace(b"CSeq: 7 INVITE", b"CSeq: 7 BYE"),
        invite_bytes().replace(b"CSeq: 7 INVITE", b"CSeq: seven INVITE"),
        invite_bytes()[:-40],  # body shorter than Content-Length
        b"SIP/2.0 2000 OK\r\n\r\n",
        invite_bytes().replace(b"Subject", b"Sub ject"),
        "INVITE sip:ü@b SIP/2.0\r\n\r\n".encode("latin-1"),
    ],
)
def test_malformed_sip_raises(datagram):
    with pytest.raises(sip.SipError):
        sip.parse(datagram)


def test_negotiate_takes_the_offerers_order_and_telephone_event():
    negotiated = negotiate(OFFER)
    assert (negotiated.codec, negotiated.payload_type, negotiated.dtmf_payload_type) == ("PCMA", 8, 101)
    assert negotiated.remote == ("127.0.0.1", 4000) and negotiated.direction == "recvonly"
    answer = answer_sdp(negotiated, "127.0.0.1", 30000, 1, 1).decode()
    assert "m=audio 30000 RTP/AVP 8 101\r\n" in answer and "a=rtpmap:101 telephone-event/8000" in answer
    assert "a=fmtp:101 0-15" in answer and "a=recvonly" in answer
    assert "m=video 0 RTP/AVP 97" in answer  # the same number of m= lines, the others rejected


def test_negotiate_static_payload_types_and_refusals():
    plain = b"v=0\r\nc=IN IP4 127.0.0.1\r\nm=audio 4000 RTP/AVP 0\r\n"
    assert negotiate(plain).codec == "PCMU"
    assert negotiate(plain.replace(b"RTP/AVP 0", b"RTP/AVP 9 18")) is None  # G.722, G.729
    assert negotiate(plain.replace(b"RTP/AVP", b"RTP/SAVP")) is None  # SRTP
    assert negotiate(plain.replace(b"4000", b"0")) is None  # a rejected stream


# -- RTP and the jitter buffer ---------------------------------------------------------------------


def rtp(seq: int, ts: int, payload: bytes, pt: int = 0, ssrc: int = 0x1234, marker: bool = False) -> bytes:
    return struct.pack("!BBHII", 0x80, (0x80 if marker else 0) | pt, seq & 0xFFFF, ts & 0xFFFFFFFF, ssrc) + payload


def packet(seq: int, value: int, ssrc: int = 1, pt: int = 0, samples: int = 160, ts_base: int = 1000) -> RtpPacket:
    return RtpPacket(
        pt, False, seq & 0xFFFF, (ts_base + seq * samples) & 0xFFFFFFFF, ssrc, bytes([value]) * samples
    )


def play(buffer: JitterBuffer, packets) -> bytes:
    out = b"".join(b"".join(buffer.push(p)) for p in packets)
    return out + b"".join(buffer.flush())


def test_parse_rtp_headers():
    assert parse_rtp(rtp(5, 160, b"ab", pt=8, marker=True)) == RtpPacket(8, True, 5, 160, 0x1234, b"ab")
    csrc_ext_pad = bytearray(rtp(1, 2, b""))
    csrc_ext_pad[0] |= 0x30 | 1  # padding, extension, one CSRC
    csrc_ext_pad += b"CSRC" + b"\xbe\xde\x00\x01" + b"EXT!" + b"payload" + b"\x00\x00\x03"
    assert parse_rtp(bytes(csrc_ext_pad)).payload == b"payload"
    assert parse_rtp(bytes([0x80, 200]) + bytes(26)) is None  # RTCP sender report
    for bad in (b"", b"\x80\x00\x00", b"\x40" + bytes(20), bytes([0x90, 0, 0, 0]) + bytes(8)):
        with pytest.raises(ValueError):
            parse_rtp(bad)


def test_jitter_buffer_reorders_and_fills_losses_with_silence():
    buffer = JitterBuffer(payload_type=0, silence_byte=0xFF, depth_packets=3)
    order = [0, 2, 1, 3, 5, 4, 6, 9, 8, 10, 11, 12, 13]  # 7 never arrives
    out = play(buffer, [packet(seq, seq) for seq in order])
    expected = b"".join(bytes([0xFF if seq == 7 else seq]) * 160 for seq in range(14))
    assert out == expected
    assert buffer.stats.lost == 1 and buffer.stats.reordered == 3


def test_jitter_buffer_drops_duplicates_and_late_packets_and_wraps():
    buffer = JitterBuffer(payload_type=0, silence_byte=0xFF, depth_packets=2)
    seqs = [65533, 65535, 65535, 0, 65534, 1, 65533, 2]
    out = play(buffer, [packet(seq, seq % 251) for seq in seqs])
    assert out == b"".join(bytes([seq % 251]) * 160 for seq in (65533, 65534, 65535, 0, 1, 2))
    assert buffer.stats.duplicate == 1 and buffer.stats.late == 1 and buffer.stats.lost == 0


def test_jitter_buffer_dtmf_and_silence_suppression_keep_the_timeline():
    buffer = JitterBuffer(payload_type=0, silence_byte=0xFF, depth_packets=3)
    packets = [packet(0, 1), packet(1, 1)]
    packets += [RtpPacket(101, False, seq, 1000 + 2 * 160, 1, b"\x01\x0a\x00\xa0") for seq in (2, 3, 4)]  # DTMF
    packets += [packet(5, 2)]  # audio resumes where the event ended: 3 packets of time later
    packets += [RtpPacket(0, True, 6, 1000 + 20 * 160, 1, bytes([3]) * 160)]  # after 14 packets of silence
    out = play(buffer, packets)
    assert (
        out
        == bytes([1]) * 320 + bytes([0xFF]) * 480 + bytes([2]) * 160 + bytes([0xFF]) * 14 * 160 + bytes([3]) * 160
    )
    assert buffer.stats.lost == 0


def test_jitter_buffer_follows_a_new_ssrc_and_a_restart():
    buffer = JitterBuffer(payload_type=0, silence_byte=0xFF, depth_packets=3)
    first = [packet(seq, 1, ssrc=1) for seq in range(100, 104)]
    second = [packet(seq, 2, ssrc=2, ts_base=999_999) for seq in range(7, 10)]
    stale = packet(104, 9, ssrc=1)
    restart = [packet(seq, 3, ssrc=2, ts_base=5) for seq in range(40000, 40003)]
    out = play(buffer, [*first, second[0], stale, *second[1:], *restart])
    # The restart's first packet is dropped as a possible stray; the next one in sequence confirms it.
    assert out == bytes([1]) * 640 + bytes([2]) * 480 + bytes([3]) * 320
    assert buffer.stats.ssrc_changes == 1 and buffer.stats.restarts == 1 and buffer.stats.late == 2


def test_jitter_buffer_idle_fill_is_not_filled_twice():
    buffer = JitterBuffer(payload_type=8, silence_byte=0xD5, depth_packets=0)
    out = b"".join(buffer.push(packet(0, 1, pt=8)))
    out += buffer.fill_silence(800)  # 100 ms of stall filled in real time
    out += b"".join(buffer.push(packet(10, 2, pt=8)))  # the sender's timestamps jumped 9 packets
    assert out == bytes([1]) * 160 + bytes([0xD5]) * 1440 + bytes([2]) * 160


def test_port_pool_hands_out_even_ports_round_robin():
    pool = PortPool(10001, 10006)
    assert [pool.acquire(), pool.acquire(), pool.acquire(), pool.acquire()] == [10002, 10004, 10006, None]
    pool.release(10004)
    pool.release(10004)
    assert (pool.acquire(), pool.acquire()) == (10004, None)


SDP = ("198.51.100.7", 22730)  # what the caller's SDP says (its public address, seen through STUN)
NATTED = ("127.0.0.1", 2730)  # where its packets come from
OTHER_SOURCE = ("127.0.0.1", 4444)


def latch(mode: str = "learn") -> SourceLatch:
    return SourceLatch(RtpSource(mode), lambda host: host.startswith("127."))


def admit_all(latch_: SourceLatch, source, seqs, now: float = 0.0) -> list[tuple[Verdict, list[int]]]:
    out = []
    for seq in seqs:
        verdict, playable = latch_.admit(source, packet(seq, 1), now)
        out.append((verdict, [p.sequence for p in playable]))
    return out


def test_rtp_source_is_learned_after_probation_with_no_audio_lost():
    nat = latch()
    nat.expect(SDP)
    held = admit_all(nat, NATTED, [10, 11, 12])
    assert held == [(Verdict.HELD, [])] * 3 and nat.locked is None and nat.pending == 3
    assert admit_all(nat, NATTED, [13, 14]) == [(Verdict.MEDIA, [10, 11, 12, 13]), (Verdict.MEDIA, [14])]
    assert nat.locked == NATTED and nat.learned == 1 and nat.dropped == 0
    # Locked now: the SDP's own address is just another source on probation; one outside --allow
    # is foreign, dropped unparsed.
    assert admit_all(nat, SDP, [500]) == [(Verdict.HELD, [])]
    assert nat.worth_parsing(("203.0.113.9", 5000)) is False
    assert nat.admit(("203.0.113.9", 5000), None, 0.0) == (Verdict.FOREIGN, [])
    assert nat.dropped == 1 and nat.let_go() == 1 and nat.dropped == 2

    direct = latch()
    direct.expect(SDP)  # packets from the SDP's address are media at once, even outside --allow
    assert admit_all(direct, SDP, [7]) == [(Verdict.MEDIA, [7])] and direct.learned == 0


def test_rtp_source_probation_restarts_on_a_broken_sequence_and_a_new_source():
    nat = latch()
    nat.expect(SDP)
    admit_all(nat, NATTED, [10, 11])
    admit_all(nat, NATTED, [40])  # out of sequence: probation starts over from it
    admit_all(nat, OTHER_SOURCE, [1])  # another source: starts over again
    assert nat.dropped == 3 and nat.pending == 1 and nat.locked is None
    assert admit_all(nat, OTHER_SOURCE, [2, 3, 4])[-1] == (Verdict.MEDIA, [1, 2, 3, 4])
    assert nat.let_go() == 0


def test_a_locked_rtp_source_is_taken_over_only_once_it_is_quiet():
    nat = latch()
    nat.expect(SDP)
    admit_all(nat, NATTED, range(0, 4), now=10.0)
    # An injector in sequence, interleaved with the call's source: each of the call's packets sends it
    # back to the start of its probation, so it never plays.
    for i in range(8):
        assert admit_all(nat, NATTED, [4 + i], now=10.0 + i * 0.02) == [(Verdict.MEDIA, [4 + i])]
        assert admit_all(nat, OTHER_SOURCE, [100 + i], now=10.0 + i * 0.02) == [(Verdict.HELD, [])]
    assert nat.locked == NATTED and nat.dropped + nat.pending == 8
    # In sequence between two of the call's packets (a sender with long gaps): locked out, dropped.
    verdicts = admit_all(nat, OTHER_SOURCE, range(108, 112), now=10.5)
    assert verdicts[-1] == (Verdict.LOCKED_OUT, []) and nat.dropped == 12 and nat.pending == 0
    # The call's source goes quiet (a NAT rebinding): the newcomer takes over with its next packet.
    assert admit_all(nat, OTHER_SOURCE, [112], now=11.2) == [(Verdict.MEDIA, [112])]
    assert nat.locked == OTHER_SOURCE and nat.learned == 2
    assert admit_all(nat, NATTED, [12], now=11.3) == [(Verdict.HELD, [])]  # the old one is a stranger now

    nat.expect(("127.0.0.1", 6000))  # a re-INVITE moves the media: learning starts over
    assert nat.locked is None and nat.dropped == 13
    assert admit_all(nat, ("127.0.0.1", 6000), [1]) == [(Verdict.MEDIA, [1])]


def test_rtp_source_sdp_takes_only_the_sdps_address():
    strict = latch("sdp")
    strict.expect(SDP)
    assert strict.worth_parsing(NATTED) is False
    assert [strict.admit(NATTED, None, 0.0)[0] for _ in range(10)] == [Verdict.FOREIGN] * 10
    assert strict.locked is None and strict.dropped == 10
    assert admit_all(strict, SDP, [3]) == [(Verdict.MEDIA, [3])]


# -- end to end: helpers ---------------------------------------------------------------------------


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rtp_port_range(width: int = 200) -> str:
    """A random ``LO-HI`` so that gateways of test runs side by side rarely meet (they skip busy ports)."""
    low = random.Random(os.getpid() + time.monotonic_ns()).randrange(40000, 60000 - width, 2)
    return f"{low}-{low + width}"


@pytest.fixture(scope="module")
def call_audio() -> tuple[np.ndarray, tuple[int, int]]:
    """0.4 s of silence, a sentence, 0.7 s of silence, at 8 kHz; and where the speech is, in ms."""
    spoken = speech(SENTENCE, rate_hz=RATE_HZ)
    audio = np.concatenate([silence(0.4, RATE_HZ), spoken, silence(0.7, RATE_HZ)])
    return audio, speech_span_ms(audio)


def speech_span_ms(audio: np.ndarray) -> tuple[int, int]:
    loud = np.flatnonzero(np.abs(audio) > 0.02)
    return int(loud[0] * 1000 / RATE_HZ), int(loud[-1] * 1000 / RATE_HZ)


def check_finals(lines: list[dict], span_ms: tuple[int, int], call_id: str | None = None, slack_ms: int = 600):
    """Finals exist, are numbered 0..n-1 with the call's ids, and lie around the speech."""
    finals = [line for line in lines if line["is_final"]]
    assert finals, f"no final in {lines}"
    assert [f["utterance_index"] for f in finals] == list(range(len(finals)))
    for final in finals:
        assert set(final) == {"call_id", "from", "to", "utterance_index", "start_ms", "end_ms", "text", "is_final"}
        assert isinstance(final["text"], str)
        if call_id is not None:
            assert final["call_id"] == call_id
        assert span_ms[0] - slack_ms <= final["start_ms"] < final["end_ms"] <= span_ms[1] + slack_ms, (
            final,
            span_ms,
        )
    assert finals[0]["start_ms"] <= span_ms[0] + slack_ms
    return finals


def call_stats(log: str, call_id: str) -> dict[str, int]:
    """The packet counts of the gateway's "call ... ended" line."""
    line = log.split(f"call {call_id} ended", 1)[1].split("\n", 1)[0]
    return {
        name: int(count) for count, name in re.findall(r"(\d+) (lost|late|duplicate|reordered|SSRC changes)", line)
    }


class Gateway:
    """The gateway as a subprocess, through its command line."""

    def __init__(self, tmp: Path, server: str, *extra: str):
        self.sip_port = free_port()
        self.jsonl = tmp / "results.jsonl"
        self.log = tmp / "gateway.log"
        options = f"--server {server} --bind 127.0.0.1 --sip-port {self.sip_port} --rtp-ports {rtp_port_range()}"
        command = [sys.executable, str(GATEWAY), *options.split(), "--jsonl", str(self.jsonl), *extra]
        self._log_file = self.log.open("w")
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=self._log_file)
        deadline = time.monotonic() + 30
        while "gateway ready" not in self.log.read_text():
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.05)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.sip_port)

    def all_lines(self, call_id: str | None = None) -> list[dict]:
        """Every line of the JSONL output (results and end-of-call lines), of one call or all."""
        if not self.jsonl.exists():
            return []
        lines = [json.loads(line) for line in self.jsonl.read_text().splitlines()]
        return [line for line in lines if call_id is None or line["call_id"] == call_id]

    def lines(self, call_id: str | None = None, **match) -> list[dict]:
        """The result lines."""
        lines = [line for line in self.all_lines(call_id) if "event" not in line]
        return [line for line in lines if all(line[k] == v for k, v in match.items())]

    def end_line(self, call_id: str) -> dict:
        """The call's end-of-call line (it is written before the call's "ended" log line)."""
        ends = [line for line in self.all_lines(call_id) if line.get("event") == "call_ended"]
        assert len(ends) == 1, self.all_lines(call_id)
        return ends[0]

    def wait_log(self, text: str, timeout_s: float = 15.0) -> str:
        deadline = time.monotonic() + timeout_s
        while text not in (log := self.log.read_text()):
            assert time.monotonic() < deadline, f"{text!r} not in the gateway's log:\n{log[-3000:]}"
            time.sleep(0.05)
        return log

    def wait_ended(self, call_id: str, timeout_s: float = 15.0) -> list[dict]:
        self.wait_log(f"call {call_id} ended", timeout_s)
        return self.lines(call_id)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> str:
        if self.alive():
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()
        return self.log.read_text()


class Phone:
    """A crafted SIP user agent client on a loopback UDP socket."""

    def __init__(self, gateway: tuple[str, int], codecs: str = "0 8 101", media: socket.socket | None = None):
        self.gateway = gateway
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        # RTP goes out of this socket, whose port the offer names: the gateway takes media from there only.
        self.media = media or socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if media is None:
            self.media.bind(("127.0.0.1", 0))
        self.media_port = self.media.getsockname()[1]
        self.call_id = f"{uuid.uuid4().hex}@127.0.0.1"
        self.tag = uuid.uuid4().hex[:8]
        self.to_tag = ""
        self.cseq = 1
        self.invite_branch = sip.new_branch()
        self.codecs = codecs
        self.rtp: tuple[str, int] | None = None

    def close(self):
        self.sock.close()
        self.media.close()

    def request(self, method: str, *, branch: str | None = None, body: bytes = b"") -> bytes:
        to = "<sip:asr@127.0.0.1>" + (f";tag={self.to_tag}" if self.to_tag and method != "CANCEL" else "")
        headers = [
            f"{method} sip:asr@127.0.0.1:{self.gateway[1]} SIP/2.0",
            f"Via: SIP/2.0/UDP 127.0.0.1:{self.port};branch={branch or sip.new_branch()};rport",
            "Max-Forwards: 70",
            f"From: <sip:phone{self.port}@127.0.0.1>;tag={self.tag}",
            f"To: {to}",
            f"Call-ID: {self.call_id}",
            f"CSeq: {self.cseq} {method}",
            f"Contact: <sip:phone@127.0.0.1:{self.port}>",
        ]
        if body:
            headers.append("Content-Type: application/sdp")
        headers.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(headers) + "\r\n\r\n").encode() + body

    def send(self, data: bytes) -> None:
        self.sock.sendto(data, self.gateway)

    def receive(self, timeout_s: float = 5.0) -> sip.SipMessage:
        self.sock.settimeout(timeout_s)
        data, _ = self.sock.recvfrom(65535)
        return sip.parse(data)

    def final(self, timeout_s: float = 8.0) -> tuple[list[int], sip.SipMessage]:
        """Read responses until a final one; return every status seen and the final response."""
        statuses = []
        while True:
            response = self.receive(timeout_s)
            statuses.append(response.status)
            if response.status >= 200:
                return statuses, response

    def offer(self) -> bytes:
        rtpmap = {"0": "PCMU/8000", "8": "PCMA/8000", "101": "telephone-event/8000", "9": "G722/8000"}
        lines = ["v=0", "o=- 1 1 IN IP4 127.0.0.1", "s=-", "c=IN IP4 127.0.0.1", "t=0 0"]
        lines.append(f"m=audio {self.media_port} RTP/AVP {self.codecs}")
        lines += [f"a=rtpmap:{pt} {rtpmap[pt]}" for pt in self.codecs.split()]
        return ("\r\n".join([*lines, "a=sendrecv"]) + "\r\n").encode()

    def invite(self) -> sip.SipMessage:
        self.invite_data = self.request("INVITE", branch=self.invite_branch, body=self.offer())
        self.send(self.invite_data)
        self.statuses, response = self.final()
        if response.status == 200:
            self.to_tag = response.to_tag
            answer = negotiate(response.body)
            self.rtp = answer.remote
            self.codec = answer.codec
        self.send(self.request("ACK", branch=self.invite_branch if response.status >= 300 else None))
        return response

    def bye(self) -> sip.SipMessage:
        self.cseq += 1
        self.send(self.request("BYE"))
        while (response := self.receive()).cseq[1] != "BYE":  # skip retransmitted 200s to the INVITE
            pass
        return response

    def expect_bye(self, timeout_s: float) -> sip.SipMessage:
        deadline = time.monotonic() + timeout_s
        while True:
            message = self.receive(max(deadline - time.monotonic(), 0.01))
            if message.method == "BYE":
                self.sock.sendto(sip.response(message, 200, "OK", source=("127.0.0.1", 0)), self.gateway)
                return message


def g711(audio: np.ndarray, codec: str) -> bytes:
    return encode(audio, "MULAW" if codec == "PCMU" else "ALAW")


def rtp_stream(payload: bytes, pt: int, ssrc: int = 0x1111, seq0: int = 65500, ts0: int = 1 << 31) -> list[bytes]:
    """20 ms packets, the sequence number wrapping early on."""
    return [
        rtp(seq0 + i, ts0 + i * 160, payload[offset : offset + 160], pt, ssrc)
        for i, offset in enumerate(range(0, len(payload), 160))
    ]


def send_paced(
    sock: socket.socket,
    destination: tuple[str, int],
    packets: list[bytes],
    pace_s: float = 0.01,
    stop: threading.Event | None = None,
):
    start = time.monotonic()
    for i, data in enumerate(packets):
        if stop is not None and stop.is_set():
            return
        if data:
            try:
                sock.sendto(data, destination)
            except OSError:  # the test closed the socket: stop
                return
        time.sleep(max(start + (i + 1) * pace_s - time.monotonic(), 0))


# -- end to end: fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    # Admission by load off: ten calls and their senders on a 2-core host can pass the engine's 0.9 limit,
    # and these tests are about the gateway (its 503 for an overloaded server: test_an_overloaded_server...).
    with LocalServer(engine=EngineConfig(max_sessions=16, max_batch=16, admit_load=0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def webhook():
    hook = WebhookServer()
    thread = threading.Thread(target=hook.serve_forever, daemon=True)
    thread.start()
    yield hook
    hook.shutdown()


@pytest.fixture(scope="module")
def gateway(server, webhook, tmp_path_factory):
    audiosocket_port, ari_port = free_port(socket.SOCK_STREAM), free_port()
    options = f"--rtp-timeout-s 3 --ring-ms 400 --max-calls 16 --audiosocket-port {audiosocket_port}"
    options += f" --ari-rtp-port {ari_port}"
    gw = Gateway(tmp_path_factory.mktemp("gateway"), server.address, *options.split(), "--webhook", webhook.url)
    gw.audiosocket_port, gw.ari_port = audiosocket_port, ari_port
    yield gw
    log = gw.stop()
    assert gw.process.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log


@pytest.fixture
def phone(gateway):
    phones = []

    def make(**kwargs) -> Phone:
        phones.append(Phone(gateway.address, **kwargs))
        return phones[-1]

    yield make
    for p in phones:
        p.close()


# -- end to end: SIP -------------------------------------------------------------------------------


def test_options_unknown_methods_and_retransmissions(gateway, phone):
    p = phone()
    options = p.request("OPTIONS", branch="z9hG4bKopt1")
    p.send(options)
    first = p.receive()
    assert first.status == 200 and "INVITE" in first.get("allow")
    p.sock.settimeout(5)
    p.send(options)  # a retransmission: the same response, byte for byte
    again = p.sock.recv(65535)
    p.send(options)
    assert p.sock.recv(65535) == again and sip.parse(again).to_tag == first.to_tag
    for method in ("INFO", "REGISTER", "FOOBAR"):
        p.send(p.request(method))
        assert p.receive().status == 501
    p.send(p.request("BYE"))
    assert p.receive().status == 481


def test_invite_without_g711_is_refused_with_488(gateway, phone):
    p = phone(codecs="9")
    assert p.invite().status == 488
    assert p.statuses[0] == 100


def test_cancel_while_ringing(gateway, phone):
    p = phone()
    p.send(p.request("INVITE", branch=p.invite_branch, body=p.offer()))
    assert [p.receive().status, p.receive().status] == [100, 180]
    p.send(p.request("CANCEL", branch=p.invite_branch))
    responses = {(r.cseq[1], r.status) for r in (p.receive(), p.receive())}
    assert responses == {("CANCEL", 200), ("INVITE", 487)}
    p.send(p.request("ACK", branch=p.invite_branch))
    p.send(p.request("CANCEL", branch=sip.new_branch()))  # nothing to cancel
    assert p.receive().status == 481


def test_no_rtp_ends_the_call_cleanly(gateway, phone):
    p = phone()
    assert p.invite().status == 200
    p.send(p.invite_data)  # a retransmitted INVITE: answered again, no second call
    assert p.receive().status == 200
    bye = p.expect_bye(timeout_s=10)  # the gateway's RTP timeout is 3 s
    assert bye.call_id == p.call_id and bye.from_tag == p.to_tag and bye.to_tag == p.tag
    log = gateway.wait_log(f"call {p.call_id} ended (no RTP at all for 3 s) with no audio: no RTP arrived")
    assert log.count(f"call {p.call_id} from") == 1
    assert gateway.lines(p.call_id) == []
    end = gateway.end_line(p.call_id)
    assert end["reason"] == "no RTP at all for 3 s; no RTP arrived"
    assert (end["ok"], end["audio_ms"], end["finals"], end["from"]) == (
        False,
        0,
        0,
        f"sip:phone{p.port}@127.0.0.1",
    )


@needs_espeak
def test_a_caller_that_stops_sending_gets_its_final_then_a_bye(gateway, phone, call_audio):
    """Silence is fed while no packet arrives (a phone with silence suppression, a stalled network), so
    the server ends the utterance without waiting for the RTP timeout."""
    audio, span_ms = call_audio
    p = phone()
    assert p.invite().status == 200
    speech_only = audio[: span_ms[1] * RATE_HZ // 1000 + 80]
    with p.media as media:
        send_paced(media, p.rtp, rtp_stream(g711(speech_only, p.codec), pt=0))
    deadline = time.monotonic() + 2.5  # the RTP timeout is 3 s
    while not [line for line in gateway.lines(p.call_id) if line["is_final"]]:
        assert time.monotonic() < deadline, "no final while the caller sent nothing"
        time.sleep(0.05)
    assert f"call {p.call_id} ended" not in gateway.log.read_text()
    p.expect_bye(timeout_s=10)
    gateway.wait_log(f"call {p.call_id} ended (RTP stopped for 3 s)")
    check_finals(gateway.lines(p.call_id), span_ms, p.call_id)


@needs_espeak
def test_crafted_call_with_reordering_loss_dtmf_and_an_ssrc_change(gateway, phone, call_audio):
    audio, span_ms = call_audio
    p = phone(codecs="8 0 101")
    assert p.invite().status == 200 and p.codec == "PCMA"
    p.cseq += 1  # a re-INVITE (a session refresh) gets the same answer
    p.send(p.request("INVITE", body=p.offer()))
    reinvite = p.final()[1]
    assert reinvite.status == 200 and negotiate(reinvite.body).remote == p.rtp
    p.send(p.request("ACK"))
    payload = g711(audio, "PCMA")
    half = len(payload) // 320 * 160
    packets = rtp_stream(payload[:half], pt=8) + rtp_stream(payload[half:], pt=8, ssrc=0x2222, seq0=7, ts0=123)
    # DTMF "5" instead of 4 packets of the leading silence, as a phone sends it (RFC 4733: the event's
    # timestamp on all of them, the end bit on the last, repeated); losses, duplicates, swaps.
    event_ts = packets[5][4:8]
    for i, flags in ((5, 0x0A), (6, 0x0A), (7, 0x8A), (8, 0x8A)):
        packets[i] = packets[i][:1] + bytes([101]) + packets[i][2:4] + event_ts + packets[i][8:12]
        packets[i] += bytes([5, flags]) + (160 * (i - 4)).to_bytes(2, "big")
    for i in range(20, len(packets) - 2, 9):
        packets[i], packets[i + 1] = packets[i + 1], packets[i]
    for i in range(31, len(packets), 23):
        packets[i] = b""
    packets[40:40] = [packets[38]]
    rtcp = bytes([0x80, 201, 0, 1]) + bytes(4)
    packets[10:10] = [rtcp]
    with p.media as media:
        send_paced(media, p.rtp, packets, pace_s=0.01)
    time.sleep(0.1)
    assert p.bye().status == 200
    lines = gateway.wait_ended(p.call_id)
    finals = check_finals(lines, span_ms, p.call_id)
    assert finals[0]["from"] == f"sip:phone{p.port}@127.0.0.1" and finals[0]["to"] == "sip:asr@127.0.0.1"
    stats = call_stats(gateway.log.read_text(), p.call_id)
    assert stats["SSRC changes"] == 1 and stats["lost"] >= 4 and stats["reordered"] >= 5 and stats["late"] >= 1
    dtmf = [line for line in gateway.all_lines(p.call_id) if line.get("event") == "dtmf"]
    assert [(d["digit"], d["from"]) for d in dtmf] == [("5", f"sip:phone{p.port}@127.0.0.1")]
    assert 60 <= dtmf[0]["at_ms"] <= 200  # after the 5 packets of silence before it (jitter-buffered)


@needs_espeak
def test_malformed_datagrams_are_ignored(gateway, phone, call_audio):
    audio, span_ms = call_audio
    p = phone()
    assert p.invite().status == 200
    junk = [b"", b"\x00", b"\xff" * 11, b"\x80", bytes(range(256)), b"INVITE\r\n\r\n", b"SIP/2.0 200\r\n\r\n"]
    packets = rtp_stream(g711(audio, p.codec), pt=0 if p.codec == "PCMU" else 8)
    with p.media as media:
        for i, data in enumerate(junk):
            packets.insert(3 + 7 * i, data + b"junk")
            media.sendto(data or b"\r\n", gateway.address)
            media.sendto(bytes([0x40]) + data + bytes(16), gateway.address)  # RTP version 1 to the SIP port
        send_paced(media, p.rtp, packets)
    assert p.bye().status == 200
    check_finals(gateway.wait_ended(p.call_id), span_ms, p.call_id)
    assert "ignored malformed SIP datagram" in gateway.log.read_text()
    assert "ignored malformed RTP datagram" in gateway.log.read_text()
    assert gateway.alive()


@needs_espeak
def test_ten_concurrent_calls(gateway, phone, call_audio):
    audio, span_ms = call_audio
    phones = [phone() for _ in range(10)]

    def call(p: Phone):
        assert p.invite().status == 200
        with p.media as media:
            send_paced(media, p.rtp, rtp_stream(g711(audio, p.codec), pt=0, ssrc=p.port))
        assert p.bye().status == 200

    threads = [threading.Thread(target=call, args=(p,)) for p in phones]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for p in phones:
        lines = gateway.wait_ended(p.call_id)
        assert any(line["is_final"] for line in lines), (  # (the gateway's log read only on a failure)
            f"no final for call {p.call_id}; the gateway logged "
            f"{[line for line in gateway.log.read_text().splitlines() if f'call {p.call_id} ended' in line]}"
        )
        check_finals(lines, span_ms, p.call_id)


# -- end to end: real peers ------------------------------------------------------------------------


def write_wav(path: Path, audio: np.ndarray) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE_HZ)
        wav.writeframes(encode(audio, "LINEAR16"))


# What baresip 1.0 needs to call on loopback only: without net_interface it offers (and sends RTP from)
# the first non-loopback address; without sip_listen it takes port 5060.
BARESIP_CONFIG = """\
sip_listen 127.0.0.1:{sip_port}
net_interface 127.0.0.1
audio_source aufile,{wav}
module_path /usr/lib/baresip/modules
module g711.so
module aufile.so
module_app account.so
module_app menu.so
"""


needs_baresip = pytest.mark.skipif(
    shutil.which("baresip") is None, reason="needs baresip (apt-get install baresip-core)"
)


def start_baresip(home: Path, wav: Path, account: str, dial: str, config: str = "") -> subprocess.Popen:
    """baresip with its config and account in ``home``, dialling ``dial`` and playing ``wav``; it hangs up
    at the file's end and then idles until stopped (:func:`stop_baresip`) or 30 s.

    Its SIP port is one found free a moment before, which another process (another caller's RTP socket, one
    started beside it) can take first: baresip then exits at once ("Address already in use") and never
    dials. It is started again on another port."""
    home.mkdir()
    (home / "accounts").write_text(account + "\n")
    command = ["baresip", "-f", str(home), "-e", f"/dial {dial}", "-t", "30"]
    for _ in range(5):
        (home / "config").write_text(BARESIP_CONFIG.format(sip_port=free_port(), wav=wav) + config)
        run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            run.wait(timeout=0.3)
        except subprocess.TimeoutExpired:
            return run  # (listening: a bind failure ends it within milliseconds)
        output = run.communicate()[0]
        if "Address already in use" not in output:
            raise AssertionError(f"baresip exited at start ({run.returncode}):\n{output[-2000:]}")
    raise AssertionError(f"baresip found no free SIP port in 5 tries:\n{output[-2000:]}")


def stop_baresip(run: subprocess.Popen) -> str:
    """Stop it (if it runs) and return what it printed."""
    run.terminate()
    try:
        return run.communicate(timeout=10)[0]
    except subprocess.TimeoutExpired:
        run.kill()
        return run.communicate()[0]


def call_line(gateway: Gateway, started: str) -> tuple[str, str]:
    """The gateway's "call ID from ... to ...: CODEC on RTP port N (SIP over T)" line holding ``started``,
    once logged, and its call id."""
    line = next(line for line in gateway.wait_log(started, timeout_s=20).splitlines() if started in line)
    return line, line.split(" call ", 1)[1].split(" ", 1)[0]


@needs_espeak
@needs_baresip
def test_baresip_calls_pcmu_and_pcma(gateway, tmp_path, call_audio):
    """baresip plays the file as G.711 and hangs up at its end (then idles until -t: it is stopped)."""
    audio, span_ms = call_audio
    wav = tmp_path / "in.wav"
    write_wav(wav, audio)
    runs = {}
    try:
        for codec in ("PCMU", "PCMA"):
            account = f"<sip:{codec.lower()}@127.0.0.1>;regint=0;audio_codecs={codec}"
            runs[codec] = start_baresip(tmp_path / codec, wav, account, f"sip:asr@127.0.0.1:{gateway.sip_port}")
        for codec, run in runs.items():
            _, call_id = call_line(
                gateway, f" from sip:{codec.lower()}@127.0.0.1 to sip:asr@127.0.0.1:{gateway.sip_port}: {codec} on"
            )
            gateway.wait_log(f"call {call_id} ended (the caller hung up)", timeout_s=20)
            check_finals(gateway.lines(call_id), span_ms, call_id)
            output = stop_baresip(run)
            assert "Call established" in output and "terminated" in output, output[-2000:]
    finally:
        for run in runs.values():
            stop_baresip(run)


@needs_espeak
@needs_baresip
def test_baresip_calls_over_tcp(gateway, tmp_path, call_audio):
    """SIP over TCP (a PBX or trunk that requires it): the INVITE, its answer, the caller's BYE and its 200
    go over one connection; the media is the same RTP."""
    audio, span_ms = call_audio
    wav = tmp_path / "in.wav"
    write_wav(wav, audio)
    account = "<sip:tcp@127.0.0.1;transport=tcp>;regint=0;audio_codecs=PCMU"
    run = start_baresip(tmp_path / "baresip", wav, account, f"sip:asr@127.0.0.1:{gateway.sip_port};transport=tcp")
    try:
        line, call_id = call_line(
            gateway, f" from sip:tcp@127.0.0.1 to sip:asr@127.0.0.1:{gateway.sip_port};transport=tcp"
        )
        assert line.endswith("(SIP over TCP)") and ": PCMU on RTP port" in line, line
        gateway.wait_log(f"call {call_id} ended (the caller hung up)", timeout_s=20)
        check_finals(gateway.lines(call_id), span_ms, call_id)
    finally:
        output = stop_baresip(run)
    assert "Call established" in output and "terminated" in output, output[-2000:]


class StunServer(threading.Thread):
    """A STUN server (RFC 5389 Binding) that tells every client it is behind a NAT: the mapped address
    it answers is ``public`` with the client's port + 20000, so the client's SDP names an address and
    port its packets never come from (as a phone behind a NAT's does)."""

    COOKIE = 0x2112A442

    def __init__(self, public: str = "198.51.100.7"):
        super().__init__(daemon=True)
        self.public = socket.inet_aton(public)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                data, client = self.sock.recvfrom(2048)
            except TimeoutError:
                continue
            if len(data) < 20 or struct.unpack_from("!HHI", data)[::2] != (0x0001, self.COOKIE):
                continue
            self.requests += 1
            port = (client[1] + 20000) % 65536
            (address,) = struct.unpack("!I", self.public)
            xor_mapped = struct.pack("!HHBBHI", 0x0020, 8, 0, 1, port ^ (self.COOKIE >> 16), address ^ self.COOKIE)
            header = struct.pack("!HHI", 0x0101, len(xor_mapped), self.COOKIE) + data[8:20]
            self.sock.sendto(header + xor_mapped, client)

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)
        self.sock.close()


@needs_espeak
@needs_baresip
@pytest.mark.parametrize("rtp_source", ["learn", "sdp"])
def test_baresip_behind_a_nat(rtp_source, server, gateway, tmp_path, call_audio):
    """A stock baresip that learns its public address from STUN: its SDP says 198.51.100.7 and a port
    its packets do not come from. --rtp-source learn (the default) takes the call's RTP from where it
    comes and transcribes it; sdp drops it all, and the call's end says so in the log and its line."""
    audio, span_ms = call_audio
    wav = tmp_path / "in.wav"
    write_wav(wav, audio)
    stun = StunServer()
    stun.start()
    gw = gateway if rtp_source == "learn" else Gateway(tmp_path, server.address, "--rtp-source", "sdp")
    account = (
        f"<sip:natted@127.0.0.1>;regint=0;audio_codecs=PCMU;medianat=stun;stunserver=stun:127.0.0.1:{stun.port}"
    )
    run = start_baresip(tmp_path / "baresip", wav, account, f"sip:asr@127.0.0.1:{gw.sip_port}", "module stun.so\n")
    try:
        _, call_id = call_line(gw, f" from sip:natted@127.0.0.1 to sip:asr@127.0.0.1:{gw.sip_port}: PCMU on")
        log = gw.wait_log(f"call {call_id} ended (the caller hung up)", timeout_s=20)
        end = gw.end_line(call_id)
        if rtp_source == "learn":
            check_finals(gw.lines(call_id), span_ms, call_id)
            first = re.search(rf"call {call_id}: first RTP packet from (\S+) \(learned: the SDP says (\S+)\)", log)
            assert first, log[-3000:]
            assert first[1].startswith("127.0.0.1:") and first[2].startswith("198.51.100.7:")
            assert end["ok"] and end["finals"] >= 1
        else:
            assert gw.lines(call_id) == []
            assert f"call {call_id}: dropped RTP datagram #1 from 127.0.0.1:" in log
            assert "--rtp-source sdp takes media only from the SDP's 198.51.100.7:" in log
            assert re.search(
                rf"WARNING .*call {call_id} ended \(the caller hung up\) with no audio: all \d+ RTP", log
            )
            assert not end["ok"] and end["audio_ms"] == 0 and "RTP datagrams were dropped" in end["reason"]
    finally:
        output = stop_baresip(run)
        stun.stop()
        if gw is not gateway:
            gw.stop()
    assert "Call established" in output and stun.requests >= 1, output[-2000:]


def gst_missing() -> str:
    if shutil.which("gst-launch-1.0") is None:
        return "needs gst-launch-1.0 (apt-get install gstreamer1.0-tools)"
    for element in ("wavparse", "mulawenc", "rtppcmupay", "udpsink", "audioresample"):
        if subprocess.run(["gst-inspect-1.0", element], capture_output=True).returncode != 0:
            return f"needs the GStreamer element {element} (gstreamer1.0-plugins-good, -base)"
    return ""


class LossyProxy(threading.Thread):
    """Forwards UDP to ``destination``, holding every 6th packet back by one (a swap) and dropping
    every 25th."""

    def __init__(self, destination: tuple[str, int] | None = None):
        super().__init__(daemon=True)
        self.destination = destination
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.forwarded = self.dropped = self.swapped = 0
        self.running = True

    def run(self):
        held, count = None, 0
        while self.running:
            try:
                data = self.sock.recv(65535)
            except TimeoutError:
                continue
            count += 1
            if count % 25 == 0 and held is None:
                self.dropped += 1
            elif count % 6 == 0 and held is None:
                held = data
                continue
            else:
                self.sock.sendto(data, self.destination)
                self.forwarded += 1
            if held is not None:
                self.sock.sendto(held, self.destination)
                held, self.swapped = None, self.swapped + 1

    def stop(self):
        self.running = False
        self.join(2)
        self.sock.close()


@needs_espeak
def test_gstreamer_rtp_through_a_lossy_reordering_proxy(gateway, phone, tmp_path, call_audio):
    if missing := gst_missing():
        pytest.skip(missing)
    audio, span_ms = call_audio
    wav = tmp_path / "in.wav"
    write_wav(wav, audio)
    proxy = LossyProxy()
    p = phone(codecs="0", media=proxy.sock)  # the proxy forwards from the port the offer names
    assert p.invite().status == 200
    proxy.destination = p.rtp
    proxy.start()
    pipeline = (
        f"filesrc location={wav} ! wavparse ! audioconvert ! audioresample ! audio/x-raw,rate=8000,channels=1"
        f" ! mulawenc ! rtppcmupay min-ptime=20000000 max-ptime=20000000 ! udpsink host=127.0.0.1 port={proxy.port}"
    )
    result = subprocess.run(
        ["gst-launch-1.0", "-q", *pipeline.split()], capture_output=True, text=True, timeout=30
    )
    time.sleep(0.2)
    proxy.stop()
    assert result.returncode == 0, result.stderr
    assert proxy.dropped and proxy.swapped and proxy.forwarded > 50
    assert p.bye().status == 200
    check_finals(gateway.wait_ended(p.call_id), span_ms, p.call_id)
    stats = call_stats(gateway.log.read_text(), p.call_id)
    assert stats["lost"] == proxy.dropped and stats["reordered"] == proxy.swapped


# -- end to end: AudioSocket, webhook --------------------------------------------------------------


@needs_espeak
def test_audiosocket_call_and_webhook(gateway, webhook, call_audio):
    audio, span_ms = call_audio
    call_id = uuid.uuid4()
    pcm = encode(audio, "LINEAR16")
    with socket.create_connection(("127.0.0.1", gateway.audiosocket_port), timeout=15) as conn:
        conn.sendall(b"\x01\x00\x10" + call_id.bytes)
        for offset in range(0, len(pcm), 320):
            conn.sendall(b"\x10" + len(pcm[offset : offset + 320]).to_bytes(2, "big") + pcm[offset : offset + 320])
            if offset in (3200, 6400):
                conn.sendall(b"\x03\x00\x01" + b"59"[offset // 3200 - 1 : offset // 3200])  # DTMF digits
            time.sleep(0.005)
        conn.sendall(b"\x00\x00\x00")
        assert conn.recv(1) == b""  # the gateway closes after the last final
    gateway.wait_log(f"AudioSocket call {call_id} ended (Asterisk hung up)")
    check_finals(gateway.lines(str(call_id)), span_ms, str(call_id))
    digits = [line for line in gateway.all_lines(str(call_id)) if line.get("event") == "dtmf"]
    assert [(d["digit"], d["at_ms"]) for d in digits] == [("5", 220), ("9", 420)]  # after 11 and 21 frames
    end = gateway.end_line(str(call_id))
    assert (
        end["ok"] and end["reason"] == "Asterisk hung up" and end["audio_ms"] >= len(audio) * 1000 // RATE_HZ - 20
    )
    lines = gateway.all_lines(str(call_id))
    deadline = time.monotonic() + 5
    while [line for line in webhook.received if line["call_id"] == str(call_id)] != lines:
        assert time.monotonic() < deadline, "the webhook did not get the same lines"
        time.sleep(0.05)


# -- end to end: Asterisk ARI externalMedia ---------------------------------------------------------


@needs_espeak
def test_ari_external_media_two_channels_at_once(gateway, call_audio):
    """Two external media channels send their RTP to the one ARI port, each from its own address and
    port (Asterisk's UNICASTRTP_LOCAL_ADDRESS/PORT): two calls, each its own words, keyed by the source."""
    audio, span_ms = call_audio
    other = np.concatenate([silence(0.4, RATE_HZ), speech(OTHER, rate_hz=RATE_HZ), silence(0.7, RATE_HZ)])
    streams = [rtp_stream(g711(audio, "PCMU"), pt=0, ssrc=0xA), rtp_stream(g711(other, "PCMA"), pt=8, ssrc=0xB)]
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in streams]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        call_ids = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in sockets]
        start = time.monotonic()
        for i in range(max(len(packets) for packets in streams)):
            for sock, packets in zip(sockets, streams, strict=True):
                if i < len(packets):
                    sock.sendto(packets[i], ("127.0.0.1", gateway.ari_port))
            time.sleep(max(start + (i + 1) * 0.01 - time.monotonic(), 0))
    finally:
        for sock in sockets:
            sock.close()
    texts = []
    for call_id in call_ids:
        gateway.wait_log(f"call {call_id} ended (RTP stopped for 3 s)", timeout_s=20)
        texts.append(" ".join(line["text"] for line in gateway.lines(call_id) if line["is_final"]))
        end = gateway.end_line(call_id)
        assert end["ok"] and end["finals"] >= 1 and end["audio_ms"] >= 2000, end
    check_finals(gateway.lines(call_ids[0]), span_ms, call_ids[0])
    overlap = [[len(set(t.lower().split()) & set(s.split())) for s in (SENTENCE, OTHER)] for t in texts]
    assert overlap[0][0] > overlap[0][1] and overlap[1][1] > overlap[1][0], texts
    log = gateway.log.read_text()
    assert (
        f"ARI external media call {call_ids[0]}: PCMU" in log
        and f"ARI external media call {call_ids[1]}: PCMA" in log
    )


# -- end to end: an overloaded server, a server outage -------------------------------------------------------------------


@needs_espeak
@pytest.mark.parametrize("window_s", [0, 60], ids=["overloaded", "refused-at-open"])
def test_a_server_at_capacity_gets_new_calls_a_503_with_a_retry_after(tmp_path, call_audio, window_s):
    """At capacity, a call is not answered: the gateway answers 503 with the server's retry delay, seen in its
    load (overloaded: NOT_SERVING) or, before the overload shows there, in the refusal of the call's session,
    which the gateway opens before it answers (the server's metadata says the session has an engine slot)."""
    import grpc

    from cosystream.v1 import cosystream_pb2 as pb
    from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

    audio, _ = call_audio
    # A limit so low that one live call passes it (an idle engine's load: under 0.005). A 60 s overload window
    # keeps the load service SERVING throughout: only the session's own admission refuses.
    engine = EngineConfig(max_sessions=4, max_batch=4, admit_load=0.02, overload_window_s=window_s)
    with LocalServer(engine=engine) as server, grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CosyStreamStub(channel)

        def load() -> pb.LoadStatus:
            return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).load

        def wait(condition, what: str) -> None:
            deadline = time.monotonic() + 30
            while not condition():
                assert time.monotonic() < deadline, what
                time.sleep(0.1)

        gw = Gateway(tmp_path, server.address, "--rtp-timeout-s", "10")
        phones = [Phone(gw.address) for _ in range(3)]
        first, second, third = phones
        stop = threading.Event()
        try:
            assert first.invite().status == 200  # (an idle server)
            packets = rtp_stream(g711(np.tile(audio, 20), first.codec), pt=0)
            with first.media as media:
                sender = threading.Thread(target=send_paced, args=(media, first.rtp, packets, 0.02, stop))
                sender.start()
                if window_s:
                    wait(lambda: load().engine_load >= 0.02, "no load under a live call")
                    time.sleep(2.5)  # (admission reads the last 2 s of load: the call's alone from here)
                    assert not load().overloaded
                else:
                    wait(lambda: load().overloaded, "the server never overloaded under a live call")
                refused = second.invite()
                assert (refused.status, refused.get("retry-after")) == (503, "2")
                log = gw.wait_log(f"call {second.call_id}: refused, the cosystream server {server.address} ")
                if window_s:
                    assert "refused its session (RESOURCE_EXHAUSTED: the server is at capacity" in log
                else:
                    assert "is overloaded (engine load" in log and "limit 0.02)" in log
                stop.set()
                sender.join(10)
            assert first.bye().status == 200
            wait(lambda: not load().overloaded and load().realtime_sessions == 0, "still loaded with no call")
            assert third.invite().status == 200
            assert third.bye().status == 200
            assert gw.alive()
        finally:
            stop.set()
            for p in phones:
                p.close()
            log = gw.stop()
        assert gw.process.returncode == 0 and "Traceback" not in log, log[-3000:]
        assert f"call {second.call_id} ended" not in log  # (never answered: no call to end)


@needs_espeak
def test_server_outage_ends_calls_without_a_crash(tmp_path, call_audio):
    audio, _ = call_audio
    server = LocalServer(engine=EngineConfig(max_sessions=4, max_batch=4)).start()
    server_up, gw, phones = True, None, []
    stack = contextlib.ExitStack()
    try:
        gw = Gateway(tmp_path, server.address, "--max-calls", "1", "--rtp-timeout-s", "10")
        phones = [Phone(gw.address) for _ in range(3)]
        first, second, third = phones
        assert first.invite().status == 200
        assert second.invite().status == 486  # --max-calls 1
        packets = rtp_stream(g711(np.tile(audio, 3), first.codec), pt=0)
        media = stack.enter_context(first.media)
        threading.Thread(target=send_paced, args=(media, first.rtp, packets, 0.02), daemon=True).start()
        time.sleep(1.0)
        server.stop()
        server_up = False
        first.expect_bye(timeout_s=10)
        log = gw.wait_log(f"call {first.call_id} ended")
        assert "ERROR" in log and "cosystream session failed" in log
        assert third.invite().status == 503  # the server is still down
        assert gw.alive()
        third.send(third.request("OPTIONS"))
        assert third.receive().status == 200
    finally:
        stack.close()
        for p in phones:
            p.close()
        if server_up:
            server.stop()
        if gw is not None:
            log = gw.stop()
            assert "Traceback" not in log, log
