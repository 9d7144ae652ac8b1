"""Security, for real: TLS and mTLS on the gRPC port, bearer tokens (plain and hashed, quotas, priorities),
reloads without dropping sessions, certificate rotation, and the unmodified Google and Riva clients over TLS.

A throwaway CA and certificates are made per module with ``cryptography``; servers run in-process
(``tests.servers.local_server_with``) or as ``cosystream serve`` where signals and frontend processes matter.
docs/SECURITY.md is the promise these pin.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import ipaddress
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cosystream.frontend.quota import QuotaExceeded, TokenSessions
from cosystream.server.auth import TokenFileError, TokenStore, load_tokens, parse_tokens
from cosystream.server.tls import TlsConfig, TlsError, load
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import Connection, StreamStatus, describe_error
from tests.servers import HeldStream, Served, local_server_with, serve_argv
from tests.speech import encode, needs_espeak, silence, speech

x509 = pytest.importorskip("cryptography.x509", reason="needs cryptography (the dev extra)")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "the quick brown fox jumps over the lazy dog"
SERVING = health_pb2.HealthCheckResponse.SERVING

ALICE = "alice-0123456789abcdef0123"
CAROL = "carol-fedcba9876543210fedc"  # in the file only as its sha256
BATCHY = "batchy-00112233445566778899"  # priorities=BATCH
QUOTA = "quota-aabbccddeeff00112233"  # max_sessions=2
DAVE = "dave-99887766554433221100"  # added by a reload
ERIN = "erin-13579bdf02468ace1357"  # added by a file change alone
SECRETS = (ALICE, CAROL, BATCHY, QUOTA, DAVE, ERIN)


def tokens_text(*lines: str) -> str:
    return "\n".join(lines) + "\n"


BASE_TOKENS = (
    "# name token [options]",
    f"alice {ALICE}",
    f"carol sha256:{hashlib.sha256(CAROL.encode()).hexdigest()}  # hashed: no secret in the file",
    f"batchy {BATCHY} priorities=BATCH",
    f"quota {QUOTA} max_sessions=2 priorities=REALTIME,BATCH",
)


# --- a throwaway PKI ------------------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


class Ca:
    def __init__(self, name: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(name, _name(name), self.key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        self.cert = builder.sign(self.key, hashes.SHA256())
        self.pem = _pem(self.cert)

    def issue(self, cn: str, server: bool) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for a server (localhost, 127.0.0.1) or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(cn, self.cert.subject, key.public_key())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return _pem(builder.sign(self.key, hashes.SHA256())), _pem_key(key)


class Pki:
    """Files in ``root``: ``ca.pem`` (trusted by the clients), ``server.pem``/``server.key`` from it,
    ``clients-ca.pem`` and ``client.pem``/``client.key`` (mTLS), ``other-ca.pem`` and ``stranger.pem``/
    ``stranger.key`` (nobody trusts them), ``ca2.pem`` and ``server2.pem``/``server2.key`` (a renewal)."""

    def __init__(self, root: Path):
        self.root = root
        ca, clients, other, ca2 = Ca("test ca"), Ca("test clients ca"), Ca("other ca"), Ca("test ca 2")
        files = {
            "ca.pem": ca.pem,
            "clients-ca.pem": clients.pem,
            "other-ca.pem": other.pem,
            "ca2.pem": ca2.pem,
        }
        for stem, (issuer, server) in {
            "server": (ca, True),
            "server2": (ca2, True),
            "client": (clients, False),
            "stranger": (other, False),
        }.items():
            files[f"{stem}.pem"], files[f"{stem}.key"] = issuer.issue(stem, server)
        for name, data in files.items():
            (root / name).write_bytes(data)

    def path(self, name: str) -> str:
        return str(self.root / name)

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text(tokens_text(*BASE_TOKENS))
    return path


def fresh(options=()) -> list:
    """Channel options for a connection of its own (not shared with other channels to the same target)."""
    return [("grpc.use_local_subchannel_pool", 1), *options]


def channel(port: int, pki: Pki | None = None, token: str | None = None, ca: str = "ca.pem", **kwargs):
    """A channel to ``localhost:port``: TLS trusting ``ca`` when ``pki`` is given, else plaintext."""
    ca_cert = pki.read(ca) if pki is not None else None
    return Connection(ca_cert=ca_cert, token=token, **kwargs).channel(f"localhost:{port}", options=fresh())


def info(ch, timeout_s: float = 10.0, metadata=None) -> pb.ServerInfo:
    return pb_grpc.CosyStreamStub(ch).GetServerInfo(
        pb.GetServerInfoRequest(), timeout=timeout_s, metadata=metadata
    )


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def speech_requests(priority=pb.REALTIME, seconds_of_silence: float = 1.0, pace_s: float = 0.0):
    audio = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(seconds_of_silence)]), "LINEAR16")
    yield pb.StreamingRecognizeRequest(
        config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=priority)
    )
    for offset in range(0, len(audio), 3200):
        if pace_s:
            time.sleep(pace_s)
        yield pb.StreamingRecognizeRequest(audio=audio[offset : offset + 3200])


def finals_of(responses) -> list[str]:
    return [r.transcript for response in responses for r in response.results if r.is_final]


def heard(transcript: str) -> bool:
    """The transcript is of SENTENCE (most of its words; the default model hears it nearly word for word)."""
    return len(set(transcript.split()) & set(SENTENCE.split())) >= 5


def write_wav(path: Path, audio: np.ndarray) -> Path:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(encode(audio, "LINEAR16"))
    return path


def replace(path: Path, data: bytes | str) -> None:
    """Write ``path`` atomically, as cert-manager and careful operators do (a new inode, renamed over)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


