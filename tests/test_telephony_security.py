"""The telephony gateway's access checks (docs/SECURITY.md): ``--allow`` networks for SIP and
AudioSocket, ``--max-calls``, RTP taken only from the address and port of the caller's SDP, and SIP
digest authentication (``--sip-user``/``--sip-password``).

First the pure pieces (the digest against RFC 2617's own example, the nonce rules on a fake clock,
the network list); then end to end as in ``tests/test_telephony.py``: a cosystream server in this
process, the gateway as a subprocess through its command line, crafted SIP and RTP from Python on
loopback, and baresip with credentials.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from clients.telephony import sip
from clients.telephony.config import LOOPBACK, GatewayConfig, parse_networks
from clients.telephony.security import AllowList, DigestAuth, Verdict, digest_response, parse_credentials
from clients.telephony_gateway import config_from_args, parse_args
from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from tests.speech import needs_espeak, silence, speech
from tests.test_telephony import (
    GATEWAY,
    OTHER,
    RATE_HZ,
    SENTENCE,
    Gateway,
    Phone,
    call_line,
    call_stats,
    check_finals,
    free_port,
    g711,
    needs_baresip,
    rtp_stream,
    speech_span_ms,
    start_baresip,
    stop_baresip,
    write_wav,
)

USER, PASSWORD = "alice", "correct-horse-battery-staple"


# -- digest authentication -------------------------------------------------------------------------


def test_digest_response_is_rfc_2617s_example():
    """RFC 2617 section 3.5, to the digit."""
    assert (
        digest_response(
            username="Mufasa",
            realm="testrealm@host.com",
            password="Circle Of Life",
            method="GET",
            uri="/dir/index.html",
            nonce="dcd98b7102dd2f0e8b11d0f600bfb0c093",
            nc="00000001",
            cnonce="0a4f113b",
            qop="auth",
        )
        == "6629fae49393a05397450978507c4ef1"
    )


def test_parse_credentials():
    header = (
        'Digest username="Mufasa", realm="testrealm@host.com", nonce="dcd98b71", uri="/dir/index.html",'
        ' qop=auth, nc=00000001, cnonce="0a4f113b", response="6629fae4", opaque="5ccc\\"069c"'
    )
    assert parse_credentials(header) == {
        "username": "Mufasa",
        "realm": "testrealm@host.com",
        "nonce": "dcd98b71",
        "uri": "/dir/index.html",
        "qop": "auth",
        "nc": "00000001",
        "cnonce": "0a4f113b",
        "response": "6629fae4",
        "opaque": '5ccc"069c',
    }
    assert parse_credentials("Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==") is None


def authorization(
    challenge: str,
    *,
    user: str = USER,
    password: str = PASSWORD,
    method: str = "INVITE",
    uri: str = "sip:asr@127.0.0.1",
    nc: str = "00000001",
    cnonce: str = "f00dcafe",
    **override: str,
) -> str:
    """An ``Authorization`` value answering ``challenge`` (a ``WWW-Authenticate`` value), as a UAC builds it."""
    offered = parse_credentials(challenge)
    fields = {
        "username": user,
        "realm": offered["realm"],
        "nonce": offered["nonce"],
        "uri": uri,
        "algorithm": "MD5",
        "qop": "auth",
        "nc": nc,
        "cnonce": cnonce,
    }
    fields["response"] = digest_response(
        username=user,
        realm=fields["realm"],
        password=password,
        method=method,
        uri=uri,
        nonce=fields["nonce"],
        nc=nc,
        cnonce=cnonce,
        qop="auth",
    )
    fields.update(override)
    bare = ("qop", "nc", "algorithm")
    return "Digest " + ", ".join(f"{k}={v}" if k in bare else f'{k}="{v}"' for k, v in fields.items())


UNSIGNED = (
    b"INVITE sip:asr@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:5999;branch=z9hG4bK1\r\n"
    b"From: <sip:alice@127.0.0.1>;tag=1\r\nTo: <sip:asr@127.0.0.1>\r\nCall-ID: x\r\nCSeq: 1 INVITE\r\n\r\n"
)


def signed(value: str) -> sip.SipMessage:
    """An INVITE carrying ``Authorization: value``."""
    return sip.parse(UNSIGNED.replace(b"\r\n\r\n", f"\r\nAuthorization: {value}\r\n\r\n".encode()))


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_digest_nonces_are_random_single_use_and_expire():
    clock = FakeClock()
    auth = DigestAuth(USER, PASSWORD, "cosystream", lifetime_s=30, clock=clock)
    first, second = auth.challenge(), auth.challenge()
    assert (
        parse_credentials(first)["nonce"] != parse_credentials(second)["nonce"]
        and len(parse_credentials(first)["nonce"]) == 32
    )
    assert parse_credentials(first) | {"nonce": ""} == {
        "realm": "cosystream",
        "nonce": "",
        "algorithm": "MD5",
        "qop": "auth",
    }
    assert (
        "stale" not in parse_credentials(first)
        and parse_credentials(auth.challenge(stale=True))["stale"] == "TRUE"
    )

    answer = authorization(first)
    assert auth.check(signed(answer)) is Verdict.ACCEPTED
    assert auth.check(signed(answer)) is Verdict.STALE  # a replay: the nonce is spent
    assert auth.check(signed(authorization(second, method="BYE"))) is Verdict.REJECTED  # signed for another method
    clock.now_s += 31
    assert auth.check(signed(authorization(auth.challenge()))) is Verdict.ACCEPTED  # a fresh one still works
    late = auth.challenge()
    clock.now_s += 31
    assert auth.check(signed(authorization(late))) is Verdict.STALE  # expired
    assert auth.check(signed(authorization(auth.challenge(), uri="sip:other@example"))) is Verdict.ACCEPTED


@pytest.mark.parametrize(
    "change",
    [
        {"password": "Correct-horse-battery-staple"},
        {"user": "mallory"},
        {"qop": "auth-int"},
        {"algorithm": "SHA-256"},
        {"response": "0" * 32},
        {"nc": "1"},
        {"cnonce": ""},
    ],
)
def test_digest_wrong_credentials_are_rejected(change):
    auth = DigestAuth(USER, PASSWORD, "cosystream", clock=FakeClock())
    change = dict(change)
    password, user = change.pop("password", PASSWORD), change.pop("user", USER)
    answer = authorization(auth.challenge(), user=user, password=password, **change)
    assert auth.check(signed(answer)) is Verdict.REJECTED


def test_digest_missing_credentials_and_a_bounded_nonce_table():
    auth = DigestAuth(USER, PASSWORD, "cosystream", max_nonces=4, clock=FakeClock())
    assert auth.check(sip.parse(UNSIGNED)) is Verdict.MISSING
    assert auth.check(signed(authorization(auth.challenge(), realm="elsewhere"))) is Verdict.MISSING
    assert auth.check(signed("Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==")) is Verdict.MISSING
    oldest = auth.challenge()
    for _ in range(4):
        auth.challenge()
    assert auth.check(signed(authorization(oldest))) is Verdict.STALE  # pushed out by a flood of challenges


# -- networks and flags ----------------------------------------------------------------------------


def test_allow_list():
    default = AllowList(LOOPBACK)
    assert default.describe() == "127.0.0.0/8, ::1"
    assert "127.0.0.1" in default and "127.200.1.2" in default and "::1" in default
    assert "::ffff:127.0.0.1" in default  # an IPv4 peer seen by a dual-stack socket
    for outside in ("10.0.0.1", "128.0.0.1", "::2", "fe80::1%eth0", "", "localhost", "999.0.0.1"):
        assert outside not in default
    mixed = AllowList(parse_networks(["10.1.2.3/8", "192.0.2.7", "2001:db8::/32"]))
    assert mixed.describe() == "10.0.0.0/8, 192.0.2.7, 2001:db8::/32"
    assert "10.255.0.1" in mixed and "192.0.2.7" in mixed and "192.0.2.8" not in mixed and "2001:db8::5" in mixed
    for bad in (["10.0.0.0/33"], ["ten"], ["10.0.0.0/8", ""]):
        with pytest.raises(ValueError, match="--allow"):
            parse_networks(bad)


def test_command_line_flags(tmp_path):
    config = config_from_args(parse_args([]))
    assert config.allow == LOOPBACK and config.sip_user == "" and config.max_calls == 32
    config = config_from_args(
        parse_args(
            [
                "--allow",
                "10.0.0.0/8",
                "--allow",
                "::1",
                "--max-calls",
                "3",
                "--sip-user",
                USER,
                "--sip-password",
                "pw",
            ]
        )
    )
    assert AllowList(config.allow).describe() == "10.0.0.0/8, ::1" and config.max_calls == 3
    assert (config.sip_user, config.sip_password) == (USER, "pw") and "pw" not in repr(config)
    secret = tmp_path / "secret"
    secret.write_text(PASSWORD + "\nignored\n")
    config = config_from_args(parse_args(["--sip-user", USER, "--sip-password-file", str(secret)]))
    assert config.sip_password == PASSWORD
    for argv in (
        ["--sip-user", USER],
        ["--sip-password", "pw"],
        ["--sip-user", USER, "--sip-password", "pw", "--sip-password-file", str(secret)],
        ["--sip-user", USER, "--sip-password-file", str(tmp_path / "missing")],
        ["--allow", "10.0.0.0/99"],
    ):
        with pytest.raises(ValueError):
            config_from_args(parse_args(argv))
    with pytest.raises(ValueError):
        GatewayConfig(allow=())


# -- end to end: helpers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with LocalServer(engine=EngineConfig(max_sessions=8, max_batch=8)) as srv:
        yield srv


@contextlib.contextmanager
def gateway(tmp_path: Path, server, *flags: str) -> Iterator[Gateway]:
    """A gateway subprocess for one test (``server``: a LocalServer, or an address); it must stop cleanly."""
    gw = Gateway(tmp_path, getattr(server, "address", server), "--rtp-timeout-s", "10", *flags)
    try:
        yield gw
    finally:
        log = gw.stop()
        assert gw.process.returncode == 0, log[-3000:]
        assert "Traceback" not in log, log


def stopped_totals(log: str) -> dict[str, int]:
    """The counts of the gateway's "gateway stopped" line."""
    line = log.split("gateway stopped: ", 1)[1].split("\n", 1)[0]
    names = ["sip_refused", "audiosocket_refused", "auth_failures", "auth_challenges", "rtp_dropped"]
    return dict(zip(names, [int(n) for n in re.findall(r"\d+", line)], strict=True))


