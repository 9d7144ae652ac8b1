"""A whole server for a test module (the engine in a subprocess, a frontend on a background thread), and a
client stream that holds a session open."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from cosystream.engine.core import EngineConfig
from cosystream.server.frontend import FrontendConfig
from cosystream.server.local import LocalServer
from cosystream.server.servicer import StreamOptions
from cosystream.v1 import cosystream_pb2 as pb


@contextmanager
def local_server(
    max_sessions: int = 8, max_message_bytes: int = 16 << 20, idle_timeout_s: float = 3.0, **process_kwargs
) -> Iterator[LocalServer]:
    """``process_kwargs``: more ``EngineProcessConfig`` fields (``decoder=DecoderConfig(...)``...)."""
    frontend = FrontendConfig(
        host="127.0.0.1",
        port=0,
        max_message_bytes=max_message_bytes,
        stream=StreamOptions(idle_timeout_s=idle_timeout_s),
    )
    engine = EngineConfig(max_sessions=max_sessions, max_batch=max_sessions)
    with LocalServer(frontend_config=frontend, engine=engine, **process_kwargs) as server:
        yield server


class HeldStream:
    """A stream that stays open until released (or cancelled)."""

    def __init__(self, stub, priority=pb.REALTIME):
        self.release = threading.Event()
        self.first = pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=priority)
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
