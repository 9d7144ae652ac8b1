"""``cosystream serve`` as users run it: a subprocess with two frontends, metrics, and a SIGTERM drain."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import cosystream.models
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import HeldStream, Served, serve_argv
from tests.speech import encode, needs_espeak, silence, speech

pytestmark = needs_espeak

REQUIRED_METRICS = [
    "cosystream_active_sessions",
    "cosystream_frames_total",
    "cosystream_step_seconds",
    "cosystream_batch_size",
    "cosystream_result_latency_seconds",
    "cosystream_first_result_latency_seconds",
    "cosystream_deadline_misses_total",
    "cosystream_rejected_sessions_total",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def served():
    with Served("--frontends", "2", "--max-sessions", "8", "--drain-grace-s", "10") as server:
        yield server.process, server.port, server.metrics_port, server.log


def wait_serving(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service="cosystream.v1.CosyStream")).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise AssertionError("never SERVING")


def test_serve_drains_on_sigterm(served):
    process, port, metrics_port, log = served
    address = f"127.0.0.1:{port}"
    wait_serving(address)
    # Sessions spread over both frontends (SO_REUSEPORT): open several, each on its own channel.
    audio = encode(
        np.concatenate([silence(0.3), speech("one two three four five six seven eight"), silence(2.0)]), "LINEAR16"
    )
    started = threading.Event()
    outcome: dict = {}

    def stream():
        def requests():
            yield pb.StreamingRecognizeRequest(config=pb.StreamingConfig(sample_rate_hz=16000))
            for offset in range(0, len(audio), 320):
                time.sleep(0.01)
                yield pb.StreamingRecognizeRequest(audio=audio[offset : offset + 320])

        with grpc.insecure_channel(address) as channel:
            responses = []
            try:
                for response in pb_grpc.CosyStreamStub(channel).StreamingRecognize(requests(), timeout=60):
                    responses.append(response)
                    if response.speech_event.type == pb.SpeechEvent.SPEECH_STARTED:
                        started.set()
                outcome["responses"] = responses
            except grpc.RpcError as err:
                outcome["error"] = err

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(30), "no SPEECH_STARTED"
    active = re.compile(r'^cosystream_active_sessions\{priority="realtime"\} 1\.0', re.M)
    deadline = time.monotonic() + 5  # the engine publishes its gauges once a second
    while True:
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        if active.search(metrics) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for name in REQUIRED_METRICS:
        assert re.search(rf"^{name}", metrics, re.M), f"{name} missing from /metrics"
    assert active.search(metrics), metrics

    process.send_signal(signal.SIGTERM)
    client.join(30)
    assert "error" not in outcome, outcome.get("error")
    kinds = [r.speech_event.type for r in outcome["responses"] if r.HasField("speech_event")]
    finals = [res for r in outcome["responses"] for res in r.results if res.is_final]
    assert kinds == [pb.SpeechEvent.SPEECH_STARTED, pb.SpeechEvent.SPEECH_ENDED]
    assert len(finals) == 1
    assert process.wait(30) == 0, "".join(log)


# A channel of its own connection (gRPC otherwise shares one connection among a process's channels).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def server_info_from_fresh_channels(address: str, n: int) -> list[int]:
    """``active_sessions`` as n new connections see it (SO_REUSEPORT spreads them over the frontends)."""
    counts = []
    for _ in range(n):
        with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
            info = pb_grpc.CosyStreamStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            counts.append(info.active_sessions)
    return counts


def test_server_info_counts_the_sessions_of_every_frontend(served):
    """GetServerInfo.active_sessions is the server's count, whichever frontend answers."""
    _, port, _, log = served
    address = f"127.0.0.1:{port}"
    wait_serving(address)
    # The second frontend joins the port once its decoder is loaded; until then the first takes every call.
    deadline = time.monotonic() + 30
    while not any("frontend-1" in line and "serving on" in line for line in log):
        assert time.monotonic() < deadline, "".join(log)
        time.sleep(0.1)
    # Six streams, each on its own connection: spread over both frontends.
    channels = [grpc.insecure_channel(address, options=OWN_CONNECTION) for _ in range(6)]
    held = [HeldStream(pb_grpc.CosyStreamStub(channel)) for channel in channels]
    try:
        deadline = time.monotonic() + 10
        while (counts := server_info_from_fresh_channels(address, 10)) != [6] * 10:
            assert time.monotonic() < deadline, f"active_sessions seen: {counts}\n" + "".join(log)
            time.sleep(0.2)
    finally:
        for stream, channel in zip(held, channels, strict=True):
            stream.close()
            channel.close()
    deadline = time.monotonic() + 10
    while (counts := server_info_from_fresh_channels(address, 4)) != [0] * 4:
        assert time.monotonic() < deadline, f"slots not freed: {counts}"
        time.sleep(0.2)


