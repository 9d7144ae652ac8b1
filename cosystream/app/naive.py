"""The naive baseline for benchmarks: no engine process, no batching, no scheduler.

Each chunk's frames go through the model as they arrive, one session at a time, on the frontend's own
event loop (``cosystream serve --naive``). Same sessions, VAD and decoding as the real server, so the
capacity benchmark's ratio measures what the engine design buys.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

from cosystream.engine.ipc import LOAD_FAILED, EngineInfo, ModelInfo
from cosystream.engine.process import model_info, server_info
from cosystream.frontend.engine_client import ModelLoadError, SessionSink
from cosystream.models import ModelSource, load_model
from cosystream.priority import Priority
from cosystream.runtime.settings import GraphMode


class NaiveEngine:
    """Implements ``engine_client.Engine`` (what the servicer and sessions use), stepping the model inline."""

    def __init__(self, source: ModelSource | None, max_sessions: int, top_k: int = 1):
        """``source``: the one model it serves (None: the embedded one)."""
        torch.set_num_threads(1)
        self.model = load_model(None if source is None else source.path)
        self.max_sessions = max_sessions
        self.top_k = min(top_k, len(self.model.vocabulary))
        info = model_info(self.model, source)
        self.info = server_info(self.model, torch.device("cpu"), max_sessions, GraphMode.EAGER, self.top_k, [info])
        self.connected = False
        self.on_change = None
        self._listening = 0
        self._sinks: dict[int, SessionSink] = {}
        self._caches: dict[int, list[torch.Tensor]] = {}
        self._next_key = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def connect(self) -> EngineInfo:
        self._loop = asyncio.get_running_loop()
        self.connected = True
        return self.info

    def close_connection(self) -> None:
        self.connected = False

    @property
    def listening_frontends(self) -> int:
        return self._listening

    def mark_listening(self) -> None:
        self._listening = 1
        if self.on_change is not None:
            self.on_change()

    def model_by_id(self, model: int) -> ModelInfo | None:
        return next((m for m in self.info.models if m.id == model), None)

    def new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    @property
    def active_sessions(self) -> int:
        return len(self._sinks)

    def loads(self) -> list:
        return [None]  # (no load windows: every session is admitted)

    def open(self, key: int, priority: Priority, sink: SessionSink, model: int = 0) -> None:
        if model != 0:  # (the servicer only names models its HELLO listed: one here)
            self._loop.call_soon(sink.on_refused, f"no model {model} in this engine", False)
            return
        if len(self._sinks) >= self.max_sessions:
            self._loop.call_soon(sink.on_refused, f"all {self.max_sessions} session slots are in use", False)
            return
        self._sinks[key] = sink
        self._caches[key] = self.model.init_caches(1)
        self._loop.call_soon(sink.on_opened, 0)

    async def load_model(self, name: str, path: str, precision: str = ""):
        raise ModelLoadError(LOAD_FAILED, "the naive baseline serves one model: it cannot load another")

    async def unload_model(self, name: str) -> None:
        raise ModelLoadError("unload", "the naive baseline serves one model: it cannot unload it")

    def send_frames(self, key: int, frames: np.ndarray) -> None:
        sink = self._sinks.get(key)
        if sink is None:
            return
        started = time.perf_counter()
        with torch.inference_mode():
            logits, self._caches[key] = self.model.step(torch.from_numpy(frames.reshape(1, -1)), self._caches[key])
            best, ids = torch.log_softmax(logits[0], -1).topk(self.top_k, dim=-1)
        compute_s = time.perf_counter() - started
        self._loop.call_soon(sink.on_results, ids.numpy(), best.numpy(), 0.0, compute_s)

    def end_utterance(self, key: int) -> None:
        pass  # every frame is stepped as it is sent

    def reset(self, key: int) -> None:
        if key in self._caches:
            self._caches[key] = self.model.init_caches(1)

    def close(self, key: int) -> None:
        self._sinks.pop(key, None)
        self._caches.pop(key, None)