def packets_received(log: str, call_id: str) -> int:
    line = log.split(f"call {call_id} ended", 1)[1].split("\n", 1)[0]
    return int(re.search(r"(\d+) packets \(", line).group(1))


def dropped_foreign(log: str, call_id: str) -> tuple[int, str]:
    """How many RTP datagrams the call dropped, and where its media came from."""
    line = log.split(f"call {call_id} ended", 1)[1].split("\n", 1)[0]
    address = re.search(r"media from ([^\s,]+)", line).group(1)
    return int(re.search(r"(\d+) from elsewhere dropped", line).group(1)), address


def send_interleaved(streams: list[tuple[socket.socket, list[bytes]]], destination, pace_s: float = 0.01):
    """Packet i of every stream, in the order given, then packet i + 1, ...: one paced timeline."""
    start = time.monotonic()
    for i in range(max(len(packets) for _, packets in streams)):
        for sock, packets in streams:
            if i < len(packets) and packets[i]:
                sock.sendto(packets[i], destination)
        time.sleep(max(start + (i + 1) * pace_s - time.monotonic(), 0))


class AuthPhone(Phone):
    """A crafted UAC that puts ``authorization`` (when set) into its INVITEs."""

    authorization = ""

    def request(self, method: str, *, branch: str | None = None, body: bytes = b"") -> bytes:
        data = super().request(method, branch=branch, body=body)
        if method == "INVITE" and self.authorization:
            data = data.replace(
                b"Max-Forwards: 70\r\n", f"Max-Forwards: 70\r\nAuthorization: {self.authorization}\r\n".encode()
            )
        return data

    def retry(self, authorization: str) -> sip.SipMessage:
        """The INVITE again (a new transaction, the next CSeq), with these credentials."""
        self.authorization = authorization
        self.cseq += 1
        self.invite_branch = sip.new_branch()
        return self.invite()


