"""How far behind a frontend's event loop runs: admission's second signal, beside the engine's load.

On a CPU host the frontends can fall behind before the engine does (each costs ~10 ms of CPU per second of
audio per stream, and they share the cores): their chunks then wait in the event loop, and every result is
late by that wait, though the engine's own loop has time to spare. :class:`LoopLag` sleeps
:data:`PROBE_S` at a time and records how late each wake-up is; while the median of the last
:data:`WINDOW_S` passes ``--admit-lag-ms``, the frontend refuses new REALTIME sessions (RESOURCE_EXHAUSTED
with a RetryInfo; another frontend, or another server, may take the retry). The median, so that one long
callback (a collection, a large message) does not close the door.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque

ADMIT_LAG_S = 0.0
"""Median lateness of the frontend's event loop past which new REALTIME sessions are refused
(``serve --admit-lag-ms``); 0, the default: not refused for it, only reported (``LoadStatus.frontend_lag_ms``).
Off by default until a measurement shows it refusing what the engine's load does not: in
``benchmarks/overload.py`` at 100 streams on 2 cores, results came seconds late with neither the engine's
load nor the frontend's loop behind (the probe shares the cores)."""
PROBE_S = 0.05
WINDOW_S = 2.0


class LoopLag:
    """The running loop's lateness, sampled every :data:`PROBE_S` once :meth:`start` is called on it."""

    def __init__(self) -> None:
        self._late: deque[tuple[float, float]] = deque()  # (when, how late), the last WINDOW_S
        self._task: asyncio.Task | None = None
        self._since = 0.0  # when sampling started

    def start(self) -> None:
        """Start sampling on the running loop (again after a stop; idempotent)."""
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._late.clear()
            self._since = loop.time()
            self._task = loop.create_task(self._sample(), name="loop-lag")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asleep = loop.time()
            await asyncio.sleep(PROBE_S)
            now = loop.time()
            self._late.append((now, max(0.0, now - asleep - PROBE_S)))
            while self._late[0][0] < now - WINDOW_S:
                self._late.popleft()

    @property
    def median_s(self) -> float:
        """The median lateness over the last :data:`WINDOW_S` (0 before a whole window has been sampled)."""
        if self._task is None or self._task.done() or not self._late:
            return 0.0
        if self._late[-1][0] - self._since < WINDOW_S:
            return 0.0
        return statistics.median(late for _, late in self._late)