# --- the tokens file ------------------------------------------------------------------------------------


def test_token_file_lines_give_names_digests_and_limits():
    tokens = {t.name: t for t in parse_tokens(tokens_text(*BASE_TOKENS, f"ops {'o' * 20} admin"))}
    assert set(tokens) == {"alice", "carol", "batchy", "quota", "ops"}
    assert tokens["alice"].digest == hashlib.sha256(ALICE.encode()).digest()
    assert tokens["carol"].digest == hashlib.sha256(CAROL.encode()).digest(), "a sha256: entry is the digest"
    assert tokens["alice"].max_sessions is None and tokens["alice"].priorities is None
    assert tokens["batchy"].priorities == {"BATCH"} and not tokens["batchy"].allows("REALTIME")
    assert tokens["quota"].max_sessions == 2 and tokens["quota"].allows("REALTIME")
    assert tokens["ops"].admin and not tokens["alice"].admin
    assert all(secret not in repr(tokens) for secret in SECRETS), "a token's repr never shows a secret"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("bob", "expected 'NAME TOKEN"),
        ("bob short", "at least 16 characters"),
        ("bob sha256:abcd", "64 hex digits"),
        (f"bob {DAVE} max_sessions=0", "max_sessions=0"),
        (f"bob {DAVE} max_sessions=lots", "max_sessions=lots"),
        (f"bob {DAVE} priorities=URGENT", "priorities=URGENT"),
        (f"bob {DAVE} max_session=3", "unknown option 'max_session=3'"),
        (f"bob {DAVE} admin admin", "admin given twice"),
        (f"b/ob {DAVE}", "name 'b/ob'"),
        (f"carol {ALICE}", "the same token as an earlier line"),
        (f"alice {CAROL}", "the name 'alice' is used twice"),
    ],
)
def test_a_bad_token_file_line_is_one_error_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "tokens"
    path.write_text(tokens_text(f"alice {ALICE}  # fine", line))
    with pytest.raises(TokenFileError) as caught:
        load_tokens(str(path))
    text = str(caught.value)
    assert message in text and text.startswith(f"{path}:2: ") and "\n" not in text, text
    assert all(secret not in text for secret in SECRETS), "an error never quotes a secret"


def test_the_documented_token_file_parses():
    doc = (ROOT / "docs" / "SECURITY.md").read_text()
    example = re.search(r"`--auth-tokens FILE`.*?```\w*\n(.*?)```", doc, re.S).group(1)
    tokens = {t.name: t for t in parse_tokens(example, "docs/SECURITY.md")}
    assert tokens["backfill"].priorities == {"BATCH"} and tokens["backfill"].max_sessions == 8
    assert tokens["ops"].admin and tokens["captions"].max_sessions == 50


def test_an_empty_or_missing_token_file_is_an_error(tmp_path):
    (tmp_path / "empty").write_text("# nothing yet\n\n")
    with pytest.raises(TokenFileError, match="no tokens"):
        load_tokens(str(tmp_path / "empty"))
    with pytest.raises(TokenFileError, match="No such file"):
        load_tokens(str(tmp_path / "missing"))