@pytest.fixture(scope="module")
def call_audio() -> tuple[np.ndarray, tuple[int, int]]:
    spoken = speech(SENTENCE, rate_hz=RATE_HZ)
    audio = np.concatenate([silence(0.4, RATE_HZ), spoken, silence(0.7, RATE_HZ)])
    return audio, speech_span_ms(audio)


# -- end to end: --allow and --max-calls -----------------------------------------------------------


def test_sip_and_audiosocket_from_outside_allow_are_refused(tmp_path, server):
    audiosocket_port = free_port(socket.SOCK_STREAM)
    flags = ["--allow", "10.0.0.0/8", "--allow", "192.0.2.7", "--audiosocket-port", str(audiosocket_port)]
    with gateway(tmp_path, server, *flags) as gw:
        assert "answering SIP from 10.0.0.0/8, 192.0.2.7 only\n" in gw.log.read_text()
        p = Phone(gw.address)
        try:
            response = p.invite()  # and its ACK, dropped
            assert p.statuses == [403] and response.reason == "Forbidden" and response.to_tag
            p.send(p.request("OPTIONS"))
            assert p.receive().status == 403
            p.send(p.request("BYE"))
            assert p.receive().status == 403
            # Reset (or closed) before a byte: the reset may reach the connect itself, or the read after it.
            with (
                contextlib.suppress(ConnectionResetError),
                socket.create_connection(("127.0.0.1", audiosocket_port), timeout=5) as conn,
            ):
                assert conn.recv(3) == b""
            gw.wait_log("AudioSocket 127.0.0.1:")
        finally:
            p.close()
    log = gw.log.read_text()
    assert f"refused SIP INVITE from 127.0.0.1:{p.port}: not in --allow 10.0.0.0/8, 192.0.2.7" in log
    assert not re.search(r"call \S+ from sip:", log) and "AudioSocket call" not in log
    assert stopped_totals(log) == {
        "sip_refused": 4,  # INVITE, ACK, OPTIONS, BYE
        "audiosocket_refused": 1,
        "auth_failures": 0,
        "auth_challenges": 0,
        "rtp_dropped": 0,
    }


