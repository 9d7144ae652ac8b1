"""Session resume: a resumable stream whose connection drops is held with its slot and state, and a client
that reconnects with its resume token and the audio from the last consumed offset gets the same transcript as
an uninterrupted stream, every response exactly once. Through a real server, a real TCP proxy on loopback
that resets its connections mid-utterance, and grpcio's own client."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from cosystream.frontend.host import StreamOptions
from cosystream.frontend.snapshot import Snapshot, SnapshotError
from cosystream.server.frontend import FrontendConfig
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.resume import DEFAULT_RESUME, ResumableStream, ResumePolicy
from tests.servers import CuttingProxy, Served
from tests.speech import encode, needs_espeak, silence, speech

WINDOW_S = 2.0
CHUNK = 3200  # 100 ms of 16 kHz LINEAR16


@pytest.fixture(scope="module")
def server():
    frontend = FrontendConfig(
        host="127.0.0.1",
        port=0,
        stream=StreamOptions(idle_timeout_s=10.0, resume_window_s=WINDOW_S, resume_key=b"k" * 32),
    )
    with LocalServer(frontend_config=frontend, engine=EngineConfig(max_sessions=4, max_batch=4)) as srv:
        yield srv


@pytest.fixture
def proxy(server):
    proxy = CuttingProxy(server.port)
    yield proxy
    proxy.close()


def stub_for(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, pb_grpc.CosyStreamStub(channel)


def config(**fields) -> pb.StreamingRecognizeRequest:
    return pb.StreamingRecognizeRequest(
        config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, interim_results=True, **fields)
    )


def server_info(server) -> pb.ServerInfo:
    channel, stub = stub_for(server.port)
    with channel:
        return stub.GetServerInfo(pb.GetServerInfoRequest())


def active(server) -> int:
    return server_info(server).active_sessions


def wait_active(server, expected: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while active(server) != expected:
        assert time.monotonic() < deadline, f"active sessions never reached {expected}"
        time.sleep(0.05)


class ResumingClient:
    """Streams ``audio`` in 100 ms chunks and, when its connection fails, resumes: the token from the
    responses, the audio from the last consumed offset, the responses after the last one received."""

    def __init__(self, port: int, audio: bytes, cut_at_samples: list[int], proxy: CuttingProxy | None):
        self.port, self.audio, self.proxy = port, audio, proxy
        self.cuts = sorted(cut_at_samples)
        self.responses: list[pb.StreamingRecognizeResponse] = []
        self.token = ""
        self.consumed = 0
        self.connections = 0

    def _requests(self, first: pb.StreamingRecognizeRequest, start: int):
        yield first
        for offset in range(start * 2, len(self.audio), CHUNK):
            yield pb.StreamingRecognizeRequest(audio=self.audio[offset : offset + CHUNK])
            time.sleep(0.01)

    def run(self) -> list[pb.StreamingRecognizeResponse]:
        first = config(resumable=True)
        while True:
            self.connections += 1
            assert self.connections < 10, "resumed too often"
            channel, stub = stub_for(self.port)
            try:
                cut = False
                for response in stub.StreamingRecognize(self._requests(first, self.consumed), timeout=60):
                    self.responses.append(response)
                    self.token = response.resume_token
                    self.consumed = response.consumed_samples
                    if not cut and self.cuts and self.consumed >= self.cuts[0] and self.proxy is not None:
                        cut = True
                        self.cuts.pop(0)
                        self.proxy.cut()  # mid-utterance: the connection resets under the call
                return self.responses
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                assert self.token, "the connection failed before any response"
                last = self.responses[-1].response_index if self.responses else 0
                first = config(
                    resume_token=self.token, resume_offset_samples=self.consumed, resume_after_response=last
                )
            finally:
                channel.close()


def finals(responses) -> list[str]:
    return [r.transcript for response in responses for r in response.results if r.is_final]


SENTENCES = ["the quick brown fox jumps over the lazy dog", "please call me back at the office tomorrow"]


def spoken(sentences: list[str]) -> bytes:
    """0.3 s of silence, then each sentence followed by 1 s of silence, as 16 kHz LINEAR16."""
    parts = [silence(0.3)]
    for sentence in sentences:
        parts += [speech(sentence), silence(1.0)]
    return encode(np.concatenate(parts), "LINEAR16")


@needs_espeak
def test_a_stream_cut_twice_mid_utterance_resumes_with_the_same_transcript_exactly_once(server, proxy):
    audio = spoken(SENTENCES)
    whole = ResumingClient(server.port, audio, [], None).run()
    assert finals(whole) and all(finals(whole)), finals(whole)

    cut_at = [16000 * 1, 16000 * 4]  # inside the first sentence, and inside the second
    client = ResumingClient(proxy.port, audio, cut_at, proxy)
    resumed = client.run()
    assert client.connections == 3, "both cuts were resumed"
    assert finals(resumed) == finals(whole)
    indexes = [response.response_index for response in resumed]
    assert indexes == list(range(1, len(indexes) + 1)), "every response once, in order"
    assert 0 < resumed[-1].consumed_samples <= len(audio) // 2
    assert len({response.resume_token for response in resumed}) == 1
    wait_active(server, 0)


def test_a_held_session_is_freed_after_its_window_and_its_token_is_then_unknown(server, proxy):
    wait_active(server, 0)
    release = threading.Event()
    token: list[str] = []

    def requests():
        yield config(resumable=True)
        while not release.is_set():
            yield pb.StreamingRecognizeRequest(audio=b"\0" * 320)
            time.sleep(0.01)

    channel, stub = stub_for(proxy.port)
    call = stub.StreamingRecognize(requests(), timeout=30)
    token.append(dict(call.initial_metadata())["cosystream-resume-token"])
    wait_active(server, 1)
    proxy.cut()
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    release.set()
    channel.close()
    time.sleep(WINDOW_S / 2)
    assert active(server) == 1, "held through its window"
    wait_active(server, 0, timeout_s=WINDOW_S + 5)
    channel, stub = stub_for(server.port)
    with channel, pytest.raises(grpc.RpcError) as caught:
        list(stub.StreamingRecognize(iter([config(resume_token=token[0])]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
    assert "resume" in caught.value.details()


def test_a_resume_takes_over_a_connection_that_still_holds_the_session_and_checks_its_offsets(server):
    """The client's network changed, the server has not noticed yet: the resume takes the session over; an
    offset past what the server has consumed is refused and leaves the session held."""
    wait_active(server, 0)
    release = threading.Event()

    def requests():
        yield config(resumable=True)
        for _ in range(20):
            yield pb.StreamingRecognizeRequest(audio=b"\0" * CHUNK)
        release.wait(30)

    channel, stub = stub_for(server.port)
    old = stub.StreamingRecognize(requests(), timeout=30)
    token = dict(old.initial_metadata())["cosystream-resume-token"]
    wait_active(server, 1)
    time.sleep(0.5)  # (the 2 s of silence read)
    other, new_stub = stub_for(server.port)
    with other:
        past = config(resume_token=token, resume_offset_samples=10**9)
        with pytest.raises(grpc.RpcError) as caught:
            list(new_stub.StreamingRecognize(iter([past]), timeout=10))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
        assert "consumed" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            list(old)
        assert caught.value.code() == grpc.StatusCode.CANCELLED  # (taken over, though that offset was refused)
        # From sample 0, sending nothing more: the server skips what it has, and the half-close ends it OK.
        again = config(resume_token=token, resume_offset_samples=0)
        resumed = list(new_stub.StreamingRecognize(iter([again]), timeout=10))
        assert all(response.resume_token == token for response in resumed)
    release.set()
    channel.close()
    wait_active(server, 0)


def test_compressed_audio_is_not_resumable(server):
    channel, stub = stub_for(server.port)
    with channel, pytest.raises(grpc.RpcError) as caught:
        request = pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(encoding=pb.OGG_OPUS, sample_rate_hz=16000, resumable=True)
        )
        list(stub.StreamingRecognize(iter([request]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# --- the client library: cosystream.v1.resume.ResumableStream ---------------------------------------------


async def paced(audio: bytes, chunk: int = CHUNK, pause_s: float = 0.01):
    """``audio`` in ``chunk``-byte pieces, ``pause_s`` apart (a source the client reads as it goes)."""
    for offset in range(0, len(audio), chunk):
        yield audio[offset : offset + chunk]
        await asyncio.sleep(pause_s)


async def recognize(port: int, audio, policy=DEFAULT_RESUME, cut_at: list[int] | None = None, proxy=None):
    """The responses of a :class:`ResumableStream` of ``audio`` (an async iterable) through ``port``, with the
    proxy cutting the connection once the server has consumed each of ``cut_at`` samples; and the stream."""
    cuts = sorted(cut_at or [])
    responses: list[pb.StreamingRecognizeResponse] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = ResumableStream(
            pb_grpc.CosyStreamStub(channel),
            pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, interim_results=True),
            policy=policy,
        )
        async for response in stream.recognize(audio):
            responses.append(response)
            if cuts and response.consumed_samples >= cuts[0]:
                cuts.pop(0)
                proxy.cut()  # the connection resets under the call; the stream resumes by itself
    return responses, stream


@needs_espeak
def test_the_client_library_resumes_by_itself_with_the_same_transcript_exactly_once(server, proxy):
    audio = spoken(SENTENCES)
    whole, _ = asyncio.run(recognize(server.port, paced(audio)))
    assert finals(whole) and all(finals(whole)), finals(whole)

    resumed, stream = asyncio.run(recognize(proxy.port, paced(audio), cut_at=[16000, 16000 * 4], proxy=proxy))
    assert (stream.connections, stream.resumes) == (3, 2)
    assert finals(resumed) == finals(whole)
    indexes = [response.response_index for response in resumed]
    assert indexes == list(range(1, len(indexes) + 1)), "every response once, in order"
    # (the trailing silence, under a second of it, gave no response to report it)
    assert len(audio) // 2 - 16000 <= stream.consumed_samples <= len(audio) // 2
    wait_active(server, 0)


def test_a_resumable_stream_reports_what_it_consumed_through_silence_so_the_client_keeps_little(server):
    """No speech, no results: the server still says every second how much it has, and the client lets the
    rest go (it keeps about a second of audio, not the whole silence)."""
    audio = encode(silence(4.0), "LINEAR16")
    kept: list[int] = []

    async def source():
        async for chunk in paced(audio, chunk=320, pause_s=0.01):  # 10 ms chunks at real time
            kept.append(stream_box[0].buffered_bytes)
            yield chunk

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stream = ResumableStream(
                pb_grpc.CosyStreamStub(channel), pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000)
            )
            stream_box.append(stream)
            return [response async for response in stream.recognize(source())]

    stream_box: list[ResumableStream] = []
    responses = asyncio.run(run())
    consumed = [response.consumed_samples for response in responses if not response.results]
    assert len(consumed) >= 3, consumed
    gaps = np.diff([0, *consumed])
    assert gaps.max() <= 16000 + 3200, f"a response at least every second of audio: {gaps}"
    assert max(kept) <= 2 * 32000, f"the client kept up to {max(kept)} bytes (2 s of audio is 64000)"
    wait_active(server, 0)


def test_the_client_library_gives_up_when_the_session_is_gone(server, proxy):
    """A reconnection after the resume window: NOT_FOUND, raised; a server that stays unreachable: UNAVAILABLE
    after the policy's attempts, in about the time they take."""
    audio = encode(silence(3.0), "LINEAR16")
    late = ResumePolicy(attempts=2, first_delay_s=WINDOW_S + 1.5, max_delay_s=WINDOW_S + 1.5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(recognize(proxy.port, paced(audio), late, cut_at=[16000], proxy=proxy))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
    wait_active(server, 0, timeout_s=WINDOW_S + 5)

    quick = ResumePolicy(attempts=3, first_delay_s=0.05, max_delay_s=0.2)
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:

        def cut_for_good():
            proxy.close()  # (and nothing listens on its port any more)

        asyncio.run(recognize(proxy.port, paced(audio), quick, cut_at=[16000], proxy=_Once(cut_for_good)))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 15
    wait_active(server, 0, timeout_s=WINDOW_S + 5)


class _Once:
    """A stand-in proxy whose ``cut`` runs ``action``."""

    def __init__(self, action):
        self.cut = action


def test_the_client_library_refuses_a_compressed_encoding():
    with pytest.raises(ValueError, match="cannot be resumed"):
        ResumableStream(None, pb.StreamingConfig(encoding=pb.OGG_OPUS, sample_rate_hz=16000))


@needs_espeak
def test_a_resume_that_lands_on_another_frontend_is_passed_to_the_one_holding_the_session():
    """``serve --frontends 3``: each reconnection reaches any frontend (SO_REUSEPORT); cut eight times, the
    stream resumes every time, some through a frontend that does not hold the session, and the transcript is
    the one of an uncut stream."""
    # ~15 s, cut every 1.5 s from 0.25 s to 10.75 s: a cut further apart than the server's reports of what it
    # consumed (at least every second), so that no report passes two at once, the last well before the end
    # (cut 0.75 s apart in 7.7 s, a cut now and then came with the stream's last report: 7 resumes of 8)
    audio = spoken(SENTENCES * 2)
    with Served("--frontends", "3", "--max-sessions", "8") as served:
        served.wait(lambda: served.health() == 1, 60, "every frontend listening")
        whole, _ = asyncio.run(recognize(served.port, paced(audio)))
        proxy = CuttingProxy(served.port)
        try:
            cut_at = [4000 + 24000 * i for i in range(8)]
            resumed, stream = asyncio.run(recognize(proxy.port, paced(audio), cut_at=cut_at, proxy=proxy))
        finally:
            proxy.close()
        assert stream.resumes == 8
        assert finals(resumed) == finals(whole) and finals(whole)
        indexes = [response.response_index for response in resumed]
        assert indexes == list(range(1, len(indexes) + 1)), "every response once, in order"
        assert stream.token.split(".")[0] in {"0", "1", "2"}, "the token names its frontend"
        # (each resume lands on the holder with 1/3 odds: all eight doing so, 1 in 6561)
        assert served.metric("cosystream_resumes_forwarded_total") >= 1
        served.wait(lambda: served.info().active_sessions == 0, 10, "the session freed")


# --- across servers: snapshots (serve --resume-key-file) ----------------------------------------------------

KEY = b"k" * 32


def test_a_snapshot_is_sealed_and_checked():
    snapshot = Snapshot(b"cfg", "default", "1", 16000, 100, 2, 7, "alice", expires_s=time.time() + 30)
    blob = snapshot.seal(KEY)
    assert Snapshot.open(blob, KEY) == snapshot
    with pytest.raises(SnapshotError) as caught:
        Snapshot.open(blob.replace(b'"frame":100', b'"frame":900'), KEY)
    assert caught.value.tampered
    with pytest.raises(SnapshotError) as caught:
        Snapshot.open(blob, b"x" * 32)  # another key
    assert caught.value.tampered
    with pytest.raises(SnapshotError, match="expired") as caught:
        Snapshot.open(blob, KEY, now_s=time.time() + 60)
    assert not caught.value.tampered


def refused(port: int, request: pb.StreamingRecognizeRequest) -> grpc.RpcError:
    channel, stub = stub_for(port)
    with channel, pytest.raises(grpc.RpcError) as caught:
        list(stub.StreamingRecognize(iter([request]), timeout=10))
    return caught.value


def test_a_snapshot_that_cannot_be_used_is_refused_with_the_reason(server):
    wire = pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, resumable=True).SerializeToString()
    model = next(m for m in server_info(server).models if m.is_default)
    good = Snapshot(wire, model.name, model.version, 16000, 100, 0, 3, None, expires_s=time.time() + 30)

    def resume(snapshot_blob: bytes, offset: int = 16000):
        return config(resume_snapshot=snapshot_blob, resume_offset_samples=offset)

    err = refused(server.port, resume(good.seal(KEY)[:-4] + b"AAAA"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "changed" in err.details()
    other = dataclasses.replace(good, model_version=model.version + "-other")
    err = refused(server.port, resume(other.seal(KEY)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "version" in err.details()
    err = refused(server.port, resume(dataclasses.replace(good, token="alice").seal(KEY)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "token" in err.details()
    err = refused(server.port, resume(good.seal(KEY), offset=16001))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "16000" in err.details()
    # A good one goes on: its responses numbered from the snapshot's, its times from its frame (1 s).
    channel, stub = stub_for(server.port)
    with channel:
        audio = encode(np.concatenate([silence(0.3), speech(SENTENCES[0]), silence(0.8)]), "LINEAR16")
        requests = [
            resume(good.seal(KEY)),
            *(pb.StreamingRecognizeRequest(audio=audio[i : i + CHUNK]) for i in range(0, len(audio), CHUNK)),
        ]
        responses = list(stub.StreamingRecognize(iter(requests), timeout=30))
    assert responses[0].response_index == 4
    final = next(r for response in responses for r in response.results if r.is_final)
    assert final.transcript and final.utterance_index == 0 and final.start_ms >= 1000
    wait_active(server, 0)


@needs_espeak
def test_a_drain_hands_a_resumable_session_over_to_another_server_at_an_utterance_boundary(tmp_path):
    """Two servers sharing a key, a proxy in front (a load balancer): server A drains mid-stream, hands the
    session over as a snapshot at its next utterance boundary, and the client goes on on server B. The
    finals are those of an uncut stream, each once, the response indexes unbroken."""
    key = tmp_path / "resume.key"
    key.write_bytes(KEY)
    audio = spoken([*SENTENCES, SENTENCES[0]])
    flags = ("--frontends", "1", "--resume-key-file", str(key), "--drain-grace-s", "20")
    with Served(*flags) as a, Served(*flags) as b:
        whole, _ = asyncio.run(recognize(b.port, paced(audio)))
        proxy = CuttingProxy(a.port)

        class Balancer:
            def cut(self):  # (once the server has consumed 1.5 s: inside the first sentence)
                proxy.target_port = b.port  # new connections to B from now on, as a balancer would
                a.process.send_signal(signal.SIGTERM)

        try:
            handed, stream = asyncio.run(
                recognize(proxy.port, paced(audio, pause_s=0.05), cut_at=[24000], proxy=Balancer())
            )
        finally:
            proxy.close()
        assert a.process.wait(timeout=30) == 0
        assert stream.resumes == 1 and stream.snapshot == b""
        assert finals(handed) == finals(whole) and len(finals(whole)) == 3
        indexes = [response.response_index for response in handed]
        assert indexes == list(range(1, len(indexes) + 1)), "every response once, in order"
        snapshots = [response for response in handed if response.resume_snapshot]
        assert len(snapshots) == 1 and not snapshots[0].results
        assert [r.utterance_index for response in handed for r in response.results if r.is_final] == [0, 1, 2]
        assert any("handed over at frame" in line for line in a.log)
        b.wait(lambda: b.info().active_sessions == 0, 10, "the session freed")


@needs_espeak
def test_control_snapshot_hands_the_session_over_at_the_next_boundary_and_ends_ok(server):
    """Asked mid-sentence, the snapshot comes once the sentence's final is out; the stream then ends OK and
    a stream that resumes from the snapshot (here, on the same server) goes on with the next sentence."""
    first = np.concatenate([silence(0.3), speech(SENTENCES[0]), silence(1.0)])
    rest = np.concatenate([speech(SENTENCES[1]), silence(1.0)])
    audio = encode(np.concatenate([first, rest]), "LINEAR16")
    ask_at = CHUNK * 10  # 1 s in: inside the first sentence

    def requests():
        yield config(resumable=True)
        for offset in range(0, len(audio), CHUNK):
            yield pb.StreamingRecognizeRequest(audio=audio[offset : offset + CHUNK])
            if offset == ask_at:
                yield pb.StreamingRecognizeRequest(control=pb.Control(type=pb.Control.SNAPSHOT))
            time.sleep(0.02)

    channel, stub = stub_for(server.port)
    with channel:
        before = list(stub.StreamingRecognize(requests(), timeout=30))  # (ends OK)
    alone, _ = asyncio.run(recognize(server.port, paced(encode(first, "LINEAR16"))))
    assert finals(before) == finals(alone) and len(finals(alone)) == 1
    handed = before[-1]
    assert handed.resume_snapshot and not handed.results
    offset = handed.consumed_samples
    assert len(first) - 16000 < offset <= len(first), "after the first sentence's final, a pre-roll back"
    again = config(resume_snapshot=handed.resume_snapshot, resume_offset_samples=offset)
    channel, stub = stub_for(server.port)
    with channel:
        tail = [
            pb.StreamingRecognizeRequest(audio=audio[i : i + CHUNK]) for i in range(offset * 2, len(audio), CHUNK)
        ]
        after = list(stub.StreamingRecognize(iter([again, *tail]), timeout=30))
    assert after[0].response_index == handed.response_index + 1
    results = [r for response in after for r in response.results if r.is_final]
    assert [r.utterance_index for r in results] == [1] and results[0].transcript
    assert results[0].start_ms >= len(first) * 1000 // 16000 - 200
    wait_active(server, 0)
