"""A whole server for a test module (the engine in a subprocess, a frontend on a background thread), a
client stream that holds a session open, and a TCP proxy that drops the connections it carries."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from cosystream.frontend.host import StreamOptions
from cosystream.server.frontend import FrontendConfig
from cosystream.v1 import cosystream_pb2 as pb


def streaming_finals(args: tuple[str, ...]) -> tuple[str, ...]:
    """``args`` with ``--final-model off`` unless they name a final model: the tests of everything but the
    second pass pin the streaming model's finals (and start no Whisper worker); tests/test_second_pass.py and
    the docs' server run it."""
    return args if any(a.startswith("--final-model") for a in args) else ("--final-model", "off", *args)


BACKGROUND_COMPILE_OFF = ("--no-background-compile",)
"""What the tests' servers run with unless a test asks for the background compiler (``Served(...,
background_compile=True)``): one compiling into the tests' shared cache would change, mid-run, what the later
servers' engines load from it, and take the cores' idle time the tests' timing leaves."""


def serve_argv(*args: str) -> list[str]:
    """``cosystream serve`` on free ports (gRPC and metrics: any; HTTP: off), as a command line."""
    return [
        sys.executable,
        "-m",
        "cosystream",
        "serve",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        *BACKGROUND_COMPILE_OFF,
        *streaming_finals(args),
    ]


@contextmanager
def local_server(
    max_sessions: int = 8, max_message_bytes: int = 16 << 20, idle_timeout_s: float = 3.0, **process_kwargs
) -> Iterator[LocalServer]:
    """``process_kwargs``: ``decoder=DecoderConfig(...)``, the models (``model_path=DIR``, or ``models=[...]``,
    the first the default: see ``LocalServer``) and more ``EngineProcessConfig`` fields."""
    frontend = FrontendConfig(
        host="127.0.0.1",
        port=0,
        max_message_bytes=max_message_bytes,
        stream=StreamOptions(idle_timeout_s=idle_timeout_s),
    )
    engine = EngineConfig(max_sessions=max_sessions, max_batch=max_sessions)
    with LocalServer(frontend_config=frontend, engine=engine, **process_kwargs) as server:
        yield server


@contextmanager
def local_server_with(
    max_sessions: int = 8, idle_timeout_s: float = 3.0, **frontend_fields
) -> Iterator[LocalServer]:
    """As :func:`local_server`, with more ``FrontendConfig`` fields (``tls=TlsConfig(...)``,
    ``auth_tokens=PATH``)."""
    frontend = FrontendConfig(
        host="127.0.0.1", port=0, stream=StreamOptions(idle_timeout_s=idle_timeout_s), **frontend_fields
    )
    engine = EngineConfig(max_sessions=max_sessions, max_batch=max_sessions)
    with LocalServer(frontend_config=frontend, engine=engine) as server:
        yield server


class HeldStream:
    """A stream that stays open until released (or cancelled)."""

    def __init__(self, stub, priority=pb.REALTIME, model: str = ""):
        self.release = threading.Event()
        self.first = pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=priority, model=model)
        )
        self.call = stub.StreamingRecognize(self._requests(), timeout=60)
        self.collected: list = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._collect)
        self.thread.start()

    def _requests(self):
        yield self.first
        while not self.release.wait(0.05):
            yield pb.StreamingRecognizeRequest(audio=b"\0" * 320)

    def _collect(self):
        try:
            self.collected = list(self.call)
        except grpc.RpcError as err:
            self.error = err

    def close(self):
        self.release.set()
        self.thread.join(30)


class Served:
    """``cosystream serve`` in a subprocess, as users run it: ``with Served("--frontends", "2") as s:``.

    ``s.address``, ``s.metrics_url``, ``s.http_url``, ``s.log`` (every line so far), ``s.pids()`` (process name -> pid:
    cs-supervisor, cs-engine, cs-frontend-N), ``s.stub()``, ``s.health()``, ``s.info()``."""

    def __init__(
        self,
        *args: str,
        start_timeout_s: float = 90.0,
        background_compile: bool = False,
        prefix: tuple[str, ...] = (),
    ):
        """``prefix``: a command that runs the server's command line (its arguments), e.g. in a namespace."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.metrics_port = s.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.http_port = s.getsockname()[1]  # (unless the args give --http-port)
        self.args = args if background_compile else (*BACKGROUND_COMPILE_OFF, *args)
        self.start_timeout_s = start_timeout_s
        self.prefix = prefix
        self.log: list[str] = []
        self.port = 0
        self._channel = None

    def __enter__(self) -> Served:
        import re
        import subprocess
        import sys
        import time

        self.process = subprocess.Popen(
            [
                *self.prefix,
                sys.executable,
                "-m",
                "cosystream",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--metrics-port",
                str(self.metrics_port),
                "--http-port",
                str(self.http_port),
                *streaming_finals(self.args),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while not self.port and time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.log.append(line)
            if m := re.search(r"serving on port (\d+) with", line):
                self.port = int(m.group(1))
        if not self.port:
            self.process.kill()
            raise AssertionError("server did not start:\n" + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._channel is not None:
            self._channel.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def pids(self) -> dict[str, int]:
        """Live processes of this server by name (zombies excluded)."""
        import os

        found = {}
        for pid in [self.process.pid, *_descendants(self.process.pid)]:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
            if state != "Z" and os.path.exists(f"/proc/{pid}"):
                found[name] = pid
        return found

    def stub(self):
        from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return pb_grpc.CosyStreamStub(self._channel)

    def health(self, timeout_s: float = 5.0) -> int | None:
        """The health status of ``cosystream.v1.CosyStream`` on a fresh connection (None: no answer)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            try:
                return (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(service="cosystream.v1.CosyStream"), timeout=timeout_s)
                    .status
                )
            except grpc.RpcError:
                return None

    def info(self, timeout_s: float = 10.0) -> pb.ServerInfo:
        return self.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout_s)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus metric's samples: those with ``labels`` (none given: all of them)."""
        import re
        import urllib.request

        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        total = 0.0
        for found, value in re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
            have = dict(re.findall(r'(\w+)="([^"]*)"', found))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(value)
        return total

    def wait(self, predicate, timeout_s: float, what: str):
        """Poll ``predicate()`` until it is truthy; its value, or an AssertionError naming ``what``."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            time.sleep(0.05)
        raise AssertionError(f"{what} within {timeout_s} s\n" + "".join(self.log[-40:]))


def _descendants(root: int) -> list[int]:
    from benchmarks._harness import _children

    children = _children()
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


class WebhookServer(http.server.ThreadingHTTPServer):
    """Collects the JSON bodies POSTed to ``url`` (a webhook's receiver); serve_forever in a thread."""

    def __init__(self):
        self.received: list[dict] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):
                body = handler.rfile.read(int(handler.headers["Content-Length"]))
                self.received.append(json.loads(body))
                handler.send_response(204)
                handler.end_headers()

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/results"


class CuttingProxy:
    """A TCP proxy on loopback whose ``cut()`` resets every connection it carries (SO_LINGER 0: an RST, as a
    network that drops a connection leaves it), while it goes on accepting new ones; ``cut(outage_s)`` also
    resets the new ones for that long (a network that stays down)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._down_until = 0.0  # (time.monotonic())
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if time.monotonic() < self._down_until:
                self._reset(client)
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def cut(self, outage_s: float = 0.0) -> None:
        self._down_until = time.monotonic() + outage_s
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            self._reset(sock)

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)  # (wakes the thread reading it: the close below then takes effect)
        sock.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # (wakes accept(): nothing listens on the port any more)
        self.listener.close()
        self.cut()
