"""Compiling the CPU step's missing shapes while the engine serves, and swapping each in between two steps.

An engine on a CPU starts at once, stepping every (bucket, T) shape the compile cache holds compiled and the
rest eager (``runtime/compiled.py``). If some are missing, it then spawns ``cs-compiler``: a process that
builds each served model's runner as the engine does (so the cache keys match) with no compile budget, and so
compiles every missing shape, one after the other, at the idle scheduling class (Linux's ``SCHED_IDLE``, else
nice 19: it runs on cycles no other process wants, so it never takes a core from the engine or the
frontends) on one compile thread, then exits. Each package is checked against the eager step before it is
put in the cache, and the cache holds no package that failed. The engine's watcher thread sees each new
package and loads it; the loop installs it between two steps (a dict insert). A load holds the GIL for about
10 ms once per shape (AOTInductor's loader); checking there instead would hold it for a whole compiled step
(``boxed_run`` keeps the GIL), up to tens of ms for the largest shapes. If the compiler dies, the shapes it
did not finish stay eager. A model loaded while serving (``model_swap.py``) is handed over the same way
(:meth:`BackgroundCompile.add`), and compiled after any compile at work.

The compiler takes the cache's ``.compiler.lock`` for its whole run, so that several engines on one cache
(``--engines``) compile each shape once: the second waits, then finds the first's packages and loads them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

from cosystream.engine.config import EngineProcessConfig
from cosystream.prctl import exit_with_parent, set_process_name

log = logging.getLogger(__name__)

PROCESS_NAME = "cs-compiler"
LOCK_FILE = ".compiler.lock"
POLL_S = 1.0  # how often the watcher looks for new packages
# The compiler is paused (SIGSTOP to its process group) while the engine's projected realtime load is at least
# PAUSE_LOAD, and resumed once it is below RESUME_LOAD: at the idle scheduling class it takes no CPU time the
# serving processes want, but it still shares the caches and memory bandwidth with them.
PAUSE_LOAD = 0.5
RESUME_LOAD = 0.3


class Pause:
    """Stops and continues a process group by a load, with hysteresis: :meth:`pace` once per load window."""

    def __init__(self, pgid: int, pause_load: float = PAUSE_LOAD, resume_load: float = RESUME_LOAD):
        self.pgid = pgid
        self.pause_load = pause_load
        self.resume_load = resume_load
        self.paused = False
        self.pauses = 0

    def pace(self, load: float) -> None:
        if load >= self.pause_load and not self.paused:
            self._signal(signal.SIGSTOP)
        elif load < self.resume_load and self.paused:
            self._signal(signal.SIGCONT)

    def resume(self) -> None:
        if self.paused:
            self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except ProcessLookupError:
            return  # (ended)
        self.paused = signum == signal.SIGSTOP
        self.pauses += self.paused
        log.debug("%s %s", PROCESS_NAME, "paused: the engine is busy" if self.paused else "resumed")


def lower_priority() -> str:
    """This process (and the compilers it runs, which inherit it) at the idle scheduling class where Linux has
    one, nice 19 as well; returns which."""
    with contextlib.suppress(OSError):
        os.nice(19)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        return "nice 19"
    return "SCHED_IDLE"


def compiler_main(config: EngineProcessConfig) -> None:
    """The compiler process: every served model's missing shapes compiled into the cache, then exit."""
    exit_with_parent(signal.SIGKILL)  # (it may be stopped, paused by the engine, when the engine dies)
    os.setpgid(0, 0)  # a process group of its own: the engine pauses and resumes it with its compiler runs
    set_process_name(PROCESS_NAME)
    priority = lower_priority()
    from cosystream.logs import configure as configure_logs

    configure_logs(config.log_level, config.log_format)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (unwinds: a half-written package is removed)
    # A spawned child's default start method is spawn, under which a multiprocessing lock made here (tqdm's,
    # when torch.fx shows progress) is named and registered with the server's resource tracker; stopped
    # mid-compile, it would be reported as leaked when the server exits. Under fork it is unlinked at once.
    mp.set_start_method("fork", force=True)
    import torch
    import torch._inductor.config

    from cosystream.engine.core import make_runner_config
    from cosystream.model_files import model_sources
    from cosystream.models import load_model
    from cosystream.runtime.compiled import default_cache_dir
    from cosystream.runtime.runner import Runner
    from cosystream.runtime.settings import GraphMode
    from cosystream.runtime.slab import StateSlab

    torch.set_num_threads(config.cpu_threads)  # (the engine's: it is part of the cache's fingerprint)
    torch._inductor.config.compile_threads = 1
    engine = dataclasses.replace(config.engine, compile_budget_s=None, graph_mode=GraphMode.EAGER)  # (a CPU)
    cache = engine.compile_cache_dir or str(default_cache_dir())
    with open(os.path.join(cache, LOCK_FILE), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (another engine's compiler first: its packages are then loaded)
        for source in config.models or model_sources([]):
            started = time.perf_counter()
            model = load_model(source.path, precision=source.precision)
            slab = StateSlab(model.cache_specs(), engine.max_sessions)
            runner = Runner(model, slab, make_runner_config(engine))
            steps = runner.compiled_steps
            if steps is not None:
                log.info(
                    "%s (%s): model %s: %d shapes compiled in %.0f s, %d from the cache, %d left eager",
                    PROCESS_NAME,
                    priority,
                    source.name,
                    steps.compiled,
                    time.perf_counter() - started,
                    steps.loaded,
                    steps.skipped,
                )


def unwritable(cache: str) -> str | None:
    """Why no package can be put in the compile cache ``cache`` (a read-only mount, as an image's cache made at
    build time may be; a folder this user may not write), or None."""
    try:
        if os.statvfs(cache).f_flag & os.ST_RDONLY:
            return f"the compile cache {cache} is on a read-only file system"
    except OSError as err:
        return f"the compile cache {cache} cannot be used: {err}"
    if not os.access(cache, os.W_OK | os.X_OK):
        return f"the compile cache {cache} cannot be written by this user (uid {os.getuid()})"
    return None


def _prepare_loading() -> None:
    """What the first package's load would do, done now, at start (no session yet): the import of AOTInductor
    (about 1 s, and up to 180 ms at a time with the GIL held) and its probe of the CPU's vector ISA (about 1 s
    of compiler runs, cached for the process)."""
    import torch._inductor.package  # noqa: F401

    with contextlib.suppress(Exception):  # (torch's internals: only an earlier cost if they move)
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()


class BackgroundCompile:
    """The engine's side: compiler processes, one at a time, for the models with shapes still eager (those
    served from the start, and those loaded while serving: :meth:`add`), and the watcher thread that loads
    what they compile. :meth:`between_steps` runs in the loop's thread, between steps."""

    def __init__(self, config: EngineProcessConfig, metrics=None):
        self.config = config
        self.metrics = metrics
        self.swapped = 0
        self.models: list[tuple[str, object]] = []  # (name, runner) of every model added, watched
        self.process: mp.Process | None = None  # the compiler at work, or the last one
        self.pause: Pause | None = None
        self._pending: list = []  # the ModelSources of the models added since the last compiler started
        self._ready: collections.deque = collections.deque()  # (name, runner, key, loader), for the loop
        self._lock = threading.Lock()
        self._watching = False
        self._stop = threading.Event()
        self._report = None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_engine(cls, config: EngineProcessConfig, core, metrics=None) -> BackgroundCompile | None:
        """Compiling for ``core``'s models from now on, starting with the shapes its start-up left eager (None:
        a CUDA engine, background compiling off, no compiler here, or a compile cache it could not write)."""
        if not config.engine.background_compile or core.device.type != "cpu" or not config.engine.compile:
            return None
        from cosystream.model_files import model_sources
        from cosystream.runtime.compiled import compiler_missing, default_cache_dir

        cache = config.engine.compile_cache_dir or str(default_cache_dir())
        missing = compiler_missing() or unwritable(cache)
        if missing:
            eager = sum(len(runner.eager_keys()) for runner in core.runners if runner is not None)
            if eager:
                log.info("%d shapes not in the compile cache run eager: %s", eager, missing)
            return None
        compiling = cls(config, metrics)
        sources = config.models or model_sources([])
        for name, runner, source in zip(core.names, core.runners, sources, strict=True):
            compiling.add(name, runner, source)
        return compiling

    def add(self, name: str, runner, source) -> None:
        """Compile ``runner``'s eager shapes (its model loaded from ``source``, a ``ModelSource``) in the
        background, and swap each in; nothing if it has none. In the loop's thread."""
        keys = runner.eager_keys() if runner is not None else []
        if not keys:
            return
        log.info(
            "compiling %d shapes of model %s missing from the compile cache in the background (%s, idle "
            "priority): each runs eager until it is swapped in",
            len(keys),
            name,
            PROCESS_NAME,
        )
        with self._lock:
            self.models.append((name, runner))
            self._pending.append(source)
            if not self._watching:
                self._watching = True
                self._thread = threading.Thread(target=self._watch, name="compiled-steps", daemon=True)
                self._thread.start()

    def between_steps(self, report) -> int:
        """In the loop's thread, between two steps: pause or resume the compiler by the engine's load (``report``,
        the last window's ``LoadReport``: a new one once per window), then install every package loaded since
        the last call; returns how many."""
        if report is not self._report and report is not None:
            self._report = report
            process, pause = self.process, self.pause
            if process is not None and pause is not None and process.is_alive():
                pause.pace(report.load)
        return self.install_ready() if self._ready else 0

    def install_ready(self) -> int:
        """Install every loaded package in its runner (the loop's thread, between steps); returns how many."""
        installed = 0
        while self._ready:
            name, runner, key, loader = self._ready.popleft()
            runner.install_compiled(key, loader)
            installed += 1
            self.swapped += 1
            log.debug("compiled step %r of model %s swapped in", key, name)
            if self.metrics is not None:
                self.metrics.set_compiled_shapes(name, len(runner.compiled_keys))
        return installed

    def _watch(self) -> None:
        _prepare_loading()
        tried: set[tuple[int, tuple[int, int]]] = set()  # (id of the runner, key)
        while True:
            with self._lock:
                if self._stop.is_set() or not self._pending:
                    self._watching = False
                    return
                sources, self._pending = self._pending, []
            self._compile(sources, tried)

    def _compile(self, sources: list, tried: set) -> None:
        """One compiler for ``sources``: every watched runner swept for new packages until it has exited (and
        once more after), then the end logged."""
        started, swapped = time.monotonic(), self.swapped
        context = mp.get_context("spawn")
        process = context.Process(
            target=compiler_main,
            args=(dataclasses.replace(self.config, models=tuple(sources)),),
            name=PROCESS_NAME,
        )
        process.start()
        self.pause = Pause(process.pid)  # (its pid is its process group's id: it calls setpgid first)
        self.process = process
        while not self._stop.is_set():
            exited = not process.is_alive()  # (before the sweep: it sees every package the process wrote)
            with self._lock:
                models = list(self.models)
            for name, runner in models:
                for key in runner.eager_keys():
                    if (id(runner), key) in tried or not runner.compiled_steps.path(key).exists():
                        continue
                    tried.add((id(runner), key))
                    try:
                        loader = runner.load_compiled(key)
                    except Exception:
                        log.exception("loading the compiled step %r of model %s failed: it runs eager", key, name)
                        continue
                    if loader is not None:
                        self._ready.append((name, runner, key, loader))
            if exited:
                break
            self._stop.wait(POLL_S)
        while self._ready and not self._stop.is_set():
            time.sleep(0.05)  # (the loop installs them)
        if self._stop.is_set():
            return
        eager = sum(len(runner.eager_keys()) for _, runner in models)
        log.log(
            logging.INFO if process.exitcode == 0 else logging.WARNING,
            "background compile of %s ended (exit code %s) after %.0f s: %d shapes swapped in, %d still eager",
            ", ".join(source.name for source in sources),
            process.exitcode,
            time.monotonic() - started,
            self.swapped - swapped,
            eager,
        )

    def close(self) -> None:
        """End the compiler and its compiler runs (a package half written is removed), and the watcher."""
        self._stop.set()
        process, pause = self.process, self.pause
        if process is not None and process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            pause.resume()  # (a stopped process acts on SIGTERM once continued)
            process.join(10)
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.join(5)
        if self._thread is not None:
            self._thread.join(5)
