"""The engine's end of the frontends' connections (``multiprocessing.connection`` on a Unix socket).

Connections are accepted in a thread and greeted in the loop; each frontend sends one message per tick of
its own and gets one per engine tick (``ipc``); a frontend that goes away has its sessions freed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from multiprocessing.connection import Connection, Listener, wait

from cosystream.engine import ipc
from cosystream.engine.core import EngineCore
from cosystream.engine.model_swap import ModelLoader

log = logging.getLogger(__name__)


class FrontendConnections:
    """The frontends' connections, by the id the core knows each by: accepted in a thread, greeted in the
    loop; read when ready, one message out per tick; a lost one's sessions freed."""

    def __init__(self, core: EngineCore, listener: Listener, stop: threading.Event, loader: ModelLoader):
        self.core = core
        self.loader = loader
        self.ids: dict[Connection, int] = {}
        self._next_id = 0
        self._incoming: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        threading.Thread(target=_accept, args=(listener, self._incoming, stop), daemon=True, name="accept").start()

    def accept(self, info: ipc.EngineInfo) -> bool:
        """Send every frontend connected since the last call its ``Hello``; True if there was one."""
        accepted = False
        while not self._incoming.empty():
            conn = self._incoming.get()
            try:
                conn.send_bytes(ipc.ToFrontend(events=[ipc.Hello(info)]).pack())
            except OSError as err:  # (it went away before its greeting: nothing of it to free)
                log.warning("a frontend left before the engine greeted it: %s", err)
                conn.close()
                continue
            self.ids[conn] = self._next_id
            self._next_id += 1
            accepted = True
        return accepted

    def receive(self, idle_s: float) -> float:
        """Hand the core every message that arrived, waiting for one while no step is due (at most
        ``idle_s``; with no frontend, ``idle_s``); returns the seconds waited."""
        waiting_since = time.perf_counter()
        ready = wait(list(self.ids), timeout=self.core.wait_s(idle_s)) if self.ids else []
        if not self.ids:
            time.sleep(idle_s)
        waited_s = time.perf_counter() - waiting_since
        for conn in ready:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                self._lost(conn)
                continue
            self.core.handle(self.ids[conn], message)
        return waited_s

    def send(self, boxes: dict[int, ipc.ToFrontend]) -> None:
        """Each frontend's message of this tick."""
        if not boxes:
            return
        by_id = {frontend: conn for conn, frontend in self.ids.items()}
        for frontend, box in boxes.items():
            conn = by_id.get(frontend)
            if conn is not None:
                try:
                    conn.send_bytes(box.pack())
                except OSError:
                    self._lost(conn)

    def _lost(self, conn: Connection) -> None:
        frontend = self.ids.pop(conn)
        self.core.disconnect(frontend)
        self.loader.forget(frontend)
        conn.close()

    def close(self) -> None:
        for conn in self.ids:
            conn.close()


def _accept(listener: Listener, incoming: queue.SimpleQueue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            incoming.put(listener.accept())
        except OSError:
            return
        except Exception:
            log.exception("a frontend failed to connect")