def test_plain_and_hashed_entries_authenticate_alike(tokens_file):
    store = TokenStore(str(tokens_file))
    assert store.authenticate([("authorization", f"Bearer {ALICE}")]).name == "alice"
    assert store.authenticate([("authorization", f"bearer {CAROL}")]).name == "carol"
    assert store.authenticate([("x-goog-api-key", CAROL)]).name == "carol"
    for metadata, message in [
        ([], "requires a token: send the metadata header 'authorization: Bearer TOKEN'"),
        ([("authorization", "Bearer not-a-token-we-know")], "not known here"),
        ([("authorization", f"Basic {ALICE}")], "not a bearer token"),
        ([("authorization", f"Bearer {ALICE}x")], "not known here"),
    ]:
        with pytest.raises(Exception, match=re.escape(message)) as caught:
            store.authenticate(metadata)
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_bad_file_on_reload_keeps_the_tokens_in_use(tokens_file, tmp_path):
    path = tmp_path / "tokens"
    path.write_text(tokens_file.read_text())
    store = TokenStore(str(path))
    replace(path, "alice short\n")
    assert not store.reload_if_changed(), "a bad file is not used"
    assert store.authenticate([("authorization", f"Bearer {ALICE}")]).name == "alice"
    assert not store.reload_if_changed(), "tried once per change"
    replace(path, tokens_text(f"dave {DAVE}"))
    assert store.reload_if_changed()
    assert store.authenticate([("authorization", f"Bearer {DAVE}")]).name == "dave"
    with pytest.raises(Exception, match="not known here"):
        store.authenticate([("authorization", f"Bearer {ALICE}")])


def _hold_one_session(sessions: TokenSessions, held: mp.Event, release: mp.Event) -> None:
    claim = sessions.claim("quota", 2)
    held.set()
    release.wait(30)
    claim.release()


def test_session_quota_is_counted_across_frontend_processes():
    """The frontends are processes: a quota counted per process would be a quota per frontend."""
    sessions = TokenSessions(frontends=2)
    context = mp.get_context("spawn")
    held, release = context.Event(), context.Event()
    child = context.Process(target=_hold_one_session, args=(sessions.for_frontend(1), held, release))
    child.start()
    try:
        assert held.wait(60), "the other frontend took its session"
        mine = sessions.for_frontend(0)
        first = mine.claim("quota", 2)
        with pytest.raises(QuotaExceeded, match="max_sessions=2"):
            mine.claim("quota", 2)
        assert mine.open_sessions("quota") == 2
        other = mine.claim("other", 2)  # another token's quota is its own
        release.set()
        child.join(30)
        assert mine.open_sessions("quota") == 1, "the other frontend gave its session back"
        second = mine.claim("quota", 2)
        for claim in (first, second, other, first):  # (release is idempotent)
            claim.release()
        assert mine.open_sessions("quota") == 0
        mine.claim("quota", 2)
        sessions.reset_row(0)  # frontend 0 died: its sessions are gone
        assert mine.open_sessions("quota") == 0
    finally:
        release.set()
        child.join(30)


# --- TLS files -------------------------------------------------------------------------------------------


def test_tls_files_that_cannot_be_used_are_one_line_errors(pki, tmp_path):
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    encrypted = serialization.load_pem_private_key(pki.read("server.key"), None).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    (tmp_path / "encrypted.key").write_bytes(encrypted)
    cases = [
        (TlsConfig(pki.path("server.pem"), pki.path("server2.key")), "is the key the certificate's?"),
        (TlsConfig(str(tmp_path / "junk.pem"), pki.path("server.key")), "no PEM certificate"),
        (TlsConfig(pki.path("server.pem"), str(tmp_path / "junk.pem")), "no PEM private key"),
        (TlsConfig(pki.path("server.pem"), str(tmp_path / "encrypted.key")), "the key is encrypted"),
        (TlsConfig(pki.path("server.pem"), pki.path("server.key"), str(tmp_path / "junk.pem")), "client CA"),
        (TlsConfig(str(tmp_path / "missing.pem"), pki.path("server.key")), "No such file"),
    ]
    for config, message in cases:
        with pytest.raises(TlsError) as caught:
            load(config)
        assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    load(TlsConfig(pki.path("server.pem"), pki.path("server.key"), pki.path("clients-ca.pem")))


def test_a_token_goes_in_clear_only_to_this_host():
    token = Connection(token=ALICE)
    for target in ("localhost:50051", "127.0.0.1:50051", "[::1]:50051", "unix:/tmp/s.sock", "dns:///localhost:1"):
        assert token.credentials(target) is not None, target
    with pytest.raises(ValueError, match="add --tls or --ca-cert"):
        token.credentials("asr.example.com:50051")
    assert Connection(tls=True, token=ALICE).credentials("asr.example.com:443") is not None
    assert Connection().credentials("asr.example.com:50051") is None, "no flag: plaintext, as before"
    assert ALICE not in repr(Connection(tls=True, token=ALICE))


# --- TLS + tokens, in process -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure(pki, tokens_file):
    """TLS (ca.pem's server certificate) and the base tokens."""
    tls = TlsConfig(pki.path("server.pem"), pki.path("server.key"))
    with local_server_with(max_sessions=8, tls=tls, auth_tokens=str(tokens_file)) as server:
        yield server


