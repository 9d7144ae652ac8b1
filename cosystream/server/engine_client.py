"""A frontend's end of the engine channel, on the frontend's asyncio loop.

Sessions call ``open``/``send_frames``/``reset``/``close``; everything called during one event-loop
iteration goes to the engine as one message (the flush is scheduled with ``call_soon``). A sender thread
writes the messages: while the engine is in a long step its socket buffer can fill, and a blocking send on
the event loop would stall every stream of this frontend. Messages from the engine are read when the
socket is readable and dispatched to the sessions by key.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
from typing import Protocol, runtime_checkable

import numpy as np

from cosystream.engine import ipc
from cosystream.engine.scheduler import Priority

log = logging.getLogger(__name__)


class SessionSink(Protocol):
    def on_opened(self) -> None: ...

    def on_refused(self, message: str, shed: bool) -> None: ...

    def on_results(self, ids: np.ndarray, logprobs: np.ndarray, queue_s: float, compute_s: float) -> None: ...

    def on_engine_lost(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """What a frontend needs of an engine: :class:`EngineClient` (the engine process over its socket) and
    ``naive.NaiveEngine`` (the benchmarks' baseline, in the frontend's own process) both implement it."""

    info: ipc.EngineInfo | None  # the engine's HELLO, once connected
    connected: bool
    on_change: Callable[[], None] | None

    async def connect(self) -> ipc.EngineInfo: ...

    def close_connection(self) -> None: ...

    def mark_listening(self) -> None: ...

    @property
    def listening_frontends(self) -> int: ...

    @property
    def active_sessions(self) -> int: ...

    def new_key(self) -> int: ...

    def open(self, key: int, priority: Priority, sink: SessionSink, model: int = 0) -> None:
        """Open session ``key`` on model ``model`` (an index into ``info.models``; 0, the default)."""
        ...

    def send_frames(self, key: int, frames: np.ndarray) -> None: ...

    def reset(self, key: int) -> None: ...

    def close(self, key: int) -> None: ...


CONNECT_RETRY_S = 0.05
HELLO_TIMEOUT_S = 10.0


class EngineClient:
    """``connect()`` waits for the engine (it listens once warm). When the connection is lost (the engine
    died) every session is told, and the client connects again to the restarted engine at the same address
    (until ``close_connection``); ``on_change`` is called whenever ``connected`` or the counts change."""

    def __init__(self, address: str, authkey: bytes):
        self.address = address
        self.authkey = authkey
        self.info: ipc.EngineInfo | None = None  # from the engine's HELLO
        self.on_change: Callable[[], None] | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[int, SessionSink] = {}
        self._engine_sessions = 0
        self._listening_frontends = 0
        self._listening = False  # this frontend's port is open (re-announced on every connection)
        self._next_key = 0
        self._pending = ipc.ToEngine()
        self._flush_scheduled = False
        self._outgoing: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._reconnecting: asyncio.Task | None = None
        self._closing = False
        self.connected = False

    async def connect(self) -> ipc.EngineInfo:
        """Connect and wait for the engine's HELLO; returns its info. Retries while the socket is missing or
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
            hello = ipc.ToFrontend.unpack(await self._readable(conn, HELLO_TIMEOUT_S))
            kind, info = hello.events[0]
            if kind != ipc.HELLO:
                raise RuntimeError(f"engine sent {kind} before HELLO")
        except BaseException:
            conn.close()
            raise
        self.info = info
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

    async def _readable(self, conn: Connection, timeout_s: float):
        """The next message on ``conn``, waiting on the event loop (not in a thread)."""
        ready = asyncio.Event()
        self._loop.add_reader(conn.fileno(), ready.set)
        try:
            await asyncio.wait_for(ready.wait(), timeout_s)
        finally:
            self._loop.remove_reader(conn.fileno())
        return conn.recv()

    def mark_listening(self) -> None:
        """This frontend's gRPC port is open: the engine counts it towards SERVING."""
        self._listening = True
        if self.connected:
            self._announce_listening()

    def _announce_listening(self) -> None:
        self._pending.ops.append((ipc.LISTENING, 0))
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

    def open(self, key: int, priority: Priority, sink: SessionSink, model: int = 0) -> None:
        self._sinks[key] = sink
        self._pending.ops.append((ipc.OPEN, key, int(priority), model))
        self._schedule_flush()

    def send_frames(self, key: int, frames: np.ndarray) -> None:
        self._pending.add_frames(key, frames)
        self._schedule_flush()

    def reset(self, key: int) -> None:
        self._pending.ops.append((ipc.RESET, key))
        self._schedule_flush()

    def close(self, key: int) -> None:
        if self._sinks.pop(key, None) is not None:
            self._pending.ops.append((ipc.CLOSE, key))
            self._schedule_flush()

    @property
    def active_sessions(self) -> int:
        """Sessions holding an engine slot, from every frontend (as of the engine's last message)."""
        return self._engine_sessions

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
                conn.send(message)
            except OSError as err:
                log.debug("engine connection lost while sending: %s", err)
                self._loop.call_soon_threadsafe(self._lost)
                return

    def _on_readable(self) -> None:
        try:
            box = ipc.ToFrontend.unpack(self._conn.recv())
        except (EOFError, OSError):
            self._lost()
            return
        for event in box.events:
            if event[0] == ipc.ACTIVE:
                self._engine_sessions, self._listening_frontends = event[1], event[2]
                self._changed()
                continue
            sink = self._sinks.get(event[1])
            if sink is None:
                continue
            if event[0] == ipc.OPENED:
                sink.on_opened()
            elif event[0] in (ipc.REJECTED, ipc.SHED):
                self._sinks.pop(event[1], None)
                sink.on_refused(event[2], shed=event[0] == ipc.SHED)
        for key, row_ids, row_logprobs, q, c in zip(
            box.keys, box.ids, box.logprobs, box.queue_s, box.compute_s, strict=True
        ):
            sink = self._sinks.get(key)
            if sink is not None:
                sink.on_results(row_ids, row_logprobs, q, c)

    def _lost(self) -> None:
        if self._conn is None:
            return  # (the sender and the reader both saw it)
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