def test_an_allowed_network_is_answered(tmp_path, server):
    with gateway(tmp_path, server, "--allow", "10.0.0.0/8", "--allow", "127.0.0.1/32") as gw:
        p = Phone(gw.address)
        try:
            p.send(p.request("OPTIONS"))
            assert p.receive().status == 200
        finally:
            p.close()
    assert stopped_totals(gw.log.read_text())["sip_refused"] == 0


def test_max_calls_answers_486_and_frees_the_slot_at_the_hang_up(tmp_path, server):
    audiosocket_port = free_port(socket.SOCK_STREAM)
    with gateway(tmp_path, server, "--max-calls", "1", "--audiosocket-port", str(audiosocket_port)) as gw:
        log = gw.log.read_text()
        assert "answering SIP from 127.0.0.0/8, ::1 only (--allow CIDR to open)" in log
        assert "SIP digest authentication off" in log
        first, second, third = phones = [Phone(gw.address) for _ in range(3)]
        try:
            assert first.invite().status == 200
            assert second.invite().status == 486
            assert second.statuses == [100, 486]
            with socket.create_connection(("127.0.0.1", audiosocket_port), timeout=5) as conn:
                assert conn.recv(3) == b"\x00\x00\x00"  # AudioSocket shares the budget: hung up at once
            assert first.bye().status == 200
            gw.wait_log(f"call {first.call_id} ended (the caller hung up)")
            assert third.invite().status == 200
            assert third.bye().status == 200
            gw.wait_log(f"call {third.call_id} ended")
        finally:
            for p in phones:
                p.close()


# -- end to end: the RTP source --------------------------------------------------------------------