DEFAULT_MODEL = Path(cosystream.models.__file__).with_name("default")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lm", "BAD"], "not an ARPA file"),
        (["--lm", "MISSING"], "no such file"),
        (["--decoder", "beam", "--model", "EMPTY"], "beam decoding needs a language model"),
        (["--beam-size", "0"], "--beam-size must be >= 1"),
        (["--realtime-burst-s", "-1"], "realtime_burst_s must be >= 0"),
        (["--resume-window-s", "0"], "--resume-window-s must be > 0"),
        (["--trace-sample", "0.5"], "--trace-sample goes with --otlp-endpoint"),
        (["--otlp-endpoint", "collector:4318"], "--otlp-endpoint must be an http:// or https:// URL"),
        (["--otlp-endpoint", "http://c:4318/v1/traces", "--trace-sample", "2"], "--trace-sample must be between"),
    ],
)
def test_serve_refuses_a_bad_decoder_setup_with_one_line(tmp_path, args, message):
    (tmp_path / "bad.arpa").write_text("this is not a language model\n")
    (tmp_path / "empty").mkdir()  # a model without a language model: the default one's files, less its LM
    for name in ("config.json", "vocabulary.json", "model.safetensors"):
        shutil.copy(DEFAULT_MODEL / name, tmp_path / "empty" / name)
    paths = {"BAD": tmp_path / "bad.arpa", "MISSING": tmp_path / "missing.arpa", "EMPTY": tmp_path / "empty"}
    args = [str(paths.get(a, a)) for a in args]
    run = subprocess.run(
        serve_argv(*args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert run.stderr.startswith("cosystream serve: ") and message in run.stderr
    assert run.stderr.count("\n") == 1, run.stderr


def refused_beside(busy: socket.socket, *serve_args: str) -> str:
    """``cosystream serve *serve_args`` (``{port}``: ``busy``'s port) while ``busy`` listens: its one line."""
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    args = [a.replace("{port}", port) for a in serve_args]
    run = subprocess.run(
        [sys.executable, "-m", "cosystream", "serve", "--http-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    return run.stderr


def test_serve_refuses_a_busy_metrics_port_with_one_line():
    with socket.socket() as busy:
        line = refused_beside(busy, "--port", "0", "--metrics-port", "{port}")
        assert line.startswith(f"cosystream serve: cannot serve metrics on port {busy.getsockname()[1]}: "), line


@pytest.mark.parametrize("reuseport", [False, True], ids=["plain", "another-cosystream"])
def test_serve_refuses_a_busy_grpc_port_with_one_line(reuseport):
    """A port another program listens on, or another server whose frontends share it (SO_REUSEPORT, as
    cosystream's do): serve must not start beside it and split its connections."""
    with socket.socket() as busy:
        if reuseport:
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        line = refused_beside(busy, "--port", "{port}", "--metrics-port", "0")
        assert line.startswith(f"cosystream serve: cannot serve on port {busy.getsockname()[1]}: "), line
