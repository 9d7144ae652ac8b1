"""Starting the engine process, from a process that never imports torch: ``serve``'s supervisor.

The spawn, and the pipe on which the engine says it is ready (or why it could not start). The spawned child
imports ``engine/process.py`` (and torch); this module imports neither, so the supervisor stays as small as
a frontend without its decoder.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from cosystream.engine.config import EngineProcessConfig


class EngineStartError(RuntimeError):
    """The engine process could not start; the message says why, in one line."""


@dataclass(slots=True)
class EngineHandle:
    """A spawned engine process and the pipe on which it reports ``ready``, or why it failed."""

    process: mp.Process
    status: Connection

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the engine is ready; False if it is still starting after ``timeout_s``. Raises
        :class:`EngineStartError` if it failed or died first."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.status.poll(min(0.1, max(0.0, deadline - time.monotonic()))):
                try:
                    kind, detail = self.status.recv()
                except (EOFError, OSError):
                    kind, detail = "failed", None
                if kind == "ready":
                    return True
                self.process.join(5)
                raise EngineStartError(detail or f"the engine process exited (exit code {self.process.exitcode})")
            if not self.process.is_alive():
                raise EngineStartError(
                    f"the engine process exited during start-up (exit code {self.process.exitcode})"
                )
            if time.monotonic() >= deadline:
                return False


def start_engine(config: EngineProcessConfig) -> EngineHandle:
    """Spawn the engine process; frontends then connect to ``config.address`` (once it says ``ready``)."""
    context = mp.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    name = "cosystream-engine" if config.index is None else f"cosystream-engine-{config.index}"  # (log lines)
    process = context.Process(target=_engine_main, args=(config, writer), name=name)
    process.start()
    writer.close()
    return EngineHandle(process, reader)


def _engine_main(config: EngineProcessConfig, status: Connection) -> None:
    """The spawned child's target: the engine's module (and torch) is imported there, not here."""
    from cosystream.engine.process import engine_main

    engine_main(config, status)
