"""A whole server on this machine, for ``cosystream transcribe`` without ``--server`` and for tests:
the engine in its own process, one frontend on an asyncio loop in a background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from cosystream.decoding.config import DecoderConfig
from cosystream.engine.config import EngineConfig, EngineProcessConfig
from cosystream.engine.launch import EngineHandle, start_engine
from cosystream.model_files import model_sources
from cosystream.server.frontend import Frontend, FrontendConfig


class LocalServer:
    def __init__(
        self,
        frontend_config: FrontendConfig | None = None,
        decoder: DecoderConfig | None = None,
        model_path: str | None = None,
        models: Sequence[str | os.PathLike | tuple[str | None, str | None] | None] = (),
        **engine_kwargs,
    ):
        """``engine_kwargs`` are more ``EngineProcessConfig`` fields (``engine=EngineConfig(...)``...).
        ``models``: the models to serve, the first the default, each a directory or a ``(name, directory)``
        pair (a None name: the model's own; a None directory: the embedded model); ``model_path``: one model
        directory; neither: the embedded model. ``decoder`` (default ``auto``) is resolved against each model;
        the engine sends the most candidates per frame any of them reads."""
        self._tmp = tempfile.TemporaryDirectory(prefix="cosystream-")
        engine_kwargs.setdefault("log_level", logging.getLevelName(logging.getLogger().getEffectiveLevel()))
        if model_path is not None:
            models = (model_path, *models)
        sources = model_sources(
            m if isinstance(m, tuple) else (None, None if m is None else str(m)) for m in models
        )
        decoder = decoder or DecoderConfig()
        decoders = tuple((source.name, decoder.resolve(source.path)) for source in sources)
        top_k = max(resolved.top_k for _, resolved in decoders)
        engine = dataclasses.replace(engine_kwargs.pop("engine", EngineConfig()), top_k=top_k)
        process_config = EngineProcessConfig(
            address=str(Path(self._tmp.name) / "engine.sock"),
            authkey=os.urandom(16),
            engine=engine,
            models=sources,
            **engine_kwargs,
        )
        self.process_config = process_config
        frontend_config = frontend_config or FrontendConfig(host="127.0.0.1", port=0)
        stream = dataclasses.replace(frontend_config.stream, decoder=decoders[0][1], decoders=decoders)
        self.frontend_config = dataclasses.replace(frontend_config, stream=stream)
        self.engine: EngineHandle | None = None
        self.frontend: Frontend | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="frontend-loop")
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> LocalServer:
        try:
            self.engine = start_engine(self.process_config)
            self.engine.wait_ready(timeout_s)  # raises EngineStartError with the reason
            self._thread.start()
            self.frontend = Frontend(
                self.frontend_config, self.process_config.address, self.process_config.authkey
            )
            self.port = self.call(self.frontend.start(), timeout_s)
            self.call(self.frontend.wait_serving(timeout_s), timeout_s + 1)
        except BaseException:
            self.stop()
            raise
        return self

    def call(self, coroutine, timeout_s: float = 30.0):
        """Run a coroutine on the frontend's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        if self.frontend is not None:
            with contextlib.suppress(Exception):
                self.call(self.frontend.stop(grace_s=0.5))
        if self.engine is not None:
            process = self.engine.process
            process.terminate()
            process.join(10)
            if process.is_alive():
                process.kill()
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        self._tmp.cleanup()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
