"""Starts ``cosystream serve`` with a given command (in a container, or not) and checks it from outside.

Used by ``scripts/image_test.sh``, which runs the server in the image with ``buildah run``; any command that
starts ``cosystream serve`` on the given ports, as the given uid, works::

    python scripts/image_checks.py --port 50151 --metrics-port 50152 --http-port 50153 --wav speech.wav \
        --words "hello world" --uid 10001 -- buildah run --isolation chroot --network host CONTAINER -- \
        cosystream serve --host 127.0.0.1 --port 50151 --metrics-port 50152 --http-port 50153

In order, each a named check in the JSON object printed at the end (one line; exit 1 if any failed):
``health`` SERVING within the start-up timeout; ``non_root`` every server process (``cs-*``) runs as the
expected non-zero uid; ``transcribe`` the WAV through ``cosystream transcribe --server`` gives most of the
spoken words; ``metrics`` /metrics answers with ``cosystream_`` series that counted those frames;
``compiled`` the engine runs the image's compiled CPU step (``cosystream_compiled_shapes`` above 0: the
packages built into the image load there, with no compiler); ``http``
the HTTP port serves its page (skipped without ``--http-port``); ``reflection`` lists the native, Google
and Riva services; ``google`` the unmodified google-cloud-speech client transcribes the WAV; ``riva``
Riva's config call names the model; ``drain`` a SIGTERM during a realtime stream: health NOT_SERVING with
the port open, a new stream refused UNAVAILABLE, the open one served to its final and OK; ``exit`` the
server then exits 0 within the drain grace plus 6 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

SERVICES = ("cosystream.v1.CosyStream", "google.cloud.speech.v1.Speech", "nvidia.riva.asr.RivaSpeechRecognition")
CHECKS = (
    "health",
    "non_root",
    "transcribe",
    "metrics",
    "compiled",
    "http",
    "reflection",
    "google",
    "riva",
    "drain",
    "exit",
)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
COSYSTREAM = Path(sys.executable).with_name("cosystream")


class CheckFailed(Exception):
    """A check's expectation that did not hold; the message says what was seen."""


def words_heard(transcript: str, spoken: list[str]) -> str:
    """``transcript`` if it holds at least half of the ``spoken`` words, else :class:`CheckFailed`."""
    heard = set(transcript.lower().split())
    found = [w for w in spoken if w in heard]
    if len(found) * 2 < len(spoken):
        raise CheckFailed(f"heard {transcript!r}, expected most of {' '.join(spoken)!r}")
    return transcript


def final_text(cli_output: str) -> str:
    """The words of ``cosystream transcribe``'s finals: ``[start - end] text`` (interims: ``[...] ... text``)."""
    texts = (line.split("]", 1)[1].strip() for line in cli_output.splitlines() if line.startswith("["))
    return " ".join(text for text in texts if not text.startswith("..."))