@needs_espeak
def test_a_stream_over_tls_with_a_token_is_transcribed(secure, pki):
    with channel(secure.port, pki, ALICE) as ch:
        assert info(ch).models[0].is_default
        responses = list(pb_grpc.CosyStreamStub(ch).StreamingRecognize(speech_requests(), timeout=60))
    finals = finals_of(responses)
    assert len(finals) == 1 and heard(finals[0]), finals


def test_calls_without_a_known_token_are_unauthenticated_and_say_which_header(secure, pki):
    for token in (None, "not-a-token-this-server-knows"):
        with channel(secure.port, pki, token) as ch:
            err = refusal(lambda ch=ch: info(ch))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "'authorization: Bearer TOKEN'" in err.details(), err.details()
            # The stream is refused before its config is read; the status is also its last response.
            status = StreamStatus()

            def stream(ch=ch, status=status):
                for response in pb_grpc.CosyStreamStub(ch).StreamingRecognize(speech_requests(), timeout=30):
                    status.seen(response)

            err = refusal(stream)
            assert status.code_and_details(err)[0] == grpc.StatusCode.UNAUTHENTICATED
            assert status.error is not None and status.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
            reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
            err = refusal(
                lambda reflection=reflection: list(
                    reflection.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                    )
                )
            )
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            # Health needs no token: Kubernetes probes send none.
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == SERVING
    with channel(secure.port, pki, CAROL) as ch:  # the sha256 entry
        reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(
            reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
        services = {s.name for s in answers[0].list_services_response.service}
        assert "cosystream.v1.CosyStream" in services and "grpc.health.v1.Health" in services
    with channel(secure.port, pki) as ch:  # x-goog-api-key, per call
        assert info(ch, metadata=[("x-goog-api-key", CAROL)]).version


def test_over_its_quota_a_token_gets_resource_exhausted_naming_the_quota(secure, pki):
    channels = [channel(secure.port, pki, QUOTA) for _ in range(3)]
    held = [HeldStream(pb_grpc.CosyStreamStub(c)) for c in channels[:2]]
    try:
        with channel(secure.port, pki, ALICE) as ch:
            wait_for(lambda: info(ch).active_sessions == 2, 20, "two sessions open")
        status = StreamStatus()

        def third():
            for response in pb_grpc.CosyStreamStub(channels[2]).StreamingRecognize(speech_requests(), timeout=30):
                status.seen(response)

        err = refusal(third)
        code, details = status.code_and_details(err)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions=2" in details and "quota" in details
        with channel(secure.port, pki, ALICE) as ch:  # another token is not held back
            responses = list(pb_grpc.CosyStreamStub(ch).StreamingRecognize(speech_requests(), timeout=60))
            assert not any(r.HasField("error") for r in responses)
    finally:
        held[0].close()
    assert held[0].error is None, held[0].error
    wait_for(lambda: stream_ends_ok(channels[2]), 20, "the session given back usable")
    held[1].close()
    for c in channels:
        c.close()


def stream_ends_ok(ch) -> bool:
    try:
        responses = list(pb_grpc.CosyStreamStub(ch).StreamingRecognize(speech_requests(), timeout=60))
    except grpc.RpcError:
        return False
    return not any(r.HasField("error") for r in responses)


def test_a_priority_the_token_may_not_use_is_permission_denied(secure, pki):
    with channel(secure.port, pki, BATCHY) as ch:
        stub = pb_grpc.CosyStreamStub(ch)
        status = StreamStatus()

        def realtime():
            for response in stub.StreamingRecognize(speech_requests(pb.REALTIME), timeout=30):
                status.seen(response)

        code, details = status.code_and_details(refusal(realtime))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "REALTIME" in details and "BATCH" in details
        responses = list(stub.StreamingRecognize(speech_requests(pb.BATCH), timeout=60))
        assert not any(r.HasField("error") for r in responses)


def test_refusals_and_cancels_leak_no_quota(secure, pki):
    """Every exit path of a stream gives its quota back: refusals before it is counted (no token, a
    forbidden priority), cancels at any point, and ends with an error."""
    with channel(secure.port, pki) as anonymous:
        for _ in range(5):
            refusal(
                lambda: list(pb_grpc.CosyStreamStub(anonymous).StreamingRecognize(speech_requests(), timeout=10))
            )
    with channel(secure.port, pki, QUOTA) as ch:
        stub = pb_grpc.CosyStreamStub(ch)
        for i in range(12):
            call = stub.StreamingRecognize(speech_requests(pace_s=0.01), timeout=30)
            if i % 3:
                with contextlib.suppress(grpc.RpcError):
                    next(call, None)  # cancelled after its first response
            time.sleep(0.002 * i)
            call.cancel()
        bad = pb.StreamingRecognizeRequest(config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000))
        for _ in range(3):  # ended by the server (a second config: INVALID_ARGUMENT)
            refusal(lambda: list(stub.StreamingRecognize(iter([bad, bad]), timeout=10)))
        with channel(secure.port, pki, ALICE) as other:
            wait_for(lambda: info(other).active_sessions == 0, 20, "every session closed")
        channels = [channel(secure.port, pki, QUOTA) for _ in range(2)]
        held = [HeldStream(pb_grpc.CosyStreamStub(c)) for c in channels]
        try:
            with channel(secure.port, pki, ALICE) as other:
                wait_for(lambda: info(other).active_sessions == 2, 20, "the whole quota usable after all that")
            assert all(h.error is None for h in held), [h.error for h in held]
        finally:
            for h, c in zip(held, channels, strict=True):
                h.close()
                c.close()


