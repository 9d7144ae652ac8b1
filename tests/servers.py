"""A whole server for a test module: the engine in a subprocess, a frontend on a background thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cosystream.engine.core import EngineConfig
from cosystream.server.frontend import FrontendConfig
from cosystream.server.local import LocalServer
from cosystream.server.servicer import StreamOptions


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
