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
import time
from multiprocessing.connection import Client, Connection
from typing import Protocol

import numpy as np

from cosystream.engine import ipc
from cosystream.engine.scheduler import Priority

log = logging.getLogger(__name__)


class SessionSink(Protocol):
    def on_opened(self) -> None: ...

    def on_refused(self, message: str, shed: bool) -> None: ...

    def on_results(self, ids: np.ndarray, logprobs: np.ndarray, queue_s: float, compute_s: float) -> None: ...

    def on_engine_lost(self) -> None: ...


class EngineClient:
    def __init__(self, address: str, authkey: bytes):
        self.address = address
        self.authkey = authkey
        self.info: dict = {}
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[int, SessionSink] = {}
        self._engine_sessions = 0
        self._next_key = 0
        self._pending = ipc.ToEngine()
        self._flush_scheduled = False
        self._outgoing: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self.connected = False

    async def connect(self, timeout_s: float = 120.0) -> dict:
        """Connect and wait for the engine's HELLO (sent once it is warm); returns its info."""
        self._loop = asyncio.get_running_loop()
        self._conn = await asyncio.wait_for(
            self._loop.run_in_executor(None, self._connect_blocking), timeout=timeout_s
        )
        self._loop.add_reader(self._conn.fileno(), self._on_readable)
        self._sender = threading.Thread(
            target=self._send_loop, args=(self._conn,), daemon=True, name="engine-send"
        )
        self._sender.start()
        self.connected = True
        return self.info

    def _connect_blocking(self, retry_s: float = 0.05) -> Connection:
        # The engine listens only once it is warm; until then the socket is missing or refuses.
        while True:
            try:
                conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(retry_s)
        events = conn.recv()[0]
        kind, info = events[0]
        if kind != ipc.HELLO:
            raise RuntimeError(f"engine sent {kind} before HELLO")
        self.info = info
        return conn

    def close_connection(self) -> None:
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

    # --- session calls ---------------------------------------------------------------------------

    def new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def open(self, key: int, priority: Priority, sink: SessionSink) -> None:
        self._sinks[key] = sink
        self._pending.ops.append((ipc.OPEN, key, int(priority)))
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

    def _send_loop(self, conn: Connection) -> None:
        """The sender thread: messages in order; a failed send hands the loss to the event loop."""
        while (message := self._outgoing.get()) is not None:
            try:
                conn.send(message)
            except OSError:
                log.exception("engine connection lost while sending")
                self._loop.call_soon_threadsafe(self._lost)
                return

    def _on_readable(self) -> None:
        try:
            events, keys, ids, logprobs, queue_s, compute_s = self._conn.recv()
        except (EOFError, OSError):
            log.error("engine connection closed")
            self._lost()
            return
        for event in events:
            if event[0] == ipc.ACTIVE:
                self._engine_sessions = event[1]
                continue
            sink = self._sinks.get(event[1])
            if sink is None:
                continue
            if event[0] == ipc.OPENED:
                sink.on_opened()
            elif event[0] in (ipc.REJECTED, ipc.SHED):
                self._sinks.pop(event[1], None)
                sink.on_refused(event[2], shed=event[0] == ipc.SHED)
        for key, row_ids, row_logprobs, q, c in zip(keys, ids, logprobs, queue_s, compute_s, strict=True):
            sink = self._sinks.get(key)
            if sink is not None:
                sink.on_results(row_ids, row_logprobs, q, c)

    def _lost(self) -> None:
        sinks, self._sinks = self._sinks, {}
        self._engine_sessions = 0
        self.close_connection()
        for sink in sinks.values():
            sink.on_engine_lost()
