"""``cosystream serve``: the engine process, N frontends on one port, metrics, restarts, and a graceful drain.

Every frontend is a spawned process of its own (``frontend_process.py``), which never imports torch; this
one only watches, and never imports torch either (the engine's configuration and its spawn are in
``engine/config.py`` and ``engine/launch.py``). Frontend 0 is spawned beside the engine and says which ports
it bound (so ``--port 0`` works), or why it could not serve (a tokens or TLS file that changed since the CLI
read it, a second-pass model that cannot load: one line, exit 1); frontends 1..N-1 are then spawned on the
same ports, shared through SO_REUSEPORT. ``--naive`` alone serves from this process (it runs the model
here, so it loads torch, as ``serve --compile-only`` does).

The supervisor owns the processes:
- an engine that cannot start (bad model, no such device) ends ``serve`` at once with one line saying why
  (exit 1): the same configuration would fail again;
- an engine that dies after it was ready is restarted with backoff; the frontends fail its sessions
  (UNAVAILABLE), turn health NOT_SERVING, and reconnect to the new one (SERVING again once it is warm);
- a frontend that dies is respawned;
- either dying ``RestartPolicy.max_failures`` times within ``window_s`` ends ``serve`` with exit 1, saying so.

SIGTERM or SIGINT drains: health turns NOT_SERVING with the port still open, new streams get UNAVAILABLE,
open streams are served for ``--drain-grace-s``; those still open then get the final for the audio received
and UNAVAILABLE; then everything stops and the exit status is 0.

SIGHUP reloads the tokens file (``--auth-tokens``) in every frontend, without dropping a session: the SIGHUP
is forwarded to each of them. The children are spawned with SIGHUP blocked (the mask is
inherited): a frontend unblocks it once its handler is in place, so a SIGHUP during its start-up waits
instead of killing it, and the engine never unblocks it (a SIGHUP to the process group reloads, and stops
nothing). With tokens, the frontends count each token's open sessions in one shared table
(``frontend/quota.py``); a frontend that dies has its row zeroed before it is respawned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from cosystream.app.banner import startup_lines
from cosystream.app.frontend_process import frontend_main
from cosystream.engine.config import EngineProcessConfig
from cosystream.engine.launch import EngineHandle, EngineStartError, start_engine
from cosystream.frontend.quota import TokenSessions
from cosystream.metrics import process_exited, serve_metrics
from cosystream.prctl import set_process_name
from cosystream.server.auth import TokenFileError
from cosystream.server.frontend import Frontend, FrontendConfig
from cosystream.server.tls import TlsError

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.1


@dataclass(slots=True)
class RestartPolicy:
    """Restart with exponential backoff; give up after ``max_failures`` within ``window_s``."""

    max_failures: int = 5
    window_s: float = 60.0
    first_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    _failures: deque[float] = field(default_factory=deque, init=False, repr=False)

    def failed(self) -> float | None:
        """Record a failure now: the backoff before the restart, or None to give up."""
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.window_s:
            self._failures.popleft()
        if len(self._failures) >= self.max_failures:
            return None
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (len(self._failures) - 1))


class ServeError(RuntimeError):
    """``serve`` cannot go on; the message says why (one line)."""


class Supervisor:
    def __init__(
        self,
        process: EngineProcessConfig | list[EngineProcessConfig],
        frontend: FrontendConfig,
        frontends: int,
        metrics_port: int,
        naive: bool = False,
        restarts: RestartPolicy | None = None,
        metrics_host: str = "0.0.0.0",
        gpu_gauges: bool = True,
    ):
        # One config per engine process (``serve --engines``, ``--device cuda:all``): each its own socket and device.
        self.processes = [process] if isinstance(process, EngineProcessConfig) else list(process)
        self.process = self.processes[0]
        # Each frontend's own socket, beside the engine's (server/forward.py: resumes that land elsewhere).
        if frontends > 1:
            run_dir = os.path.dirname(self.process.address)
            peers = tuple(f"unix:{os.path.join(run_dir, f'frontend-{i}.sock')}" for i in range(frontends))
            frontend = replace(frontend, stream=replace(frontend.stream, peers=peers))
        self.frontend_config = frontend
        self.frontends = frontends
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.gpu_gauges = gpu_gauges  # on /metrics wherever NVML sees a GPU, whatever the engines' devices
        # Made before any frontend is spawned: they inherit it.
        self.token_sessions = TokenSessions(frontends) if frontend.auth_tokens else None
        self.naive = naive
        self.restarts = restarts or RestartPolicy()
        self.children: dict[int, mp.Process] = {}
        self.engines: list[EngineHandle | None] = [None] * len(self.processes)

    def serve_metrics(self) -> None:
        """Bind ``/metrics`` before anything starts, so a busy port fails at once (``OSError``)."""
        if self.metrics_port:
            serve_metrics(self.metrics_port, self.metrics_host, gpu_gauges=self.gpu_gauges)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 after a drain. Raises :class:`ServeError` when it cannot go on."""
        set_process_name("cs-supervisor")
        try:
            if self.naive:
                return asyncio.run(self._serve_naive())
            return asyncio.run(self._serve())
        except (TokenFileError, TlsError) as err:  # changed since the CLI checked them (naive mode)
            raise ServeError(str(err)) from None
        finally:
            for child in self.children.values():
                if child.is_alive():
                    child.terminate()
                child.join(5)
                if child.is_alive():  # (stuck in its exit: it would outlive the server, holding its memory)
                    log.warning("%s did not exit in 5 s after SIGTERM; killed", child.name)
                    child.kill()
                    child.join(5)
                process_exited(child.pid)
            for handle in self.engines:
                if handle is not None:
                    self._stop_engine(handle)

    @staticmethod
    def _stop_engine(handle: EngineHandle) -> None:
        engine = handle.process
        engine.terminate()
        engine.join(10)
        if engine.is_alive():
            engine.kill()
            engine.join(5)
        process_exited(engine.pid)

    async def _serve_naive(self) -> int:
        """One process, the model called per chunk as it arrives: the benchmarks' baseline."""
        from cosystream.app.naive import NaiveEngine

        models = self.process.models
        if len(models) > 1:
            raise ServeError("--naive serves one model: give one --model")
        engine = NaiveEngine(
            models[0] if models else None, self.process.engine.max_sessions, self.process.engine.top_k
        )
        frontend = Frontend(self.frontend_config, "", b"", engine=engine, token_sessions=self._token_sessions(0))
        port = await frontend.start()
        log.info("cosystream serving on port %d with 1 frontend(s) (naive mode: no engine, no batching)", port)
        stop = self._stop_event(frontend)
        await stop.wait()
        await frontend.drain()
        return 0

    def _stop_event(self, frontend: Frontend | None = None) -> asyncio.Event:
        """Set by SIGTERM or SIGINT; SIGHUP reloads the tokens (see :meth:`_reload`) in the frontend processes,
        and in ``frontend`` (the naive mode's, in this process)."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload, frontend)
        return stop

    def _reload(self, frontend: Frontend | None) -> None:
        if not self.frontend_config.auth_tokens:
            log.info("SIGHUP: nothing to reload (no --auth-tokens)")
            return
        log.info("SIGHUP: reloading the tokens in %d frontend(s)", len(self.children) + (frontend is not None))
        if frontend is not None:
            frontend.reload_tokens()
        for child in self.children.values():
            if child.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGHUP)

    def _token_sessions(self, index: int) -> TokenSessions | None:
        return None if self.token_sessions is None else self.token_sessions.for_frontend(index)

    def _start_engine(self, index: int) -> EngineHandle:
        with _sighup_blocked():  # for good: the engine has nothing to reload
            self.engines[index] = start_engine(self.processes[index])
        return self.engines[index]

    @property
    def _addresses(self) -> list[str]:
        return [process.address for process in self.processes]

    async def _engine_ready(self, stop: asyncio.Event, index: int | None = None) -> bool:
        """Wait for engine ``index`` (None: every engine) to be ready (False: stopped first). Raises
        EngineStartError (naming the engine when there are several)."""
        for i in range(len(self.engines)) if index is None else [index]:
            try:
                while not self.engines[i].wait_ready(0):
                    if stop.is_set():
                        return False
                    await asyncio.sleep(WATCH_PERIOD_S)
            except EngineStartError as err:
                if len(self.engines) == 1:
                    raise
                raise EngineStartError(f"engine {i} ({self.processes[i].device}): {err}") from None
        return True

    async def _serve(self) -> int:
        stop = self._stop_event()
        for index in range(len(self.processes)):
            self._start_engine(index)
        ready, told = mp.get_context("spawn").Pipe(duplex=False)
        self._spawn_frontend(0, told)  # (its imports overlap the engine's start)
        told.close()
        try:
            if not await self._engine_ready(stop):
                return 0
            while not ready.poll():
                await asyncio.sleep(WATCH_PERIOD_S)
                if stop.is_set():
                    return 0
                for handle in self.engines:
                    if not handle.process.is_alive():
                        raise ServeError(
                            f"the engine process exited during start-up (exit code {handle.process.exitcode})"
                        )
            report = _read_report(ready, self.children[0])
        except EngineStartError as err:
            raise ServeError(f"the engine could not start: {err}") from None
        finally:
            ready.close()
        if isinstance(report, str):
            self.children[0].join(10)  # (it stops its own children first: a second-pass worker)
            raise ServeError(report)
        port, http_port = report
        http = self.frontend_config.http
        if http is not None:  # the others (and frontend 0 respawned) bind the port the first one got
            http = replace(http, port=http_port)
        self.frontend_config = replace(self.frontend_config, port=port, http=http)
        for index in range(1, self.frontends):
            self._spawn_frontend(index)
        log.info("cosystream serving on port %d with %d frontend(s)", port, self.frontends)
        for line in startup_lines(self.frontend_config, port, self.metrics_host, self.metrics_port):
            log.info("%s", line)
        try:
            await self._watch(stop)
        finally:
            log.info("draining")
            for child in self.children.values():
                if child.is_alive():
                    child.terminate()  # SIGTERM: the child drains
            loop = asyncio.get_running_loop()
            for child in self.children.values():
                await loop.run_in_executor(None, child.join, self.frontend_config.drain_grace_s + 10)
        log.info("stopped")
        return 0

    def _spawn_frontend(self, index: int, ready: Connection | None = None) -> None:
        child = mp.get_context("spawn").Process(
            target=frontend_main,
            args=(
                self.frontend_config,
                self._addresses if len(self.processes) > 1 else self.process.address,
                self.process.authkey,
                self.process.log_level,
                self.process.log_format,
                index,
                self._token_sessions(index),
                ready,
            ),
            name=f"cosystream-frontend-{index}",
        )
        with _sighup_blocked():  # until its handler is in place (frontend_main unblocks it)
            child.start()
        self.children[index] = child

    async def _watch(self, stop: asyncio.Event) -> None:
        """Until ``stop``: restart the engine and respawn frontends that die. Raises ServeError on giving up."""
        restarting: dict[int, asyncio.Task] = {}  # per engine index
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_PERIOD_S)
            if stop.is_set():
                break
            for index, task in list(restarting.items()):
                if task.done():
                    task.result()  # a ServeError ends serve
                    del restarting[index]
            for index, handle in enumerate(self.engines):
                if index not in restarting and not handle.process.is_alive():
                    restarting[index] = asyncio.create_task(self._restart_engine(stop, index))
            for index, child in list(self.children.items()):
                if not child.is_alive():  # (reaps it: no zombie)
                    await self._respawn_frontend(index, child, stop)
        for task in restarting.values():
            task.cancel()

    def _failed(self, dead: mp.Process, what: str) -> float:
        """Count a dead process against the restart policy: the backoff before its restart, or ServeError
        (``what`` with ``{n}``, the failures allowed) when the policy gives up."""
        process_exited(dead.pid)
        backoff_s = self.restarts.failed()
        if backoff_s is None:
            raise ServeError(
                f"{what.format(n=self.restarts.max_failures)} within {self.restarts.window_s:g} s "
                f"(last exit code {dead.exitcode}); giving up"
            )
        return backoff_s

    async def _restart_engine(self, stop: asyncio.Event, index: int = 0) -> None:
        which = "the engine process" if len(self.engines) == 1 else f"engine {index}"
        while True:
            dead = self.engines[index].process
            backoff_s = self._failed(dead, which + " died {n} times")
            log.error("%s died (exit code %s); restarting it in %.1f s", which, dead.exitcode, backoff_s)
            await asyncio.sleep(backoff_s)
            self._start_engine(index)
            try:
                if await self._engine_ready(stop, index):
                    log.info("%s restarted", "engine" if len(self.engines) == 1 else which)
                return
            except EngineStartError as err:
                log.error("the restarted engine could not start: %s", err)

    async def _respawn_frontend(self, index: int, child: mp.Process, stop: asyncio.Event) -> None:
        backoff_s = self._failed(child, f"frontend {index} died, {{n}} process failures")
        log.error("frontend %d died (exit code %s); respawning it in %.1f s", index, child.exitcode, backoff_s)
        del self.children[index]
        if self.token_sessions is not None:
            self.token_sessions.reset_row(index)  # its sessions died with it
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff_s)
        if not stop.is_set():
            self._spawn_frontend(index)


@contextlib.contextmanager
def _sighup_blocked():
    """SIGHUP blocked in this thread while a child is spawned: the child inherits the mask; one arriving
    here meanwhile is delivered after."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _read_report(ready: Connection, child: mp.Process) -> tuple[int, int] | str:
    """What frontend 0 said once it served (its gRPC and HTTP ports) or failed (why, one line)."""
    try:
        return ready.recv()
    except EOFError:  # it died before saying anything
        child.join(1)
        return f"frontend 0 exited during start-up (exit code {child.exitcode})"