@needs_espeak
def test_rtp_injected_from_another_port_changes_nothing(tmp_path, server, call_audio):
    """Packets with the call's own SSRC and sequence numbers but other speech, sent from another port
    just before each real one: without the source check they would be the call's audio (the real
    packets then look like duplicates) and its transcript would be the other sentence."""
    audio, span_ms = call_audio
    other = np.concatenate([silence(0.4, RATE_HZ), speech(OTHER, rate_hz=RATE_HZ)])
    other = np.resize(other, len(audio)) * 1.5
    with gateway(tmp_path, server) as gw:
        reference, attacked = Phone(gw.address), Phone(gw.address)
        try:
            for p in (reference, attacked):
                assert p.invite().status == 200
            real = rtp_stream(g711(audio, reference.codec), pt=0 if reference.codec == "PCMU" else 8)
            send_interleaved([(reference.media, real)], reference.rtp)
            assert reference.bye().status == 200
            expected = [line["text"] for line in check_finals(gw.wait_ended(reference.call_id), span_ms)]

            forged = rtp_stream(g711(other, attacked.codec), pt=0 if attacked.codec == "PCMU" else 8)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as injector:
                injector.bind(("127.0.0.1", 0))
                assert injector.getsockname()[1] != attacked.media_port
                send_interleaved([(injector, forged), (attacked.media, real)], attacked.rtp)
            assert attacked.bye().status == 200
            finals = check_finals(gw.wait_ended(attacked.call_id), span_ms, attacked.call_id)
        finally:
            reference.close()
            attacked.close()
        log = gw.log.read_text()
        assert [line["text"] for line in finals] == expected
        assert packets_received(log, attacked.call_id) == len(real)
        stats = call_stats(log, attacked.call_id)
        assert stats["duplicate"] == 0 and stats["SSRC changes"] == 0 and stats["late"] == 0
        assert dropped_foreign(log, attacked.call_id) == (len(forged), f"127.0.0.1:{attacked.media_port}")
        assert dropped_foreign(log, reference.call_id)[0] == 0
        assert f"call {attacked.call_id}: dropped RTP datagram #1 from 127.0.0.1:" in log
    assert stopped_totals(gw.log.read_text())["rtp_dropped"] == len(forged)


@needs_espeak
def test_a_reinvite_moves_the_accepted_rtp_source(tmp_path, server, call_audio):
    """A re-INVITE whose offer names another port (a PBX handing the media to the phone) moves the
    check: the new port is the call's audio from then on, the old one is dropped."""
    audio, span_ms = call_audio
    with gateway(tmp_path, server) as gw:
        p = Phone(gw.address)
        moved = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        moved.bind(("127.0.0.1", 0))
        try:
            assert p.invite().status == 200
            packets = rtp_stream(g711(audio, p.codec), pt=0 if p.codec == "PCMU" else 8)
            half = len(packets) // 2
            send_interleaved([(p.media, packets[:half])], p.rtp)
            old_port, p.media_port = p.media_port, moved.getsockname()[1]
            p.cseq += 1
            p.send(p.request("INVITE", body=p.offer()))
            assert p.final()[1].status == 200
            p.send(p.request("ACK"))
            stale = [packets[half - 1]] * 5  # the old port goes on sending: dropped
            send_interleaved([(p.media, stale), (moved, packets[half:])], p.rtp)
            assert p.bye().status == 200
            check_finals(gw.wait_ended(p.call_id), span_ms, p.call_id)
        finally:
            p.close()
            moved.close()
        log = gw.log.read_text()
        assert f"media moves from 127.0.0.1:{old_port} to 127.0.0.1:{p.media_port}" in log
        assert packets_received(log, p.call_id) == len(packets)
        assert dropped_foreign(log, p.call_id) == (len(stale), f"127.0.0.1:{p.media_port}")


# -- end to end: digest authentication -------------------------------------------------------------