def test_a_plaintext_client_on_the_tls_port_fails_fast_and_says_so(secure):
    with grpc.insecure_channel(secure.address, options=fresh()) as ch:
        started = time.monotonic()
        err = refusal(lambda: info(ch))
        assert time.monotonic() - started < 3, "fails fast, not at the deadline"
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    line = describe_error(err.code(), err.details(), Connection())
    assert "if it uses TLS, add --tls or --ca-cert" in line and "\n" not in line, line


def test_an_untrusted_server_certificate_fails_with_a_clear_error(secure, pki):
    with channel(secure.port, pki, ALICE, ca="other-ca.pem") as ch:
        err = refusal(lambda: info(ch))
    line = describe_error(err.code(), err.details(), Connection(ca_cert=b"x"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "not trusted: give its CA with --ca-cert" in line, line


# --- the official Google and Riva clients, unmodified, over TLS -------------------------------------------


def google_client(server, pki: Pki, credentials=None, api_key: str | None = None):
    speech_v1 = pytest.importorskip("google.cloud.speech_v1", reason="needs google-cloud-speech (compat extra)")
    from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport

    transport = functools.partial(
        SpeechGrpcTransport, ssl_channel_credentials=grpc.ssl_channel_credentials(pki.read("ca.pem"))
    )
    options = {"api_endpoint": f"localhost:{server.port}"} | ({"api_key": api_key} if api_key else {})
    return speech_v1.SpeechClient(credentials=credentials, client_options=options, transport=transport)


def google_recognize(client) -> list:
    from google.cloud import speech_v1

    config = speech_v1.StreamingRecognitionConfig(
        config=speech_v1.RecognitionConfig(
            encoding=speech_v1.RecognitionConfig.AudioEncoding.LINEAR16,
            sample_rate_hertz=16000,
            language_code="en-US",
        )
    )
    audio = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    requests = (
        speech_v1.StreamingRecognizeRequest(audio_content=audio[i : i + 3200]) for i in range(0, len(audio), 3200)
    )
    return [r for response in client.streaming_recognize(config, requests, timeout=60) for r in response.results]


@needs_espeak
def test_google_client_over_tls_with_a_bearer_token_or_an_api_key_and_without(secure, pki):
    pytest.importorskip("google.cloud.speech_v1", reason="needs google-cloud-speech (compat extra)")
    from google.api_core import exceptions
    from google.auth.credentials import AnonymousCredentials
    from google.oauth2.credentials import Credentials

    for client in (
        google_client(secure, pki, credentials=Credentials(token=ALICE)),  # authorization: Bearer
        google_client(secure, pki, api_key=CAROL),  # x-goog-api-key
    ):
        results = google_recognize(client)
        assert any(r.is_final and r.alternatives[0].transcript for r in results), results
        client.transport.close()
    for credentials in (AnonymousCredentials(), Credentials(token="not-a-token-this-server-knows")):
        client = google_client(secure, pki, credentials=credentials)
        with pytest.raises(exceptions.Unauthenticated, match="authorization: Bearer TOKEN"):
            google_recognize(client)
        client.transport.close()


@needs_espeak
def test_riva_client_over_tls_with_a_token_and_without(secure, pki):
    riva_client = pytest.importorskip("riva.client", reason="needs nvidia-riva-client (compat extra)")
    config = riva_client.StreamingRecognitionConfig(
        config=riva_client.RecognitionConfig(
            encoding=riva_client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000, language_code="en-US"
        )
    )
    audio = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")

    def recognize(metadata_args):
        auth = riva_client.Auth(
            ssl_root_cert=pki.path("ca.pem"),
            use_ssl=True,
            uri=f"localhost:{secure.port}",
            metadata_args=metadata_args,
        )
        try:
            chunks = (audio[i : i + 3200] for i in range(0, len(audio), 3200))
            return list(riva_client.ASRService(auth).streaming_response_generator(chunks, config))
        finally:
            auth.channel.close()

    responses = recognize([["authorization", f"Bearer {ALICE}"]])
    assert any(r.results[0].is_final and r.results[0].alternatives[0].transcript for r in responses), responses
    for metadata_args in (None, [["authorization", "Bearer not-a-token-this-server-knows"]]):
        with pytest.raises(grpc.RpcError) as caught:
            recognize(metadata_args)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


# --- our clients' flags --------------------------------------------------------------------------------------


def run_client(*argv: str, env_token: str | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COSYSTREAM_TOKEN"}
    if env_token is not None:
        env["COSYSTREAM_TOKEN"] = env_token
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env)


def error_lines(stderr: str) -> list[str]:
    """stderr without gRPC core's own log lines (``I0101 ...``, ``E0101 ...``)."""
    return [line for line in stderr.splitlines() if line and not re.match(r"[IWE]\d{4} ", line)]


@needs_espeak
def test_transcribe_takes_tls_and_a_token_and_says_what_is_wrong_in_one_line(secure, pki, tmp_path):
    wav = write_wav(tmp_path / "speech.wav", np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]))
    command = [sys.executable, "-m", "cosystream", "transcribe", str(wav), "--server", f"localhost:{secure.port}"]
    ca = ["--ca-cert", pki.path("ca.pem")]
    run = run_client(*command, *ca, env_token=ALICE)
    assert run.returncode == 0 and heard(run.stdout), (run.stdout, run.stderr)
    run = run_client(*command, *ca, "--token", CAROL)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    for extra, expected in [
        (ca, "give --token or set $COSYSTREAM_TOKEN"),
        ([*ca, "--token", "not-a-token-this-server-knows"], "UNAUTHENTICATED"),
        (["--tls", "--token", ALICE], "not trusted: give its CA with --ca-cert"),  # the system roots
        (["--token", ALICE], "if it uses TLS, add --tls or --ca-cert"),
        (["--ca-cert", str(tmp_path / "missing.pem")], "--ca-cert"),
    ]:
        run = run_client(*command, *extra)
        lines = error_lines(run.stderr)
        assert run.returncode != 0 and len(lines) == 1 and expected in lines[0], (extra, run.stderr)
        assert lines[0].startswith("cosystream transcribe: ")
        assert ALICE not in run.stderr


