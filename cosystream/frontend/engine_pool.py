"""Several engine processes behind one frontend (``serve --engines N``, ``--device cuda:all``): one engine per
device, each with its own slots, slabs and captured graphs.

:class:`EnginePool` is an :class:`~cosystream.frontend.engine_client.Engine` over one
:class:`~cosystream.frontend.engine_client.EngineClient` per engine. A new session goes to the least-loaded
engine that is up and serves its model (the engine's own count of its sessions, from every frontend, plus
what this frontend placed there since that count came); every later call of the session follows it. An
engine that dies ends only its own sessions (UNAVAILABLE); the others go on, and new sessions go to them
until it is back. The server is SERVING while any engine is.

Model ids: each engine numbers its model versions itself, so the pool gives the frontend ids of its own,
``engine * ID_STRIDE + the engine's id``, and translates both ways (by name when a session opens on an engine
other than the one whose list the frontend read). ``info`` is the models list of the first engine up, with
the capacity of every engine up. A model loaded with the Admin service is loaded on every engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

import numpy as np

from cosystream.engine import ipc
from cosystream.engine.headroom import LoadReport
from cosystream.frontend.engine_client import EngineClient, LoadResult, ModelLoadError, SessionSink
from cosystream.priority import Priority

log = logging.getLogger(__name__)

ID_STRIDE = 1 << 20
"""Pool model id = engine index x ID_STRIDE + the engine's own id (an engine never numbers this many)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStatus:
    """One engine, as GetServerInfo shows it."""

    index: int
    device: str
    connected: bool
    active_sessions: int
    max_sessions: int


class _Routed:
    """A session's sink as one engine sees it: model ids turned into the pool's. It keeps what the open asked
    for, so that a full engine's refusal can be retried on another."""

    __slots__ = ("early", "engine", "key", "name", "pool", "priority", "sink", "tried")

    def __init__(self, pool: EnginePool, engine: int, sink: SessionSink, key: int, priority: Priority, name: str):
        self.pool, self.engine, self.sink = pool, engine, sink
        self.key, self.priority, self.name = key, priority, name
        self.tried = {engine}
        # Frames sent before the engine said ``Opened`` (a refusing engine drops them): sent again on a retry.
        self.early: list[np.ndarray] | None = []

    def on_opened(self, model: int) -> None:
        self.early = None
        self.sink.on_opened(self.engine * ID_STRIDE + model)

    def on_moved(self, model: int) -> None:
        self.sink.on_moved(self.engine * ID_STRIDE + model)

    def on_refused(self, message: str, shed: bool, retry_after_s: float | None = None) -> None:
        if not shed and self.pool._reopen(self):
            return
        self.pool._forget(self)
        self.sink.on_refused(message, shed, retry_after_s)

    def on_results(self, ids: np.ndarray, logprobs: np.ndarray, queue_s: float, compute_s: float) -> None:
        self.sink.on_results(ids, logprobs, queue_s, compute_s)

    def on_engine_lost(self) -> None:
        self.pool._forget(self)
        self.sink.on_engine_lost()