def test_digest_authentication_of_crafted_invites(tmp_path, server):
    with gateway(tmp_path, server, "--sip-user", USER, "--sip-password", PASSWORD) as gw:
        assert f"SIP digest authentication of INVITEs as user '{USER}', realm 'cosystream'" in gw.log.read_text()
        p = AuthPhone(gw.address)
        try:
            p.send(p.request("OPTIONS"))
            assert p.receive().status == 200  # OPTIONS is not challenged
            challenged = p.invite()
            assert p.statuses == [401] and challenged.reason == "Unauthorized"
            challenge = challenged.get("www-authenticate")
            assert (
                parse_credentials(challenge)["qop"] == "auth"
                and parse_credentials(challenge)["realm"] == "cosystream"
            )

            wrong = p.retry(authorization(challenge, password="guess"))
            assert wrong.status == 401 and "stale" not in parse_credentials(wrong.get("www-authenticate"))
            wrong_user = p.retry(authorization(wrong.get("www-authenticate"), user="mallory"))
            assert wrong_user.status == 401

            answer = authorization(wrong_user.get("www-authenticate"), uri=f"sip:asr@127.0.0.1:{gw.sip_port}")
            assert p.retry(answer).status == 200 and p.statuses == [100, 180, 200]
            p.send(p.request("ACK"))
            gw.wait_log(f"call {p.call_id} from")
            replay = AuthPhone(gw.address)  # the same credentials again, in a new call: a spent nonce
            try:
                stale = replay.retry(answer)
                assert stale.status == 401 and parse_credentials(stale.get("www-authenticate"))["stale"] == "TRUE"
            finally:
                replay.close()
            assert p.bye().status == 200
            gw.wait_log(f"call {p.call_id} ended")
        finally:
            p.close()
    totals = stopped_totals(gw.log.read_text())
    assert totals["auth_failures"] == 2 and totals["auth_challenges"] == 2
    assert "wrong SIP credentials from 127.0.0.1:" in gw.log.read_text()


def baresip_call(tmp_path: Path, gw: Gateway, wav: Path, name: str, password: str) -> subprocess.Popen:
    account = f"<sip:{name}@127.0.0.1>;auth_user={USER};auth_pass={password};regint=0;audio_codecs=PCMU"
    return start_baresip(tmp_path / name, wav, account, f"sip:asr@127.0.0.1:{gw.sip_port}")


@needs_espeak
@needs_baresip
def test_baresip_with_the_password_is_answered_and_with_a_wrong_one_refused(tmp_path, server, call_audio):
    audio, span_ms = call_audio
    wav = tmp_path / "in.wav"
    write_wav(wav, audio)
    runs: dict[str, subprocess.Popen] = {}
    with gateway(tmp_path, server, "--sip-user", USER, "--sip-password", PASSWORD) as gw:
        try:
            runs["good"] = baresip_call(tmp_path, gw, wav, "good", PASSWORD)
            runs["bad"] = baresip_call(tmp_path, gw, wav, "bad", "not-the-password")
            started = f" from sip:good@127.0.0.1 to sip:asr@127.0.0.1:{gw.sip_port}: PCMU on"
            call_id = gw.wait_log(started).split(started)[0].rsplit("call ", 1)[1]
            gw.wait_log(f"call {call_id} ended (the caller hung up)", timeout_s=20)
            check_finals(gw.lines(call_id), span_ms, call_id)
            gw.wait_log("wrong SIP credentials from 127.0.0.1:")
            time.sleep(1.0)  # room for a retry by the refused caller, which must not come through
        finally:
            outputs = {name: stop_baresip(run) for name, run in runs.items()}
    log = gw.log.read_text()
    assert "Call established" in outputs["good"], outputs["good"][-2000:]
    assert "Call established" not in outputs["bad"] and "401" in outputs["bad"], outputs["bad"][-2000:]
    assert " from sip:bad@127.0.0.1" not in log and log.count(" from sip:good@127.0.0.1 to ") == 1
    totals = stopped_totals(log)
    assert totals["auth_failures"] >= 1 and totals["auth_challenges"] >= 2


# -- end to end: SIP over TLS ----------------------------------------------------------------------