@needs_espeak
def test_caption_and_latency_probe_take_tls_and_a_token(secure, pki, tmp_path):
    wav = write_wav(tmp_path / "speech.wav", np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]))
    server = ["--server", f"localhost:{secure.port}", "--ca-cert", pki.path("ca.pem")]
    caption = [sys.executable, str(ROOT / "clients" / "caption.py"), "--file", str(wav), *server]
    run = run_client(*caption, "--token", ALICE)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    run = run_client(*caption)
    lines = error_lines(run.stderr)
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert lines[0].startswith("caption: error: server at ") and "UNAUTHENTICATED" in lines[0], lines
    out = tmp_path / "probe.json"
    probe = [sys.executable, str(ROOT / "clients" / "latency_probe.py"), *server, "--wav", str(wav)]
    probe += ["--realtime", "1", "--duration", "2", "--ramp-s", "0", "--channels", "1", "--json", str(out)]
    run = run_client(*probe, env_token=ALICE)
    assert run.returncode == 0, run.stderr
    assert ALICE not in out.read_text(), "the results never record the token"
    run = run_client(*probe)
    assert run.returncode == 1 and "UNAUTHENTICATED" in run.stderr, run.stderr


# --- mTLS, plaintext with tokens, rotation --------------------------------------------------------------------


def test_mtls_needs_a_client_certificate_from_the_client_ca(pki):
    tls = TlsConfig(pki.path("server.pem"), pki.path("server.key"), pki.path("clients-ca.pem"))
    with local_server_with(max_sessions=2, tls=tls) as server:
        client = {"client_cert": pki.read("client.pem"), "client_key": pki.read("client.key")}
        with channel(server.port, pki, **client) as ch:
            assert info(ch).version
        stranger = {"client_cert": pki.read("stranger.pem"), "client_key": pki.read("stranger.key")}
        for kwargs in ({}, stranger):
            with channel(server.port, pki, **kwargs) as ch:
                started = time.monotonic()
                err = refusal(lambda ch=ch: info(ch))
                assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 3, err
                line = describe_error(err.code(), err.details(), Connection(tls=True))
                assert "give --client-cert and --client-key" in line, line


