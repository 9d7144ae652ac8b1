"""A frontend's end of the engine channel, on the frontend's asyncio loop.

Sessions call ``open``/``send_frames``/``reset``/``close``; everything called during one event-loop
iteration goes to the engine as one message (the flush is scheduled with ``call_soon``). A sender thread
writes the messages: while the engine is in a long step its socket buffer can fill, and a blocking send on
the event loop would stall every stream of this frontend. Messages from the engine are read when the
socket is readable and dispatched to the sessions by key.

Models loaded while serving: ``load_model``/``unload_model`` ask the engine and await its answer. Before a
loaded model serves, the engine asks every frontend to make ready to decode it (``on_prepare``); once it
serves, ``info`` is replaced (``on_models``) before any session is told it runs on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Client, Connection
from typing import Protocol, runtime_checkable

import numpy as np

from cosystream.engine import ipc
from cosystream.engine.headroom import LoadReport
from cosystream.priority import Priority

log = logging.getLogger(__name__)


class SessionSink(Protocol):
    def on_opened(self, model: int) -> None:
        """The session has a slot and runs on model id ``model``."""
        ...

    def on_moved(self, model: int) -> None:
        """From its next utterance (nothing of it has results yet) the session runs on model id ``model``."""
        ...

    def on_refused(self, message: str, shed: bool, retry_after_s: float | None = None) -> None:
        """No slot (``shed``: a BATCH session's taken for REALTIME ones); ``retry_after_s``: a refusal for load
        says when to retry."""
        ...

    def on_results(self, ids: np.ndarray, logprobs: np.ndarray, queue_s: float, compute_s: float) -> None: ...

    def on_engine_lost(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """What a frontend needs of an engine: :class:`EngineClient` (the engine process over its socket) and
    ``naive.NaiveEngine`` (the benchmarks' baseline, in the frontend's own process) both implement it."""

    info: ipc.EngineInfo | None  # the engine's ``Hello``, once connected
    connected: bool
    on_change: Callable[[], None] | None

    async def connect(self) -> ipc.EngineInfo: ...

    def close_connection(self) -> None: ...

    def mark_listening(self) -> None: ...

    @property
    def listening_frontends(self) -> int: ...

    @property
    def active_sessions(self) -> int: ...

    def loads(self) -> list[LoadReport | None]:
        """Each engine's last load report (one engine: one entry; None: none yet, or not connected)."""
        ...

    def new_key(self) -> int: ...

    def model_by_id(self, model: int) -> ipc.ModelInfo | None:
        """The model version ``model`` names (a ``ModelInfo.id`` sessions were told of), None if unknown."""
        ...

    def open(self, key: int, priority: Priority, sink: SessionSink, model: int = 0) -> None:
        """Open session ``key`` on model ``model`` (a ``ModelInfo.id`` of ``info.models``; 0, the default)."""
        ...

    async def load_model(self, name: str, path: str, precision: str = "") -> LoadResult:
        """Serve the model directory ``path`` as ``name`` at ``precision`` ("": the precision ``name`` is served
        at); raises :class:`ModelLoadError`."""
        ...

    async def unload_model(self, name: str) -> None:
        """Stop serving ``name``; raises :class:`ModelLoadError`."""
        ...

    def send_frames(self, key: int, frames: np.ndarray) -> None: ...

    def end_utterance(self, key: int) -> None:
        """The utterance has ended: the frames sent so far are all its final waits for (step them now)."""
        ...

    def reset(self, key: int) -> None: ...

    def close(self, key: int) -> None: ...


class ModelLoadError(Exception):
    """A load or unload the engine refused: ``failure`` (``ipc.LOAD_FAILED``, ``UNDECODABLE``, ``BUSY``, or
    ``"unload"``) and the message saying why."""

    def __init__(self, failure: str, message: str):
        super().__init__(message)
        self.failure = failure


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    model: ipc.ModelInfo
    load_s: float  # loading and warming it, beside the models served
    install_s: float  # what installing it cost the engine's loop


CONNECT_RETRY_S = 0.05
HELLO_TIMEOUT_S = 10.0


class EngineClient:
    """``connect()`` waits for the engine (it listens once warm). When the connection is lost (the engine
    died) every session is told, and the client connects again to the restarted engine at the same address
    (until ``close_connection``); ``on_change`` is called whenever ``connected`` or the counts change."""

    def __init__(self, address: str, authkey: bytes):
        self.address = address
        self.authkey = authkey
        self.info: ipc.EngineInfo | None = None  # from the engine's ``Hello``
        self.on_change: Callable[[], None] | None = None
        # Make ready to decode a model the engine loaded (before it serves): "" or why it cannot be decoded.
        self.on_prepare: Callable[[ipc.ModelInfo], Awaitable[str]] | None = None
        self.on_models: Callable[[ipc.EngineInfo], None] | None = None  # info changed (Models, a new Hello)
        self._requests: dict[int, asyncio.Future] = {}  # ``Load`` / ``Unload`` awaiting the engine's answer
        self._next_request = 0
        self._tasks: set[asyncio.Task] = set()
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[int, SessionSink] = {}
        self._engine_sessions = 0
        self._listening_frontends = 0
        self.load: LoadReport | None = None  # the engine's, as of its last ``Active``
        self._listening = False  # this frontend's port is open (re-announced on every connection)
        self._next_key = 0
        self._pending = ipc.ToEngine()
        self._flush_scheduled = False
        self._outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._reconnecting: asyncio.Task | None = None
        self._closing = False
        self.connected = False

    async def connect(self) -> ipc.EngineInfo:
        """Connect and wait for the engine's ``Hello``; returns its info. Retries while the socket is missing or
        refuses (the engine is still starting; the supervisor decides how long that may take); cancellable
        at any point, and nothing is left running."""
        self._loop = asyncio.get_running_loop()
        while True:
            try:
                conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, EOFError):
                await asyncio.sleep(CONNECT_RETRY_S)
        try:
            (hello, *_) = ipc.ToFrontend.unpack(await self._readable(conn, HELLO_TIMEOUT_S)).events
            if not isinstance(hello, ipc.Hello):
                raise RuntimeError(f"engine sent {type(hello).__name__} before Hello")
        except BaseException:
            conn.close()
            raise
        renewed = self.info is not None
        self.info = hello.info
        if renewed and self.on_models is not None:  # (a restarted engine: its models as it started them)
            self.on_models(self.info)
        self._conn = conn
        self._loop.add_reader(conn.fileno(), self._on_readable)
        self._outgoing = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=self._send_loop, args=(conn, self._outgoing), daemon=True, name="engine-send"
        )
        self._sender.start()
        self.connected = True
        if self._listening:
            self._announce_listening()
        self._changed()
        return self.info

    async def _readable(self, conn: Connection, timeout_s: float) -> bytes:
        """The next message on ``conn``, waiting on the event loop (not in a thread)."""
        ready = asyncio.Event()
        self._loop.add_reader(conn.fileno(), ready.set)
        try:
            await asyncio.wait_for(ready.wait(), timeout_s)
        finally:
            self._loop.remove_reader(conn.fileno())
        return conn.recv_bytes()

    def mark_listening(self) -> None:
        """This frontend's gRPC port is open: the engine counts it towards SERVING."""
        self._listening = True
        if self.connected:
            self._announce_listening()

    def _announce_listening(self) -> None:
        self._pending.ops.append(ipc.Listening())
        self._schedule_flush()

    def close_connection(self) -> None:
        """Close for good (no reconnect)."""
        self._closing = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
            self._reconnecting = None
        self._disconnect()

    def _disconnect(self) -> None:
        if self._sender is not None:
            self._outgoing.put(None)
            self._sender.join(timeout=2.0)
            self._sender = None
        if self._conn is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        self.connected = False

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @property
    def listening_frontends(self) -> int:
        """Frontends connected to the engine with their port open (as of its last message)."""
        return self._listening_frontends if self.connected else 0

    # --- session calls ---------------------------------------------------------------------------

    def new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def model_by_id(self, model: int) -> ipc.ModelInfo | None:
        return None if self.info is None else next((m for m in self.info.models if m.id == model), None)

    def open(self, key: int, priority: Priority, sink: SessionSink, model: int = 0) -> None:
        self._sinks[key] = sink
        self._pending.ops.append(ipc.Open(key, int(priority), model))
        self._schedule_flush()

    def send_frames(self, key: int, frames: np.ndarray) -> None:
        self._pending.add_frames(key, frames)
        self._schedule_flush()

    def end_utterance(self, key: int) -> None:
        self._pending.ops.append(ipc.End(key))
        self._schedule_flush()

    def reset(self, key: int) -> None:
        self._pending.ops.append(ipc.Reset(key))
        self._schedule_flush()

    def close(self, key: int) -> None:
        if self._sinks.pop(key, None) is not None:
            self._pending.ops.append(ipc.Close(key))
            self._schedule_flush()

    async def load_model(self, name: str, path: str, precision: str = "") -> LoadResult:
        loaded = await self._request(lambda request: ipc.Load(request, name, path, precision))
        if loaded.failure:
            raise ModelLoadError(loaded.failure, loaded.error)
        return LoadResult(loaded.model, loaded.load_s, loaded.install_s)

    async def unload_model(self, name: str) -> None:
        unloaded = await self._request(lambda request: ipc.Unload(request, name))
        if unloaded.error:
            raise ModelLoadError("unload", unloaded.error)

    async def _request(self, op: Callable[[int], ipc.Op]) -> ipc.Event:
        """Send ``op(request)`` and await the engine's answer, the ``Loaded`` or ``Unloaded`` naming it."""
        if not self.connected:
            raise ModelLoadError(ipc.BUSY, "the engine is restarting; retry in a moment")
        self._next_request += 1
        request = self._next_request
        future = self._loop.create_future()
        self._requests[request] = future
        try:
            self._pending.ops.append(op(request))
            self._schedule_flush()
            return await future
        finally:
            self._requests.pop(request, None)

    async def _prepare(self, request: int, model: ipc.ModelInfo) -> None:
        try:
            error = "" if self.on_prepare is None else await self.on_prepare(model)
        except Exception as err:  # (on_prepare says why itself; this is a bug's last resort)
            log.exception("preparing to decode model %s failed", model.name)
            error = str(err) or type(err).__name__
        if self.connected:
            self._pending.ops.append(ipc.Prepared(request, error))
            self._schedule_flush()

    def _answer(self, request: int, answer: ipc.Event) -> None:
        future = self._requests.get(request)
        if future is not None and not future.done():
            future.set_result(answer)

    @property
    def active_sessions(self) -> int:
        """Sessions holding an engine slot, from every frontend (as of the engine's last message)."""
        return self._engine_sessions

    def loads(self) -> list[LoadReport | None]:
        """The engine's load (None until its first load window, or while it is not connected)."""
        return [self.load if self.connected else None]

    # --- the channel -------------------------------------------------------------------------------

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending or self._conn is None:
            return
        message, self._pending = self._pending.pack(), ipc.ToEngine()
        self._outgoing.put(message)

    def _send_loop(self, conn: Connection, outgoing: queue.SimpleQueue) -> None:
        """The sender thread: messages in order; a failed send hands the loss to the event loop."""
        while (message := outgoing.get()) is not None:
            try:
                conn.send_bytes(message)
            except OSError as err:
                log.debug("engine connection lost while sending: %s", err)
                self._loop.call_soon_threadsafe(self._lost)
                return

    def _on_readable(self) -> None:
        try:
            box = ipc.ToFrontend.unpack(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._lost()
            return
        for event in box.events:
            match event:
                case ipc.Active():
                    self._engine_sessions, self._listening_frontends = event.sessions, event.listening
                    self.load = event.report
                    self._changed()
                case ipc.Opened() | ipc.Moved() | ipc.Rejected() | ipc.Shed():
                    self._session_event(event)
                case _:
                    self._model_event(event)
        sinks = self._sinks
        for step in box.steps:
            for row, key in enumerate(step.keys):
                sink = sinks.get(key)
                if sink is not None:
                    sink.on_results(step.ids[row], step.logprobs[row], step.queue_s[row], step.compute_s)

    def _session_event(self, event: ipc.Opened | ipc.Moved | ipc.Rejected | ipc.Shed) -> None:
        sink = self._sinks.get(event.key)
        if sink is None:
            return
        match event:
            case ipc.Opened():
                sink.on_opened(event.model)
            case ipc.Moved():
                sink.on_moved(event.model)
            case ipc.Rejected():
                del self._sinks[event.key]
                sink.on_refused(event.message, False, event.retry_after_s)
            case ipc.Shed():
                del self._sinks[event.key]
                sink.on_refused(event.message, True)

    def _model_event(self, event: ipc.Event) -> None:
        match event:
            case ipc.Models():
                self.info = dataclasses.replace(self.info, models=event.models, held_models=event.held)
                if self.on_models is not None:
                    self.on_models(self.info)
            case ipc.Prepare():
                task = self._loop.create_task(self._prepare(event.request, event.model))
                self._tasks.add(task)  # (the loop keeps only a weak reference)
                task.add_done_callback(self._tasks.discard)
            case ipc.Loaded() | ipc.Unloaded():
                self._answer(event.request, event)

    def _lost(self) -> None:
        if self._conn is None:
            return  # (the sender and the reader both saw it)
        for future in self._requests.values():
            if not future.done():
                future.set_exception(ModelLoadError(ipc.BUSY, "the engine process stopped; retry once it is back"))
        sinks, self._sinks = self._sinks, {}
        self._engine_sessions = self._listening_frontends = 0
        self._pending = ipc.ToEngine()
        self._disconnect()
        self._changed()
        for sink in sinks.values():
            sink.on_engine_lost()
        if not self._closing and self._reconnecting is None:
            self._reconnecting = self._loop.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        log.warning("engine connection lost (its sessions ended UNAVAILABLE); waiting for the engine to restart")
        try:
            await self.connect()
            log.info("engine connection restored")
        finally:
            self._reconnecting = None
