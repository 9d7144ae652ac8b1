"""``cosystream serve``: the engine process, N frontends on one port, metrics, and a graceful drain.

Frontend 0 runs in this process; frontends 1..N-1 are spawned once it has bound the port (so ``--port 0``
works) and share it through SO_REUSEPORT. SIGTERM or SIGINT drains: health turns NOT_SERVING, new streams
get UNAVAILABLE, every open stream gets its final, then everything stops and the exit status is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import shutil
import signal
from dataclasses import replace

from cosystream.engine.process import EngineProcessConfig, exit_with_parent, set_process_name, start_engine
from cosystream.logs import configure as configure_logs
from cosystream.metrics import process_exited, serve_metrics
from cosystream.server.frontend import Frontend, FrontendConfig

log = logging.getLogger(__name__)


def frontend_main(
    config: FrontendConfig, address: str, authkey: bytes, log_level: str, log_format: str, index: int = 1
) -> None:
    """Entry point of a spawned frontend process."""
    exit_with_parent()
    set_process_name(f"cs-frontend-{index}")
    configure_logs(log_level, log_format)

    async def run() -> None:
        frontend = Frontend(config, address, authkey)
        await frontend.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the supervisor forwards SIGTERM
        await stop.wait()
        await frontend.drain()

    asyncio.run(run())


class Supervisor:
    def __init__(
        self,
        process: EngineProcessConfig,
        frontend: FrontendConfig,
        frontends: int,
        metrics_port: int,
        run_dir: str,
        naive: bool = False,
    ):
        self.process = process
        self.frontend_config = frontend
        self.frontends = frontends
        self.metrics_port = metrics_port
        self.run_dir = run_dir
        self.naive = naive
        self.children: list[mp.Process] = []

    def serve_metrics(self) -> None:
        """Bind ``/metrics`` before anything starts, so a busy port fails at once (``OSError``)."""
        if self.metrics_port:
            serve_metrics(self.metrics_port)

    def run(self) -> int:
        set_process_name("cs-supervisor")  # it also runs frontend 0
        if self.naive:
            return asyncio.run(self._serve_naive())
        engine = start_engine(self.process)
        try:
            return asyncio.run(self._serve(engine))
        finally:
            for child in self.children:
                if child.is_alive():
                    child.terminate()
                child.join(5)
                process_exited(child.pid)
            engine.terminate()
            engine.join(10)
            if engine.is_alive():
                engine.kill()
            process_exited(engine.pid)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _serve_naive(self) -> int:
        """One process, the model called per chunk as it arrives: the benchmarks' baseline."""
        from cosystream.server.naive import NaiveEngine

        engine = NaiveEngine(self.process.model_path, self.process.engine.max_sessions, self.process.decoder)
        frontend = Frontend(self.frontend_config, "", b"", engine=engine)
        port = await frontend.start()
        log.info("cosystream serving on port %d with 1 frontend(s) (naive mode: no engine, no batching)", port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await frontend.drain()
        return 0

    async def _serve(self, engine: mp.Process) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        frontend = Frontend(self.frontend_config, self.process.address, self.process.authkey)
        start = asyncio.create_task(frontend.start())
        while not start.done():
            await asyncio.wait({start}, timeout=0.5)
            if not engine.is_alive():
                log.error("the engine process exited during start-up (exit code %s)", engine.exitcode)
                start.cancel()
                return 1
            if stop.is_set():
                start.cancel()
                return 0
        port = start.result()
        sibling_config = replace(self.frontend_config, port=port)
        context = mp.get_context("spawn")
        for index in range(1, self.frontends):
            child = context.Process(
                target=frontend_main,
                args=(
                    sibling_config,
                    self.process.address,
                    self.process.authkey,
                    self.process.log_level,
                    self.process.log_format,
                    index,
                ),
                name=f"cosystream-frontend-{index}",
            )
            child.start()
            self.children.append(child)
        if self.metrics_port:
            log.info("metrics on :%d/metrics", self.metrics_port)
        log.info("cosystream serving on port %d with %d frontend(s)", port, self.frontends)
        status = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            if not engine.is_alive():
                log.error("the engine process exited (exit code %s); stopping", engine.exitcode)
                status = 1
                break
        log.info("draining")
        for child in self.children:
            if child.is_alive():
                child.terminate()  # SIGTERM: the child drains
        await frontend.drain()
        for child in self.children:
            await loop.run_in_executor(None, child.join, self.frontend_config.drain_grace_s + 5)
        log.info("stopped")
        return status