def test_tokens_over_plaintext_and_a_tls_client_on_a_plaintext_port(pki, tokens_file):
    with local_server_with(max_sessions=2, auth_tokens=str(tokens_file)) as server:
        with channel(server.port, token=ALICE) as ch:  # loopback: gRPC's local credentials carry it
            assert info(ch).version
        with channel(server.port) as ch:
            assert refusal(lambda: info(ch)).code() == grpc.StatusCode.UNAUTHENTICATED
        with channel(server.port, pki, ALICE) as ch:
            started = time.monotonic()
            err = refusal(lambda: info(ch))
            assert time.monotonic() - started < 3, "fails fast, not at the deadline"
        line = describe_error(err.code(), err.details(), Connection(tls=True))
        assert "the server does not speak TLS here: leave out --tls / --ca-cert" in line, line


def test_a_renewed_certificate_is_served_to_new_connections_without_a_restart(pki, tmp_path, caplog):
    live_cert, live_key = tmp_path / "tls.crt", tmp_path / "tls.key"
    live_cert.write_bytes(pki.read("server.pem"))
    live_key.write_bytes(pki.read("server.key"))
    with local_server_with(max_sessions=2, tls=TlsConfig(str(live_cert), str(live_key))) as server:
        before = channel(server.port, pki)  # one connection, made with the old certificate
        assert info(before).version

        def works(ca: str) -> bool:
            with channel(server.port, pki, ca=ca) as ch:
                try:
                    return bool(info(ch, timeout_s=5).version)
                except grpc.RpcError:
                    return False

        assert works("ca.pem") and not works("ca2.pem")
        replace(live_cert, pki.read("server2.pem"))  # half a renewal: the key is still the old one's
        assert works("ca.pem") and not works("ca2.pem"), "a certificate without its key is not switched to"
        assert any("cannot be used" in r.getMessage() for r in caplog.records), "and the reason is logged"
        replace(live_key, pki.read("server2.key"))
        assert works("ca2.pem") and not works("ca.pem"), "new connections get the renewed certificate"
        assert info(before).version, "a connection made before the renewal goes on"
        before.close()


