"""Faults, for real: ``cosystream serve`` in a subprocess, clients over gRPC on loopback, processes killed
with real signals. Each test pins a promise of docs/RELIABILITY.md."""

from __future__ import annotations

import asyncio
import datetime
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import HeldStream, Served, serve_argv
from tests.speech import encode, needs_espeak, silence, speech

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SENTENCES = ["the quick brown fox jumps over the lazy dog", "please call me back tomorrow morning"]
CHUNK = 320  # 10 ms of 16 kHz LINEAR16


def config(priority=pb.REALTIME, **kwargs) -> pb.StreamingRecognizeRequest:
    return pb.StreamingRecognizeRequest(
        config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=priority, **kwargs)
    )


def talk(seconds: float) -> bytes:
    """About ``seconds`` of espeak-ng sentences with pauses, LINEAR16."""
    parts, total = [], 0.0
    while total < seconds:
        for sentence in SENTENCES:
            part = np.concatenate([speech(sentence), silence(0.8)])
            parts.append(part)
            total += len(part) / 16000
    return encode(np.concatenate(parts)[: int(seconds * 16000)], "LINEAR16")


def paced(data: bytes, pace_s: float = 0.01, stop: threading.Event | None = None):
    """Audio requests in 10 ms chunks, one every ``pace_s``."""
    for offset in range(0, len(data), CHUNK):
        if stop is not None and stop.is_set():
            return
        time.sleep(pace_s)
        yield pb.StreamingRecognizeRequest(audio=data[offset : offset + CHUNK])


def session(data: bytes, pace_s: float = 0.01, first: pb.StreamingRecognizeRequest | None = None):
    """A whole stream's requests: its config, then the audio paced."""
    yield first or config()
    yield from paced(data, pace_s)


class Client(threading.Thread):
    """One stream in a thread: every response, and the status it ended with."""

    def __init__(self, stub, requests):
        super().__init__(daemon=True)
        self.stub, self.requests = stub, requests
        self.responses: list[pb.StreamingRecognizeResponse] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            for response in self.stub.StreamingRecognize(self.requests, timeout=120):
                self.responses.append(response)
                if response.speech_event.type == pb.SpeechEvent.SPEECH_STARTED:
                    self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            self.code, self.details = err.code(), err.details()

    @property
    def finals(self) -> list[pb.StreamingResult]:
        return [r for response in self.responses for r in response.results if r.is_final]

    def result(self, timeout_s: float = 60) -> grpc.StatusCode:
        self.join(timeout_s)
        assert not self.is_alive(), "the stream did not end"
        return self.code


def errors_in(log: list[str]) -> list[str]:
    return [line for line in log if " ERROR " in line or "Traceback" in line]


# --- slots -------------------------------------------------------------------------------------------


async def _cancel_storm(address: str, streams: int, parallel: int, seed: int) -> None:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(parallel)

    async def one(i: int, stub) -> None:
        async def requests():
            yield config()
            while True:
                yield pb.StreamingRecognizeRequest(audio=bytes(CHUNK))
                await asyncio.sleep(0.01)

        async with limit:
            call = stub.StreamingRecognize(requests())
            if i % 3 == 1:
                await call.initial_metadata()  # around the server's first response
            await asyncio.sleep(rng.uniform(0, 0.003))
            call.cancel()

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CosyStreamStub(channel)
        await asyncio.gather(*(one(i, stub) for i in range(streams)))


def test_a_cancel_storm_leaks_no_slot():
    """Streams cancelled 0-3 ms after their config or their first response: every slot usable after, no
    ERROR logged, and a drain with nothing open is immediate."""
    with Served("--max-sessions", "6", "--frontends", "1", "--drain-grace-s", "20") as served:
        for seed in range(3):
            asyncio.run(_cancel_storm(served.address, streams=48, parallel=6, seed=seed))
        served.wait(lambda: served.info().active_sessions == 0, 10, "every slot free after the storm")
        channels = [grpc.insecure_channel(served.address) for _ in range(6)]
        held = [HeldStream(pb_grpc.CosyStreamStub(c)) for c in channels]
        try:
            served.wait(lambda: served.info().active_sessions == 6, 10, "6 streams holding the 6 slots")
        finally:
            for stream, channel in zip(held, channels, strict=True):
                stream.close()
                channel.close()
        assert all(stream.error is None for stream in held), [s.error for s in held if s.error]
        served.wait(lambda: served.info().active_sessions == 0, 10, "the 6 slots free again")
        started = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(15) == 0
        assert time.monotonic() - started < 5, "the drain waited for streams that no longer exist"
        assert errors_in(served.log) == []