@needs_espeak
@needs_baresip
def test_baresip_calls_over_sip_tls(tmp_path, server, call_audio):
    """--sip-tls-cert/--sip-tls-key: a baresip that trusts the gateway's CA calls over TLS (the signalling
    encrypted; the RTP is the same), and a plaintext connection to the TLS port gets no call."""
    from tests.test_security import Pki

    audio, span_ms = call_audio
    wav = tmp_path / "in.wav"
    write_wav(wav, audio)
    pki = Pki(tmp_path)
    tls_port = free_port(socket.SOCK_STREAM)
    flags = ("--sip-tls-cert", pki.path("server.pem"), "--sip-tls-key", pki.path("server.key"))
    with gateway(tmp_path, server, *flags, "--sip-tls-port", str(tls_port)) as gw:
        gw.wait_log(f"tls 127.0.0.1:{tls_port}")
        with socket.create_connection(("127.0.0.1", tls_port), timeout=5) as plain:
            plain.sendall(b"OPTIONS sip:asr@127.0.0.1 SIP/2.0\r\nContent-Length: 0\r\n\r\n")
            assert plain.recv(100) == b""  # no handshake: closed, nothing answered
        account = "<sip:tls@127.0.0.1;transport=tls>;regint=0;audio_codecs=PCMU"
        dial = f"sip:asr@127.0.0.1:{tls_port};transport=tls"
        run = start_baresip(tmp_path / "baresip", wav, account, dial, f"sip_cafile {pki.path('ca.pem')}\n")
        try:
            line, call_id = call_line(gw, " from sip:tls@127.0.0.1 to sip:asr@127.0.0.1:")
            assert line.endswith("(SIP over TLS)"), line
            gw.wait_log(f"call {call_id} ended (the caller hung up)", timeout_s=20)
            check_finals(gw.lines(call_id), span_ms, call_id)
        finally:
            output = stop_baresip(run)
        assert "Call established" in output, output[-2000:]


# -- end to end: the gateway's own channel to cosystream, over TLS with a token ----------------------------


@needs_espeak
def test_the_gateway_reaches_a_tls_server_with_a_token_and_a_wrong_token_is_one_line(tmp_path, call_audio):
    from cosystream.server.tls import TlsConfig
    from tests.servers import local_server_with
    from tests.test_security import ALICE, Pki, tokens_text

    pki = Pki(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text(tokens_text(f"gateway {ALICE} priorities=REALTIME"))
    audio, span_ms = call_audio
    tls = TlsConfig(pki.path("server.pem"), pki.path("server.key"))
    with local_server_with(tls=tls, auth_tokens=str(tokens)) as server:
        address = f"localhost:{server.port}"  # the certificate's name
        with gateway(tmp_path, address, "--ca-cert", pki.path("ca.pem")) as gw:
            p = Phone(gw.address)  # no token: the gateway cannot open a session, the caller gets 503
            try:
                assert p.invite().status == 503
            finally:
                p.close()
        (tmp_path / "call").mkdir()
        flags = ("--ca-cert", pki.path("ca.pem"), "--token", ALICE)
        with gateway(tmp_path / "call", address, *flags) as gw:
            p = Phone(gw.address)
            try:
                assert p.invite().status == 200
                send_interleaved(
                    [(p.media, rtp_stream(g711(audio, p.codec), pt=0 if p.codec == "PCMU" else 8))], p.rtp
                )
                assert p.bye().status == 200
                finals = check_finals(gw.wait_ended(p.call_id), span_ms, p.call_id)
            finally:
                p.close()
        assert any(final["text"] for final in finals), finals
    # A token to another host without TLS is refused before anything starts, in one line.
    result = subprocess.run(
        [sys.executable, str(GATEWAY), "--server", "192.0.2.1:50051", "--token", ALICE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert "--tls" in result.stderr


def test_a_phrases_file_goes_into_every_calls_config(tmp_path):
    from clients.telephony.asr import streaming_config
    from cosystream.v1 import cosystream_pb2 as pb

    phrases = tmp_path / "phrases.txt"
    phrases.write_text("Acme Corporation\t12\nZorblax\n")
    config = config_from_args(parse_args(["--phrases", str(phrases)]))
    assert [(p.text, p.boost) for p in config.phrases] == [("Acme Corporation", 12.0), ("Zorblax", 0.0)]
    asr = streaming_config(pb.MULAW, False, config.phrases)
    assert [p.text for p in asr.phrases] == ["Acme Corporation", "Zorblax"]
    assert config_from_args(parse_args([])).phrases == ()
    config = config_from_args(parse_args(["--vocabulary", "customers"]))
    assert streaming_config(pb.MULAW, False, config.phrases, config.vocabulary).vocabulary == "customers"