def process_tree(root_pid: int) -> list[tuple[int, str, int]]:
    """(pid, comm, real uid) of ``root_pid`` and every descendant, read from /proc."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            status = (entry / "status").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
        children.setdefault(ppid, []).append(int(entry.name))
        info[int(entry.name)] = (comm, uid)
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        if pid in info:
            found.append((pid, *info[pid]))
        todo.extend(children.get(pid, []))
    return found


class Checker:
    """The checks against one server; each returns what it saw, or raises :class:`CheckFailed`."""

    def __init__(self, args: argparse.Namespace, server: subprocess.Popen) -> None:
        self.args = args
        self.server = server
        self.address = f"127.0.0.1:{args.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.spoken = args.words.lower().split()
        self.results: dict[str, dict] = {}
        self.sigterm_at: float | None = None

    def run(self, name: str, check: Callable[[], str]) -> bool:
        started = time.monotonic()
        try:
            detail, ok = check(), True
        except CheckFailed as err:
            detail, ok = str(err), False
        except Exception as err:  # a check that breaks is a failed check, reported with the others
            detail, ok = f"{type(err).__name__}: {err}", False
        self.results[name] = {"ok": ok, "s": round(time.monotonic() - started, 2), "detail": detail}
        print(f"image check {name}: {'ok' if ok else 'FAILED'}: {detail}", file=sys.stderr, flush=True)
        return ok

    def health_status(self, service: str = "") -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

    def supervisor_pid(self) -> int:
        """The server's ``cs-supervisor`` process, the one SIGTERM goes to: ``buildah run`` does not
        forward signals (it kills its container)."""
        pids = [pid for pid, comm, _ in process_tree(self.server.pid) if comm == "cs-supervisor"]
        if len(pids) != 1:
            raise CheckFailed(f"expected one cs-supervisor process under {self.server.pid}, found {pids}")
        return pids[0]

    def check_health(self) -> str:
        started = time.monotonic()
        while time.monotonic() < started + self.args.start_timeout_s:
            if self.server.poll() is not None:
                raise CheckFailed(f"the server exited with {self.server.returncode} before SERVING")
            try:
                if self.health_status() == SERVING and self.health_status(SERVICES[0]) == SERVING:
                    return f"SERVING after {time.monotonic() - started:.1f} s"
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.5)
        raise CheckFailed(f"not SERVING within {self.args.start_timeout_s} s")

    def check_non_root(self) -> str:
        servers = [(pid, comm, uid) for pid, comm, uid in process_tree(self.server.pid) if comm.startswith("cs-")]
        wrong = [p for p in servers if p[2] != self.args.uid]
        if not servers or wrong or self.args.uid == 0:
            raise CheckFailed(f"expected cs-* processes with uid {self.args.uid} (not 0), saw {servers}")
        return ", ".join(f"{comm} uid {uid}" for _, comm, uid in servers)

    def transcribe(self, *flags: str) -> subprocess.CompletedProcess:
        command = [str(COSYSTREAM), "transcribe", "--server", self.address, *flags, self.args.wav]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    def check_transcribe(self) -> str:
        done = self.transcribe()
        if done.returncode != 0:
            raise CheckFailed(f"exit {done.returncode}: {done.stderr.strip()}")
        return words_heard(final_text(done.stdout), self.spoken)

    def check_metrics(self) -> str:
        url = f"http://127.0.0.1:{self.args.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        series = [line for line in text.splitlines() if line.startswith("cosystream_")]
        frames = sum(
            float(line.rsplit(" ", 1)[1]) for line in series if line.startswith("cosystream_frames_total")
        )
        if not series or frames <= 0:
            raise CheckFailed(f"{len(series)} cosystream_ series, cosystream_frames_total {frames}")
        return f"{len(series)} cosystream_ series, {frames:.0f} frames counted"

    def check_compiled(self) -> str:
        url = f"http://127.0.0.1:{self.args.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        shapes = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("cosystream_compiled_shapes")
        )
        if shapes <= 0:
            raise CheckFailed("cosystream_compiled_shapes is 0: every shape of the step runs eager")
        return f"{shapes:.0f} shapes of the step run compiled"

    def check_http(self) -> str:
        if not self.args.http_port:
            return "skipped: --http-port 0"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.args.http_port}/", timeout=10) as response:
            kind = response.headers.get_content_type()
            if response.status != 200 or kind != "text/html":
                raise CheckFailed(f"GET / answered {response.status} {kind}")
            return f"GET / {response.status} {kind}, {len(response.read())} bytes"

    def check_reflection(self) -> str:
        stub = reflection_pb2_grpc.ServerReflectionStub(self.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
        names = {service.name for service in response.list_services_response.service}
        missing = [name for name in SERVICES if name not in names]
        if missing:
            raise CheckFailed(f"reflection lacks {missing}; lists {sorted(names)}")
        return ", ".join(sorted(names))

    def check_google(self) -> str:
        from google.cloud import speech_v1
        from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport

        client = speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=self.channel))
        config = speech_v1.StreamingRecognitionConfig(
            config=speech_v1.RecognitionConfig(language_code="en-US")  # encoding and rate from the WAV header
        )
        data = Path(self.args.wav).read_bytes()
        chunks = (
            speech_v1.StreamingRecognizeRequest(audio_content=data[i : i + 3200])
            for i in range(0, len(data), 3200)
        )
        finals = [
            result.alternatives[0].transcript
            for response in client.streaming_recognize(config, chunks, timeout=60)
            for result in response.results
            if result.is_final
        ]
        return words_heard(" ".join(finals), self.spoken)

    def check_riva(self) -> str:
        from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc

        stub = riva_asr_pb2_grpc.RivaSpeechRecognitionStub(self.channel)
        reply = stub.GetRivaSpeechRecognitionConfig(riva_asr_pb2.RivaSpeechRecognitionConfigRequest(), timeout=10)
        models = [model.model_name for model in reply.model_config]
        if not models:
            raise CheckFailed(f"no model in {reply}")
        return f"models {models}"

    def refused_while_draining(self) -> str:
        """A new stream during the drain: UNAVAILABLE, and the server says why."""
        stub = pb_grpc.CosyStreamStub(self.channel)
        config = pb.StreamingRecognizeRequest(config=pb.StreamingConfig(sample_rate_hz=16000))
        try:
            for _ in stub.StreamingRecognize(iter([config]), timeout=10):
                pass
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                return err.details()
            raise CheckFailed(f"a new stream while draining: {err.code().name} {err.details()}") from None
        raise CheckFailed("a new stream while draining ended OK")

    def check_drain(self) -> str:
        command = [
            str(COSYSTREAM),
            "transcribe",
            "--server",
            self.address,
            "--realtime",
            "--interim",
            self.args.wav,
        ]
        client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = client.stdout.readline()  # an interim: the stream is open and audio is flowing
            if not first:
                raise CheckFailed(f"the realtime stream gave nothing: {client.stderr.read().strip()}")
            os.kill(self.supervisor_pid(), signal.SIGTERM)
            self.sigterm_at = time.monotonic()
            deadline = self.sigterm_at + 5
            while self.health_status() != NOT_SERVING:
                if time.monotonic() > deadline:
                    raise CheckFailed("health still SERVING 5 s after SIGTERM")
                time.sleep(0.05)
            refusal = self.refused_while_draining()
            rest, errors = client.communicate(timeout=60)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
        if client.returncode != 0:
            raise CheckFailed(f"the open stream ended with exit {client.returncode}: {errors.strip()}")
        heard = words_heard(final_text(first + rest), self.spoken)
        return f"NOT_SERVING with the port open; a new stream: UNAVAILABLE {refusal!r}; the open one: {heard!r}"

    def check_exit(self) -> str:
        if self.sigterm_at is None:
            raise CheckFailed("no SIGTERM was sent")
        limit_s = self.args.drain_grace_s + 6
        try:
            code = self.server.wait(timeout=max(0.0, self.sigterm_at + limit_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"still running {limit_s} s after SIGTERM") from None
        if code != 0:
            raise CheckFailed(f"exit {code}")
        return f"exit 0, {time.monotonic() - self.sigterm_at:.1f} s after SIGTERM"


def stop(server: subprocess.Popen) -> None:
    """Kill whatever of the server is still running (after a failed check): its processes, then the launcher."""
    for pid, _, _ in process_tree(server.pid)[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the gRPC port the command serves on")
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, default=0, help="the command's --http-port (0: not checked)")
    parser.add_argument("--wav", required=True, help="speech to transcribe (a few seconds)")
    parser.add_argument("--words", required=True, help="what the WAV says")
    parser.add_argument("--uid", type=int, default=10001, help="the uid the server must run as")
    parser.add_argument("--drain-grace-s", type=float, default=20.0, help="the command's --drain-grace-s")
    parser.add_argument("--start-timeout-s", type=float, default=180.0)
    parser.add_argument("--log", help="the command's output goes here (default: inherited)")
    parser.add_argument("command", nargs="+", help="after --: the command that starts cosystream serve")
    args = parser.parse_args(argv)

    log = open(args.log, "wb") if args.log else None  # noqa: SIM115 (open for the server's whole life)
    server = subprocess.Popen(args.command, stdout=log, stderr=subprocess.STDOUT if log else None)
    checker = Checker(args, server)
    try:
        for name in CHECKS:
            if name != "health" and not checker.results["health"]["ok"]:
                checker.results[name] = {"ok": False, "s": 0.0, "detail": "not run: the server never served"}
            else:
                checker.run(name, getattr(checker, f"check_{name}"))
    finally:
        if server.poll() is None:
            stop(server)
        checker.channel.close()
        if log:
            log.close()
    passed = sum(r["ok"] for r in checker.results.values())
    print(json.dumps({"passed": passed, "checks": len(checker.results), "results": checker.results}))
    return 0 if passed == len(CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