# --- start-up -----------------------------------------------------------------------------------------

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "cosystream" / "models" / "default"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent"], "--model /nonexistent: no such directory"),
        (["--model", "{broken}"], "the engine could not start: "),
        (["--device", "cuda:7"], "cuda:7"),
        # Found only when frontend 0's second-pass worker loads it: frontend 0 says why, serve exits.
        (["--final-model", "{broken_final}"], "frontend 0: second pass: "),
    ],
    ids=["no-model", "engine-fails", "no-such-device", "final-model-fails"],
)
def test_serve_that_cannot_start_says_why_in_one_line_and_exits(tmp_path, args, message):
    broken = tmp_path / "broken"  # every file a model needs, its weights unreadable: found only by the engine
    broken.mkdir()
    for name in ("config.json", "vocabulary.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, broken / name)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    broken_final = tmp_path / "broken-final"  # a CTranslate2 Whisper directory's files, none of them readable
    broken_final.mkdir()
    for name in ("model.bin", "config.json", "tokenizer.json"):
        (broken_final / name).write_bytes(b"not a model")
    args = [a.replace("{broken}", str(broken)).replace("{broken_final}", str(broken_final)) for a in args]
    started = time.monotonic()
    run = subprocess.run(
        serve_argv(*args),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert run.returncode == 1, run.stderr
    lines = [line for line in run.stderr.splitlines() if " INFO " not in line]
    assert len(lines) == 1 and lines[0].startswith("cosystream serve: ") and message in lines[0], run.stderr
    assert time.monotonic() - started < 30
    assert not list(tmp_path.glob("cosystream-*")), "its temporary folder was left behind"


def test_serving_only_once_every_frontend_listens():
    """Connections made while only the first frontend listens would all stay on it: health says SERVING only
    after the last frontend's port is open."""
    with Served("--frontends", "2") as served:
        served.wait(lambda: served.health(timeout_s=0.5) == SERVING, 60, "SERVING")
        first_serving = datetime.datetime.now()
        time.sleep(0.2)  # (the log reader thread)
        listening = [line for line in served.log if "frontend-1" in line and "serving on" in line]
        assert listening, "".join(served.log)
        stamp = datetime.datetime.strptime(listening[0][:23], "%Y-%m-%d %H:%M:%S,%f")
        assert stamp <= first_serving, f"SERVING at {first_serving}, frontend 1 listening at {stamp}"
        assert served.info().frontends == 2


# --- processes dying ------------------------------------------------------------------------------------


@needs_espeak
def test_engine_death_is_healed():
    """SIGKILL of the engine: its live sessions get UNAVAILABLE, health is NOT_SERVING at once, the engine
    is restarted, SERVING again, and new sessions work."""
    with Served("--frontends", "1") as served:
        served.wait(lambda: served.health() == SERVING, 60, "SERVING")
        live = Client(served.stub(), session(talk(10.0)))
        assert live.started.wait(30)
        engine = served.pids()["cs-engine"]
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        served.wait(lambda: served.health() == NOT_SERVING, 5, "NOT_SERVING after the engine died")
        assert time.monotonic() - killed < 2.0
        assert live.result() == grpc.StatusCode.UNAVAILABLE, live.details
        served.wait(lambda: served.health() == SERVING, 60, "SERVING again")
        assert served.pids()["cs-engine"] != engine
        again = Client(served.stub(), session(talk(3.0), 0.0))
        assert again.result() == grpc.StatusCode.OK, again.details
        assert again.finals
        assert served.process.poll() is None


def test_an_engine_that_keeps_dying_ends_serve_saying_why():
    with Served("--frontends", "1", "--max-failures", "2") as served:
        killed: set[int] = set()

        def new_engine() -> int | None:
            # Just after a SIGKILL the old engine may still be listed, and health still SERVING.
            pid = served.pids().get("cs-engine")
            return pid if pid not in killed else None

        for _ in range(2):
            engine = served.wait(new_engine, 60, "a new engine")
            served.wait(lambda: served.health() == SERVING, 60, "SERVING")
            os.kill(engine, signal.SIGKILL)
            killed.add(engine)
        assert served.process.wait(30) == 1
        time.sleep(0.2)
        assert any("the engine process died 2 times within 60 s" in line for line in served.log), served.log


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # (a zombie has exited; who reaps it is not the server's)


def test_sigkill_of_serve_leaves_no_process_behind():
    """``serve`` SIGKILLed (the OOM killer, a lost node) with a stream open: its engine and frontends exit
    too, within seconds; none is left orphaned holding memory or a device."""
    with Served("--frontends", "2") as served:
        served.wait(lambda: served.health() == SERVING, 60, "SERVING")
        live = Client(served.stub(), session(talk(10.0)))
        assert live.started.wait(30)
        children = {name: pid for name, pid in served.pids().items() if pid != served.process.pid}
        assert {"cs-engine", "cs-frontend-1"} <= set(children), children
        os.kill(served.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_running(pid) for pid in children.values()):
            time.sleep(0.1)
        left = {name: pid for name, pid in children.items() if _running(pid)}
        for pid in left.values():
            os.kill(pid, signal.SIGKILL)
        assert not left, f"still running 20 s after serve was killed: {left}"


def test_a_burst_of_sigterms_stops_the_engine(tmp_path):
    """An engine whose parent dies gets one SIGTERM per thread of the parent that it is handed to (Linux's
    parent-death signal): it stops once, however many arrive, and never deadlocks in its own handler."""
    from cosystream.engine.config import EngineConfig, EngineProcessConfig
    from cosystream.engine.launch import start_engine

    config = EngineProcessConfig(
        address=str(tmp_path / "engine.sock"), authkey=b"k" * 16, engine=EngineConfig(max_sessions=1), device="cpu"
    )
    handle = start_engine(config)
    try:
        assert handle.wait_ready(120)
        for _ in range(2000):
            try:
                os.kill(handle.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
        handle.process.join(15)
        assert handle.process.exitcode == 0, "the engine did not stop after a burst of SIGTERMs"
    finally:
        if handle.process.is_alive():
            handle.process.kill()
            handle.process.join(5)


def test_every_frontend_is_a_process_of_its_own_without_torch():
    """Frontend 0 too: the supervisor only watches. Neither a frontend nor the supervisor maps torch's library
    (the supervisor not even after it respawned one), and frontend 0, killed, is respawned on the same port
    like any other."""
    with Served("--frontends", "2") as served:
        served.wait(lambda: served.health() == SERVING, 60, "SERVING")
        pids = served.pids()
        assert {"cs-supervisor", "cs-engine", "cs-frontend-0", "cs-frontend-1"} <= set(pids), pids
        assert pids["cs-supervisor"] == served.process.pid
        for name in ("cs-supervisor", "cs-frontend-0", "cs-frontend-1"):
            maps = Path(f"/proc/{pids[name]}/maps").read_text()
            assert "libtorch" not in maps, f"{name} loaded torch"
        assert "libtorch" in Path(f"/proc/{pids['cs-engine']}/maps").read_text()  # (the check can fail)
        os.kill(pids["cs-frontend-0"], signal.SIGKILL)
        served.wait(
            lambda: served.pids().get("cs-frontend-0") not in (None, pids["cs-frontend-0"]), 30, "a new frontend 0"
        )
        served.wait(lambda: served.info().frontends == 2, 60, "2 live frontends again")
        for _ in range(4):  # (SO_REUSEPORT: each lands on either frontend)
            client = Client(served.stub(), session(talk(2.0), pace_s=0))
            assert client.result() == grpc.StatusCode.OK, client.details
            assert client.finals
        assert "libtorch" not in Path(f"/proc/{served.process.pid}/maps").read_text(), (
            "the supervisor loaded torch"
        )


def test_a_dead_frontend_is_respawned_and_counted_live():
    with Served("--frontends", "2") as served:
        served.wait(lambda: served.health() == SERVING, 60, "SERVING")
        assert served.info().frontends == 2
        old = served.pids()["cs-frontend-1"]
        os.kill(old, signal.SIGKILL)
        new = served.wait(
            lambda: (pid := served.pids().get("cs-frontend-1")) not in (None, old) and pid, 30, "a new frontend 1"
        )
        assert new != old
        assert not Path(f"/proc/{old}").exists(), "the dead frontend is a zombie"
        served.wait(lambda: served.info().frontends == 2, 60, "2 live frontends again")


# --- drain -------------------------------------------------------------------------------------------


@needs_espeak
def test_a_drain_serves_open_streams_through_the_grace_and_refuses_new_ones():
    """SIGTERM: NOT_SERVING with the port open, new streams UNAVAILABLE, an open stream that ends within the
    grace gets every final and OK; the server exits 0."""
    with Served("--frontends", "1", "--drain-grace-s", "20") as served:
        served.wait(lambda: served.health() == SERVING, 60, "SERVING")
        audio = talk(5.0)
        live = Client(served.stub(), session(audio))
        assert live.started.wait(30)
        served.process.send_signal(signal.SIGTERM)
        served.wait(lambda: served.health() == NOT_SERVING, 5, "NOT_SERVING during the grace")
        late = Client(served.stub(), iter([config(), *paced(audio[: CHUNK * 20], 0.0)]))
        assert late.result() == grpc.StatusCode.UNAVAILABLE and "shutting down" in late.details
        assert live.result() == grpc.StatusCode.OK, live.details
        speech_ended = [r for r in live.responses if r.speech_event.type == pb.SpeechEvent.SPEECH_ENDED]
        assert len(live.finals) == len(speech_ended) >= 2
        assert live.finals[-1].end_ms > 4000  # the audio sent after SIGTERM was transcribed too
        assert served.process.wait(30) == 0


@needs_espeak
def test_a_stream_that_outlasts_the_grace_gets_its_final_then_unavailable():
    with Served("--frontends", "1", "--drain-grace-s", "1.5") as served:
        served.wait(lambda: served.health() == SERVING, 60, "SERVING")
        live = Client(served.stub(), session(talk(20.0)))
        assert live.started.wait(30)
        served.process.send_signal(signal.SIGTERM)
        assert live.result() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in live.details
        assert live.finals, "no final for the audio received before the cut"
        last_final, status = live.responses[-2:]  # the final, then the status as a response
        assert last_final.results and last_final.results[0].is_final
        assert (
            status.error.code == grpc.StatusCode.UNAVAILABLE.value[0] and "shutting down" in status.error.message
        )
        assert served.process.wait(30) == 0


# --- one client cannot hurt the others ----------------------------------------------------------------------


@needs_espeak
def test_an_idle_stream_mid_utterance_gets_its_final_then_deadline_exceeded():
    hold = threading.Event()

    def requests():
        yield config()
        data = encode(speech(SENTENCES[0]), "LINEAR16")
        for offset in range(0, len(data), CHUNK * 10):
            yield pb.StreamingRecognizeRequest(audio=data[offset : offset + CHUNK * 10])
        hold.wait(30)  # then nothing: mid-utterance, no pause heard, no half-close

    with Served("--frontends", "1", "--idle-timeout-s", "1") as served:
        client = Client(served.stub(), requests())
        try:
            assert client.result() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            hold.set()
        kinds = [r.speech_event.type for r in client.responses if r.HasField("speech_event")]
        assert kinds[0] == pb.SpeechEvent.SPEECH_STARTED
        assert len(client.finals) == 1 and client.finals[0].transcript


VANISHING_CLIENT = """
import sys, time, grpc
from cosystream.v1 import cosystream_pb2 as pb, cosystream_pb2_grpc as pb_grpc
def requests():
    yield pb.StreamingRecognizeRequest(config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000))
    yield pb.StreamingRecognizeRequest(audio=bytes(3200))
    print("streaming", flush=True)
    time.sleep(3600)
for _ in pb_grpc.CosyStreamStub(grpc.insecure_channel(sys.argv[1])).StreamingRecognize(requests()):
    pass
"""


def test_keepalive_frees_the_slot_of_a_client_that_vanished():
    """A client whose process stops answering (a laptop lid closed, a phone out of coverage: no FIN, no
    RST) has its connection closed by the server's keepalive pings and its slot freed in seconds, long
    before the stream's idle timeout; a client that answers the pings keeps its quiet stream."""
    flags = ("--keepalive-s", "1", "--keepalive-timeout-s", "1", "--idle-timeout-s", "300")
    with Served("--frontends", "1", *flags) as served:
        repo = Path(__file__).resolve().parent.parent
        client = subprocess.Popen(
            [sys.executable, "-c", VANISHING_CLIENT, served.address], stdout=subprocess.PIPE, text=True, cwd=repo
        )
        try:
            assert client.stdout.readline().strip() == "streaming"
            time.sleep(4)  # a ping a second, each answered: the quiet stream stays
            assert served.info().active_sessions == 1
            client.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            while served.info().active_sessions:
                assert time.monotonic() - stopped < 15, "the vanished client's slot was not freed"
                time.sleep(0.2)
        finally:
            client.kill()
            client.wait()


@needs_espeak
def test_finalize_after_every_chunk_costs_at_most_twice_the_audio():
    with Served("--frontends", "1") as served:
        audio = talk(6.0)

        def requests():
            yield config()
            for offset in range(0, len(audio), CHUNK):
                yield pb.StreamingRecognizeRequest(audio=audio[offset : offset + CHUNK])
                yield pb.StreamingRecognizeRequest(control=pb.Control(type=pb.Control.FINALIZE))

        before = served.metric("cosystream_frames_total")
        client = Client(served.stub(), requests())
        assert client.result() == grpc.StatusCode.OK, client.details
        time.sleep(1.5)  # the engine publishes its counters once a second
        stepped = served.metric("cosystream_frames_total") - before
        audio_frames = len(audio) // CHUNK
        assert 0 < stepped <= 2 * audio_frames + 40, (stepped, audio_frames)


@needs_espeak
def test_a_huge_audio_message_does_not_stall_other_sessions():
    """A 9.6 MB chunk (300 s of speech, under the 10 MiB cap) from one client; meanwhile GetServerInfo round
    trips on the same frontend stay short."""
    huge = (talk(20.0) * 15)[:9_600_000]
    with Served("--frontends", "1") as served:
        served.wait(lambda: served.health() == SERVING, 60, "SERVING")
        stub = served.stub()
        stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        round_trips: list[float] = []

        def measure(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                started = time.perf_counter()
                stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
                round_trips.append(time.perf_counter() - started)
                time.sleep(0.02)

        meter = threading.Thread(target=measure, args=(5.0,))
        meter.start()
        time.sleep(0.3)
        batch = Client(stub, iter([config(pb.BATCH), pb.StreamingRecognizeRequest(audio=huge)]))
        meter.join()
        assert batch.started.is_set() and len(round_trips) > 50
        assert max(round_trips) < 0.1, f"GetServerInfo took up to {max(round_trips) * 1e3:.0f} ms"
        assert batch.result(120) == grpc.StatusCode.OK, batch.details


@needs_espeak
def test_a_client_that_never_reads_stops_being_read():
    """Responses pile up for a client that does not read them: past the bound the server stops reading its
    requests (flow control), so memory stays bounded whatever the client does."""
    audio = talk(20.0) * 24  # 8 minutes
    chunks = len(audio) // (CHUNK * 10)
    sent = [0]

    async def never_read(address: str) -> None:
        options = [("grpc.http2.bdp_probe", 0)]  # keep the client's receive window at its 64 KB start
        async with grpc.aio.insecure_channel(address, options=options) as channel:

            async def requests():
                yield config(pb.BATCH, interim_results=True, enable_word_time_offsets=True)
                for i in range(chunks):
                    sent[0] = i + 1
                    yield pb.StreamingRecognizeRequest(audio=audio[i * CHUNK * 10 : (i + 1) * CHUNK * 10])

            call = pb_grpc.CosyStreamStub(channel).StreamingRecognize(requests())
            last, stalled_since = -1, time.monotonic()
            while time.monotonic() - stalled_since < 4 and sent[0] < chunks:
                await asyncio.sleep(0.25)
                if sent[0] != last:
                    last, stalled_since = sent[0], time.monotonic()
            call.cancel()

    with Served("--frontends", "1") as served:
        served.wait(lambda: served.health() == SERVING, 60, "SERVING")
        asyncio.run(asyncio.wait_for(never_read(served.address), 120))
        assert sent[0] < chunks, "the server read every request of a client that read no response"
        served.wait(lambda: served.info().active_sessions == 0, 10, "its slot freed after the cancel")


def test_our_clients_report_the_status_the_server_sent():
    """A full server refuses while the client is still writing: grpcio's asyncio client may then say
    INTERNAL "Internal error from Core"; the telephony gateway's stream (and the captioner and the latency
    probe, which share cosystream.v1.client.StreamStatus) report RESOURCE_EXHAUSTED, every time."""
    from clients.telephony.asr import AsrStream, streaming_config

    async def refused(address: str, tries: int) -> list[str]:
        codes = []
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.CosyStreamStub(channel)
            for _ in range(tries):
                stream = AsrStream(stub, streaming_config(pb.MULAW, False), lambda result: None)
                for _ in range(100):
                    stream.feed(bytes(160))
                try:
                    await asyncio.wait_for(stream.run(), 20)
                    codes.append("OK")
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code().name)
        return codes

    with Served("--frontends", "1", "--max-sessions", "1") as served:
        held = HeldStream(served.stub())
        try:
            served.wait(lambda: served.info().active_sessions == 1, 10, "the one slot taken")
            codes = asyncio.run(refused(served.address, 40))
        finally:
            held.close()
        assert set(codes) == {"RESOURCE_EXHAUSTED"}, codes


# --- what a new user runs into ------------------------------------------------------------------------


def write_wav(path: Path, audio: np.ndarray, rate_hz: int = 16000) -> Path:
    import wave

    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate_hz)
        out.writeframes(encode(audio, "LINEAR16"))
    return path


def test_a_probe_that_reaches_no_server_says_why_and_fails(tmp_path):
    wav = write_wav(tmp_path / "tone.wav", (0.3 * np.sin(np.arange(16000) / 5)).astype(np.float32))
    probe = [sys.executable, "clients/latency_probe.py", "--realtime", "2", "--duration", "1", "--wav", str(wav)]
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run(
        [*probe, "--server", "127.0.0.1:1"], capture_output=True, text=True, timeout=60, cwd=root, env=env
    )
    assert run.returncode == 1
    assert "latency_probe: every stream failed against 127.0.0.1:1: UNAVAILABLE" in run.stderr, run.stderr
    run = subprocess.run(
        [*probe, "--server", "127.0.0.1:1", "--metrics-url", "http://127.0.0.1:1/metrics"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
        env=env,
    )
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("latency_probe: cannot read --metrics-url http://127.0.0.1:1/metrics")


def test_a_server_address_without_a_port_means_50051():
    from cosystream.v1.client import server_address

    assert server_address("localhost") == "localhost:50051"
    assert server_address("10.1.2.3:6000") == "10.1.2.3:6000"
    assert server_address("::1") == "[::1]:50051"
    assert server_address("[::1]:7") == "[::1]:7"
    assert server_address("unix:/run/cs.sock") == "unix:/run/cs.sock"


@needs_espeak
@pytest.mark.skipif(shutil.which("sox") is None, reason="needs sox")
def test_transcribe_takes_every_wav_encoding_and_explains_the_rest(tmp_path):
    pcm = write_wav(tmp_path / "pcm.wav", np.concatenate([speech(SENTENCES[1]), silence(0.5)]))
    variants = {
        "mulaw": ["-e", "u-law", "-b", "8"],
        "alaw": ["-e", "a-law", "-b", "8"],
        "float": ["-e", "floating-point", "-b", "32"],
        "stereo24": ["-b", "24", "-c", "2", "-r", "44100"],
    }
    for name, args in variants.items():
        subprocess.run(["sox", str(pcm), *args, str(tmp_path / f"{name}.wav")], check=True)
    (tmp_path / "notes.txt").write_text("not audio")

    def transcribe(path: Path, address: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "cosystream", "transcribe", str(path), "--server", address],
            capture_output=True,
            text=True,
            timeout=60,
        )

    with Served("--frontends", "1") as served:
        reference = transcribe(pcm, served.address)
        assert reference.returncode == 0 and reference.stdout.strip(), reference.stderr
        text = reference.stdout.split("]", 1)[1].strip()
        for name in variants:
            run = transcribe(tmp_path / f"{name}.wav", served.address)
            assert run.returncode == 0, (name, run.stderr)
            assert run.stdout.split("]", 1)[1].strip() == text, (name, run.stdout, text)
        refused = transcribe(tmp_path / "notes.txt", served.address)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert "Format not recognised" in refused.stderr and "sox IN -c 1 -b 16 OUT.wav" in refused.stderr
