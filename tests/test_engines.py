"""Several engine processes behind one server (``serve --engines N``; ``--device cuda:all`` is the same with
one engine per GPU): least-loaded placement, and an engine that dies ending only its own sessions.

A real ``cosystream serve`` with two CPU engines, real gRPC streams, and a real SIGKILL.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from cosystream.v1 import cosystream_pb2 as pb
from tests.servers import HeldStream, Served
from tests.speech import encode, needs_espeak, silence, speech

SENTENCE = "please call stella and ask her to bring these things"


def engine_sessions(served: Served) -> tuple[int, int]:
    return tuple(int(served.metric("cosystream_engine_sessions", engine=str(i))) for i in (0, 1))


def transcribe(stub, data: bytes) -> str:
    def requests():
        yield pb.StreamingRecognizeRequest(config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000))
        for offset in range(0, len(data), 3200):
            yield pb.StreamingRecognizeRequest(audio=data[offset : offset + 3200])

    responses = stub.StreamingRecognize(requests(), timeout=60)
    return " ".join(r.transcript for response in responses for r in response.results if r.is_final)


@pytest.fixture(scope="module")
def served():
    with Served("--frontends", "1", "--engines", "2", "--max-sessions", "4") as served:
        yield served


def test_server_info_shows_each_engine(served):
    info = served.info()
    assert info.max_sessions == 8  # four slots each
    assert [(e.index, e.device, e.serving, e.max_sessions) for e in info.engines] == [
        (0, "cpu", True, 4),
        (1, "cpu", True, 4),
    ]
    assert set(served.pids()) >= {"cs-engine-0", "cs-engine-1"}


def test_new_sessions_go_to_the_least_loaded_engine(served):
    stub = served.stub()
    held = []
    try:
        for expected in [(1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3)]:
            held.append(HeldStream(stub))
            served.wait(lambda expected=expected: engine_sessions(served) == expected, 10, f"placement {expected}")
        # Both engines' slots count: six sessions are open on a server of two 4-slot engines.
        assert served.info().active_sessions == 6
    finally:
        for stream in held:
            stream.close()
    served.wait(lambda: engine_sessions(served) == (0, 0), 10, "every slot freed")


@needs_espeak
def test_both_engines_transcribe_alike(served):
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    stub = served.stub()
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, transcribe(stub, data))) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert got[0] and got[0] == got[1]


def test_an_engine_that_dies_ends_only_its_own_sessions(served):
    stub = served.stub()
    held = [HeldStream(stub) for _ in range(4)]
    try:
        served.wait(lambda: engine_sessions(served) == (2, 2), 10, "two sessions on each engine")
        os.kill(served.pids()["cs-engine-1"], signal.SIGKILL)
        served.wait(lambda: len([s for s in held if s.error is not None]) == 2, 15, "two sessions ending")
        assert {s.error.code() for s in held if s.error is not None} == {grpc.StatusCode.UNAVAILABLE}
        assert served.health() == 1  # SERVING: engine 0 carries on
        # A new session meanwhile goes to the engine that is up, and is served there.
        during = HeldStream(stub)
        held.append(during)
        served.wait(lambda: engine_sessions(served)[0] == 3, 10, "the new session on engine 0")
        # Engine 1 comes back; the survivors are still open; new sessions go to it again.
        served.wait(lambda: all(e.serving for e in served.info().engines), 60, "engine 1 restarted")
        alive = [s for s in held if s.error is None]
        assert len(alive) == 3 and all(s.thread.is_alive() for s in alive)
        held.append(HeldStream(stub))
        served.wait(lambda: engine_sessions(served) == (3, 1), 10, "placement on the restarted engine")
    finally:
        for stream in held:
            stream.close()
    assert all(s.error is None for s in alive), [s.error for s in alive]


def test_devices_and_engines_resolve_to_one_device_per_engine_process():
    """Without torch (serve's supervisor never loads it): CUDA devices are counted only when one is named, and
    ``auto`` is left to each engine."""
    import torch

    from cosystream.engine.config import cuda_device_count, resolve_devices

    def uncounted() -> int:
        raise AssertionError("CUDA devices counted for a device that names none")

    def two() -> int:
        return 2

    assert resolve_devices("cpu", 3, uncounted) == ["cpu", "cpu", "cpu"]
    assert resolve_devices("auto", 2, uncounted) == ["auto", "auto"]
    with pytest.raises(ValueError, match="--engines must be >= 1"):
        resolve_devices("cpu", 0, uncounted)
    assert resolve_devices("cuda:all", cuda_count=two) == ["cuda:0", "cuda:1"]
    assert resolve_devices("0,0", cuda_count=two) == ["cuda:0", "cuda:0"]
    assert resolve_devices("cuda", 2, two) == ["cuda:0", "cuda:0"]
    with pytest.raises(ValueError, match="does not go with it"):
        resolve_devices("cuda:all", 2, two)
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0..cuda:1"):
        resolve_devices("cuda:0,cuda:2", cuda_count=two)
    with pytest.raises(ValueError, match="--device gpu: not a device"):
        resolve_devices("gpu", cuda_count=two)
    for name in ("cuda:all", "cuda:0,cuda:1", "0,1", "cuda"):
        with pytest.raises(ValueError, match="no CUDA device is available"):
            resolve_devices(name, cuda_count=lambda: 0)
    # The count is torch's, taken in an interpreter of its own.
    assert cuda_device_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_serve_refuses_engines_it_cannot_start():
    import subprocess
    import sys

    for args, message in [
        (["--engines", "0"], "--engines must be >= 1"),
        (["--naive", "--engines", "2"], "--naive runs no engine process"),
        (["--adaptive", "default=nope"], "no model 'nope' is served"),
        (["--model", "embedded:heavy"], "no such embedded model (there are embedded:default, embedded:light)"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "cosystream", "serve", "--port", "0", *args], capture_output=True, text=True
        )
        assert done.returncode == 1 and message in done.stderr, (args, done.stderr)


class Sink:
    """A session's end of the engine channel, recording what the engine said."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.refused: list[str] = []
        self.frames = 0

    def on_opened(self, model: int) -> None:
        self.opened.append(model)

    def on_moved(self, model: int) -> None:
        pass

    def on_refused(self, message: str, shed: bool, retry_after_s: float | None = None) -> None:
        self.refused.append(message)

    def on_results(self, ids, logprobs, queue_s: float, compute_s: float) -> None:
        self.frames += len(ids)

    def on_engine_lost(self) -> None:
        self.refused.append("lost")


def test_a_session_refused_by_a_full_engine_opens_on_another_with_its_first_frames(tmp_path):
    """Two frontends place sessions at once, each before the other's shows in the engines' counts: both go
    to engine 0, one of them (whichever the engine reads second) is refused there, full, and opens on engine
    1, with the frames it had sent before the refusal sent again: every frame of both gets its result."""
    import asyncio
    import dataclasses

    from cosystream.engine.config import EngineConfig, EngineProcessConfig
    from cosystream.engine.launch import start_engine
    from cosystream.frontend.engine_pool import ID_STRIDE, EnginePool
    from cosystream.models import FRAME_SAMPLES
    from cosystream.priority import Priority

    base = EngineProcessConfig(address="", authkey=b"k" * 16, engine=EngineConfig(max_sessions=1), device="cpu")
    configs = [dataclasses.replace(base, address=str(tmp_path / f"e{i}.sock"), index=i) for i in range(2)]
    handles = [start_engine(config) for config in configs]
    try:
        for handle in handles:
            assert handle.wait_ready(120)
        frames = np.zeros((7, FRAME_SAMPLES), dtype=np.float32)

        async def run() -> tuple[Sink, Sink]:
            a, b = (EnginePool([c.address for c in configs], base.authkey) for _ in range(2))
            await asyncio.gather(a.connect(), b.connect())
            first, second = Sink(), Sink()
            a.open(key_a := a.new_key(), Priority.REALTIME, first)
            a.send_frames(key_a, frames)
            b.open(key_b := b.new_key(), Priority.REALTIME, second)  # (b has not heard of a's session yet)
            b.send_frames(key_b, frames)
            for _ in range(200):
                await asyncio.sleep(0.02)
                if first.frames == second.frames == len(frames):
                    break
            a.close_connection()
            b.close_connection()
            return first, second

        first, second = asyncio.run(run())
        assert first.refused == second.refused == []
        assert sorted(first.opened + second.opened) == [0, ID_STRIDE]  # one on each engine
        assert first.frames == second.frames == len(frames)
    finally:
        for handle in handles:
            handle.process.terminate()
            handle.process.join(10)


def test_admin_status_lists_the_models_and_each_engine(served):
    import subprocess
    import sys

    deadline = time.monotonic() + 15
    while True:  # (the host's CPU is reported once its first 2 s window is sampled)
        done = subprocess.run(
            [sys.executable, "-m", "cosystream", "admin", "status", "--server", served.address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        if "not sampled yet" not in done.stdout or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert lines[0].endswith("0 of 8 sessions open, 1 frontend(s), 1 model version(s) in memory"), lines
    assert lines[1].startswith("model cosystream-en-conv-ctc (default): version ") and "float32" in lines[1]
    assert lines[2:4] == ["engine 0 (cpu): serving, 0 of 4 sessions", "engine 1 (cpu): serving, 0 of 4 sessions"]
    assert lines[4].startswith("load: engine 0.") and "0 realtime / 0 batch sessions, 8 slots free" in lines[4]
    assert (
        lines[5].startswith("this frontend: loop ")
        and " cores busy, " in lines[5]
        and lines[5].endswith("(admit 0)")
    )


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_two_engines_on_one_gpu_each_capture_their_graphs_and_serve():
    """``--device cuda:0,cuda:0``: two engine processes on one GPU (as ``cuda:all`` on a host of two), each
    with its own graphs; sessions on both are served."""
    import torch

    with Served("--frontends", "1", "--device", "cuda:0,cuda:0", "--max-sessions", "8") as served:
        assert [e.device for e in served.info().engines] == [torch.cuda.get_device_name(0)] * 2
        held = [HeldStream(served.stub()) for _ in range(4)]
        try:
            served.wait(lambda: engine_sessions(served) == (2, 2), 20, "two sessions on each engine")
        finally:
            for stream in held:
                stream.close()
        assert all(stream.error is None for stream in held), [stream.error for stream in held]


def test_a_frontend_gone_before_its_hello_leaves_the_engine_serving(tmp_path):
    """A frontend that connects and dies before the engine greets it (a crash at start-up, an OOM kill) is
    dropped; the engine goes on serving the others (it used to exit on the broken pipe of the HELLO)."""
    import asyncio
    from multiprocessing.connection import Client

    from cosystream.engine.config import EngineProcessConfig
    from cosystream.engine.launch import start_engine
    from cosystream.frontend.engine_client import EngineClient
    from cosystream.models import FRAME_SAMPLES
    from cosystream.priority import Priority

    config = EngineProcessConfig(address=str(tmp_path / "e.sock"), authkey=b"k" * 16, device="cpu")
    handle = start_engine(config)
    try:
        assert handle.wait_ready(120)
        for _ in range(20):
            Client(config.address, family="AF_UNIX", authkey=config.authkey).close()
        frames = np.zeros((5, FRAME_SAMPLES), dtype=np.float32)

        async def run() -> Sink:
            pool = EngineClient(config.address, config.authkey)
            await pool.connect()
            sink = Sink()
            pool.open(key := pool.new_key(), Priority.REALTIME, sink)
            pool.send_frames(key, frames)
            for _ in range(250):
                await asyncio.sleep(0.02)
                if sink.frames == len(frames):
                    break
            pool.close_connection()
            return sink

        sink = asyncio.run(run())
        assert handle.process.is_alive()
        assert sink.refused == [] and sink.frames == len(frames)
    finally:
        handle.process.terminate()
        handle.process.join(10)