class EnginePool:
    def __init__(self, addresses: list[str], authkey: bytes):
        if len(addresses) < 2:
            raise ValueError("an engine pool has two engines or more (one: EngineClient)")
        self.clients = [EngineClient(address, authkey) for address in addresses]
        self.on_change: Callable[[], None] | None = None
        self.on_prepare: Callable[[ipc.ModelInfo], Awaitable[str]] | None = None
        self.on_models: Callable[[ipc.EngineInfo], None] | None = None
        self._placed = [0] * len(self.clients)  # opens sent to each engine since its last count came
        self._counted = [0] * len(self.clients)  # that count, as last seen
        self._up = [False] * len(self.clients)  # connected, as last seen
        self._route: dict[int, _Routed] = {}  # session key -> its engine's sink
        self._next_key = 0
        for index, client in enumerate(self.clients):
            client.on_change = lambda index=index: self._client_changed(index)
            client.on_prepare = lambda model, index=index: self._prepare(index, model)
            client.on_models = lambda _info: self._models_changed()

    # --- the Engine protocol ---------------------------------------------------------------------

    @property
    def info(self) -> ipc.EngineInfo | None:
        up = [(i, c) for i, c in enumerate(self.clients) if c.connected and c.info is not None]
        if not up:
            known = next(((i, c) for i, c in enumerate(self.clients) if c.info is not None), None)
            if known is None:
                return None
            up = [known]
        first, client = up[0]
        info = client.info
        return dataclasses.replace(
            info,
            models=tuple(dataclasses.replace(m, id=first * ID_STRIDE + m.id) for m in info.models),
            max_sessions=sum(c.info.max_sessions for _, c in up),
            device=", ".join(sorted({c.info.device for _, c in up})),
            held_models=max(c.info.held_models for _, c in up),
        )

    @property
    def connected(self) -> bool:
        return any(client.connected for client in self.clients)

    @property
    def listening_frontends(self) -> int:
        """Frontends listening, as the engines up count them (the fewest any counts)."""
        return min((c.listening_frontends for c in self.clients if c.connected), default=0)

    @property
    def active_sessions(self) -> int:
        return sum(client.active_sessions for client in self.clients)

    def loads(self) -> list[LoadReport | None]:
        """Each engine's load, in order (None: not connected, or no load window yet)."""
        return [load for client in self.clients for load in client.loads()]

    def engines(self) -> list[EngineStatus]:
        return [
            EngineStatus(
                index,
                client.info.device if client.info else "",
                client.connected,
                client.active_sessions,
                client.info.max_sessions if client.info else 0,
            )
            for index, client in enumerate(self.clients)
        ]

    async def connect(self) -> ipc.EngineInfo:
        """Connect to every engine (each waits for its ``Hello``; a restarted one is reconnected to by its
        client)."""
        await asyncio.gather(*(client.connect() for client in self.clients))
        return self.info

    def close_connection(self) -> None:
        for client in self.clients:
            client.close_connection()

    def mark_listening(self) -> None:
        for client in self.clients:
            client.mark_listening()

    def new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def model_by_id(self, model: int) -> ipc.ModelInfo | None:
        """The model (with the pool's id) a pool id names, on whichever engine numbered it."""
        engine, own = divmod(model, ID_STRIDE)
        if not 0 <= engine < len(self.clients) or self.clients[engine].info is None:
            return None
        found = next((m for m in self.clients[engine].info.models if m.id == own), None)
        return None if found is None else dataclasses.replace(found, id=model)

    def open(self, key: int, priority: Priority, sink: SessionSink, model: int = 0) -> None:
        wanted = self.model_by_id(model)
        name = wanted.name if wanted is not None else ""
        choice = self._least_loaded(name)
        if choice is None:
            sink.on_engine_lost() if not self.connected else sink.on_refused(
                f"no engine serves model {name!r}", shed=False
            )
            return
        index, own = choice
        routed = _Routed(self, index, sink, key, priority, name)
        self._route[key] = routed
        self._placed[index] += 1
        self.clients[index].open(key, priority, routed, own)

    def _reopen(self, routed: _Routed) -> bool:
        """An engine refused ``routed``'s open (full, as its count had not shown yet): open it on another
        engine not tried yet, if one is up and serves its model. False: none is left to try."""
        choice = self._least_loaded(routed.name, exclude=routed.tried)
        if choice is None or self._route.get(routed.key) is not routed:
            return False
        index, own = choice
        routed.engine = index
        routed.tried.add(index)
        self._placed[index] += 1
        client = self.clients[index]
        client.open(routed.key, routed.priority, routed, own)
        for frames in routed.early or ():
            client.send_frames(routed.key, frames)
        log.debug("session %d: engine full, opened on engine %d instead", routed.key, index)
        return True

    def _least_loaded(self, name: str, exclude: set[int] = frozenset()) -> tuple[int, int] | None:
        """The engine a new session of model ``name`` goes to, and that engine's id of the model."""
        best = None
        for index, client in enumerate(self.clients):
            if index in exclude or not client.connected or client.info is None:
                continue
            position = client.info.model_index(name)
            if position is None:
                continue
            load = (client.active_sessions + self._placed[index]) / max(1, client.info.max_sessions)
            if best is None or load < best[0]:
                best = (load, index, client.info.models[position].id)
        return None if best is None else (best[1], best[2])

    def send_frames(self, key: int, frames: np.ndarray) -> None:
        routed = self._route.get(key)
        if routed is not None:
            if routed.early is not None:
                routed.early.append(frames)
            self.clients[routed.engine].send_frames(key, frames)

    def end_utterance(self, key: int) -> None:
        routed = self._route.get(key)
        if routed is not None:
            self.clients[routed.engine].end_utterance(key)

    def reset(self, key: int) -> None:
        routed = self._route.get(key)
        if routed is not None:
            self.clients[routed.engine].reset(key)

    def close(self, key: int) -> None:
        routed = self._route.pop(key, None)
        if routed is not None:
            self.clients[routed.engine].close(key)

    async def load_model(self, name: str, path: str, precision: str = "") -> LoadResult:
        """Load on every engine up (at once); the first failure is the answer, naming its engine."""
        (first, result), *_ = await self._on_every_engine(lambda c: c.load_model(name, path, precision))
        return dataclasses.replace(
            result, model=dataclasses.replace(result.model, id=first * ID_STRIDE + result.model.id)
        )

    async def unload_model(self, name: str) -> None:
        await self._on_every_engine(lambda c: c.unload_model(name))

    async def _on_every_engine(self, call: Callable[[EngineClient], Awaitable]) -> list[tuple[int, object]]:
        """``call`` on every engine up, at once: ``(engine, answer)`` for each, or the first failure, as a
        ModelLoadError naming its engine."""
        up = [(i, c) for i, c in enumerate(self.clients) if c.connected]
        if not up:
            raise ModelLoadError(ipc.BUSY, "no engine is up; retry in a moment")
        outcomes = await asyncio.gather(*(call(c) for _, c in up), return_exceptions=True)
        for (index, _), outcome in zip(up, outcomes, strict=True):
            if isinstance(outcome, ModelLoadError):
                raise ModelLoadError(outcome.failure, f"engine {index}: {outcome}")
            if isinstance(outcome, BaseException):
                raise outcome
        return [(index, outcome) for (index, _), outcome in zip(up, outcomes, strict=True)]

    # --- the engines' news ---------------------------------------------------------------------------

    def _forget(self, routed: _Routed) -> None:
        if self._route.get(routed.key) is routed:
            del self._route[routed.key]

    def _client_changed(self, index: int) -> None:
        client = self.clients[index]
        if client.active_sessions != self._counted[index] or not client.connected:
            self._counted[index] = client.active_sessions
            self._placed[index] = 0  # (the engine's count now includes what was placed before it)
        if client.connected != self._up[index]:
            self._up[index] = client.connected
            if not client.connected:  # its sessions were told (on_engine_lost); forget their routes
                for key in [k for k, r in self._route.items() if r.engine == index]:
                    del self._route[key]
            self._models_changed()  # (the first engine up, whose list ``info`` is, may be another now)
        if self.on_change is not None:
            self.on_change()

    async def _prepare(self, index: int, model: ipc.ModelInfo) -> str:
        if self.on_prepare is None:
            return ""
        return await self.on_prepare(dataclasses.replace(model, id=index * ID_STRIDE + model.id))

    def _models_changed(self) -> None:
        info = self.info
        if info is not None and self.on_models is not None:
            self.on_models(info)