# --- cosystream serve: start-up errors, SIGHUP, file changes, quota across frontends, metrics -----------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--auth-tokens", "{dir}/short"], "short:1: a token needs at least 16 characters"),
        (["--auth-tokens", "{dir}/missing"], "missing: No such file or directory"),
        (["--tls-cert", "{pki}/server.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "{pki}/server.pem", "--tls-key", "{pki}/server2.key"], "is the key the certificate's?"),
        (["--tls-client-ca", "{pki}/clients-ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
    ],
    ids=["short-token", "no-tokens-file", "cert-without-key", "key-of-another", "client-ca-alone"],
)
def test_serve_refuses_unusable_security_files_in_one_line(pki, tmp_path, args, message):
    (tmp_path / "short").write_text("alice short\n")
    args = [a.replace("{dir}", str(tmp_path)).replace("{pki}", str(pki.root)) for a in args]
    run = subprocess.run(
        serve_argv(*args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in run.stderr.splitlines() if " INFO " not in line]
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert lines[0].startswith("cosystream serve: ") and message in lines[0], lines


@pytest.fixture(scope="module")
def served(pki, tmp_path_factory):
    """``cosystream serve`` with TLS, tokens and two frontend processes."""
    path = tmp_path_factory.mktemp("served") / "tokens"
    path.write_text(tokens_text(*BASE_TOKENS))
    args = ["--frontends", "2", "--max-sessions", "8", "--auth-tokens", str(path)]
    args += ["--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key")]
    with Served(*args) as server:
        server.tokens = path
        with channel(server.port, pki) as ch:  # (health: no token)
            health = health_pb2_grpc.HealthStub(ch)

            def serving() -> bool:
                try:
                    return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == SERVING
                except grpc.RpcError:
                    return False

            server.wait(serving, 60, "SERVING")
        yield server


def codes_on_fresh_connections(served, pki, token: str, n: int = 6) -> set:
    codes = set()
    for _ in range(n):
        with channel(served.port, pki, token) as ch:
            try:
                info(ch)
                codes.add(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.add(err.code())
    return codes


def reloaded_in_both(served, since: int, why: str) -> bool:
    lines = [line for line in served.log[since:] if f"tokens reloaded ({why})" in line]
    return all(any(f"frontend-{index} " in line for line in lines) for index in (0, 1))


@needs_espeak
def test_sighup_and_file_changes_reload_tokens_without_dropping_a_session(served, pki):
    path: Path = served.tokens
    try:
        with channel(served.port, pki, ALICE) as live_channel:
            responses: list = []
            outcome: list = []

            def live() -> None:  # ~4 s of paced audio, across the reloads below
                try:
                    stub = pb_grpc.CosyStreamStub(live_channel)
                    responses.extend(stub.StreamingRecognize(speech_requests(pace_s=0.05, seconds_of_silence=1.5)))
                    outcome.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    outcome.append(err.code())

            thread = threading.Thread(target=live)
            thread.start()
            served.wait(lambda: any("token alice" in line for line in served.log), 20, "the live session open")

            # SIGHUP: alice revoked, dave added, in every frontend at once.
            mark = len(served.log)
            replace(path, tokens_text(*BASE_TOKENS[:1], *BASE_TOKENS[2:], f"dave {DAVE}"))
            os.kill(served.process.pid, signal.SIGHUP)
            served.wait(lambda: reloaded_in_both(served, mark, "SIGHUP"), 10, "both frontends reloaded")
            assert codes_on_fresh_connections(served, pki, ALICE) == {grpc.StatusCode.UNAUTHENTICATED}
            assert codes_on_fresh_connections(served, pki, DAVE) == {grpc.StatusCode.OK}

            # A bad file on SIGHUP keeps the tokens in use, and says why.
            mark = len(served.log)
            replace(path, "dave short\n")
            os.kill(served.process.pid, signal.SIGHUP)
            served.wait(
                lambda: sum("tokens not reloaded" in line for line in served.log[mark:]) >= 2, 10, "refused"
            )
            assert codes_on_fresh_connections(served, pki, DAVE) == {grpc.StatusCode.OK}

            thread.join(60)
            assert outcome == [grpc.StatusCode.OK], "the session open across the reloads ended OK"
            finals = finals_of(responses)
            assert len(finals) == 1 and heard(finals[0]), finals

        # A changed file alone (no signal) is picked up within a few seconds, by every frontend.
        mark = len(served.log)
        replace(path, tokens_text(*BASE_TOKENS, f"erin {ERIN}"))
        served.wait(lambda: reloaded_in_both(served, mark, "the file changed"), 15, "both frontends reloaded")
        assert codes_on_fresh_connections(served, pki, ERIN) == {grpc.StatusCode.OK}
        assert codes_on_fresh_connections(served, pki, ALICE) == {grpc.StatusCode.OK}, "alice is back"
        assert not [line for line in served.log if " ERROR " in line and "tokens not reloaded" not in line]
    finally:
        replace(path, tokens_text(*BASE_TOKENS))


def test_a_token_quota_holds_across_frontend_processes(served, pki):
    channels = [channel(served.port, pki, QUOTA) for _ in range(2)]
    held = [HeldStream(pb_grpc.CosyStreamStub(c)) for c in channels]
    try:
        with channel(served.port, pki, CAROL) as ch:
            served.wait(lambda: info(ch).active_sessions == 2, 20, "two sessions of the quota token")
        mark = len(served.log)
        refused = 0
        for _ in range(12):  # fresh connections, spread over both frontends by SO_REUSEPORT
            with channel(served.port, pki, QUOTA) as ch:
                status = StreamStatus()
                try:
                    for response in pb_grpc.CosyStreamStub(ch).StreamingRecognize(speech_requests(), timeout=30):
                        status.seen(response)
                except grpc.RpcError as err:
                    code, details = status.code_and_details(err)
                    refused += code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions=2" in details
        assert refused == 12
        time.sleep(0.3)  # (the log reader)
        closing = [line for line in served.log[mark:] if "closed: RESOURCE_EXHAUSTED" in line]
        assert all(any(f"frontend-{index} " in line for line in closing) for index in (0, 1)), (
            "both frontends refused some: the count is shared"
        )
        assert all(h.error is None for h in held), [h.error for h in held]
        metrics = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
        assert re.search(r'^cosystream_token_sessions\{token="quota"\} 2\.0$', metrics, re.M), metrics
    finally:
        for h, c in zip(held, channels, strict=True):
            h.close()
            c.close()
    metrics = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
    assert re.search(r'^cosystream_rejected_sessions_total\{reason="quota"\} (\d+)', metrics, re.M)
    refused_by_token = r'^cosystream_token_refused_sessions_total\{reason="quota",token="quota"\} 12\.0$'
    assert re.search(refused_by_token, metrics, re.M), metrics
    assert not any(secret in metrics for secret in SECRETS)

    def quota_sessions_gone() -> bool:
        text = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
        return re.search(r'^cosystream_token_sessions\{token="quota"\} 0\.0$', text, re.M) is not None

    served.wait(quota_sessions_gone, 20, "the quota token's sessions closed in the gauge")


def test_metrics_listen_on_the_grpc_host_by_default(served):
    """Served runs ``--host 127.0.0.1``: /metrics is on loopback too, not on every interface."""
    port = f"{served.metrics_port:04X}"
    listening = [
        line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:] if line.split()[3] == "0A"
    ]
    assert f"0100007F:{port}" in listening and f"00000000:{port}" not in listening, listening


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout_s} s")
