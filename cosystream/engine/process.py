"""The engine process: owns the device, the models (each with its state slab and runner), the scheduler.

Frontends connect over a Unix socket (``multiprocessing.connection``). The loop: read what arrived
(without waiting while there is work), run one scheduled step, send each frontend one message with its
results. Realtime frames that arrive during a batch step are picked up before the next step.

A model loaded while serving (a frontend's ``Load``, from the Admin service) is loaded and warmed beside the
others while the loop goes on stepping, then installed between two steps (``model_swap.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, Listener

import torch

from cosystream.engine import ipc
from cosystream.engine.background_compile import BackgroundCompile
from cosystream.engine.config import EngineConfig, EngineProcessConfig, check_device
from cosystream.engine.core import EngineCore
from cosystream.engine.frontends import FrontendConnections
from cosystream.engine.model_swap import ModelLoader, admin, announce_models
from cosystream.logs import configure as configure_logs
from cosystream.model_files import (
    PRECISIONS,
    ModelSource,
    check_precision,
    check_served_precision,
    content_version,
    model_sources,
    vocabulary_kind,
)
from cosystream.models.contract import FRAME_SAMPLES, output_delay_frames
from cosystream.prctl import exit_with_parent, set_process_name
from cosystream.runtime.runner import Runner
from cosystream.runtime.settings import GraphMode
from cosystream.runtime.slab import plan_slab, slot_bytes

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
METRICS_PERIOD_S = 1.0
STATS_LOG_PERIOD_S = 30.0


def resolve_device(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a device with its index settled (``cuda`` is ``cuda:0``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(check_device(name, lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0))


def use_device(device: torch.device) -> None:
    """Make ``device`` the process's current CUDA device, in full float32.

    Full float32 (no TF32) keeps the engine's outputs equal to the offline pass within the streaming
    tolerance; docs/GPU.md has what TF32 would gain on the step (``benchmarks/step.py --device cuda``)."""
    if device.type == "cuda":
        if device.index is not None:  # (set_device refuses plain ``cuda``, which is the current device)
            torch.cuda.set_device(device.index)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


STARTUP_FAILED = 3
"""The engine process's exit status when it could not start (bad model, no such device, ...), after it said
why on its status pipe (``EngineHandle.wait_ready`` raises with that reason)."""


def describe_error(err: BaseException) -> str:
    """One line: the error's own message, or its type when it has none."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text or type(err).__name__


def raise_priority(increment: int = -5) -> None:
    """Every session waits on the engine's steps: when it shares cores with frontends (a CPU host), the
    OS should run it first. Needs CAP_SYS_NICE (root); elsewhere it stays at normal priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + increment)
    except OSError:
        log.debug("cannot raise the engine's priority")


def engine_main(config: EngineProcessConfig, status: Connection) -> None:
    exit_with_parent()
    set_process_name(config.process_name)
    raise_priority()
    configure_logs(config.log_level, config.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the engine stops
    stop = threading.Event()

    def request_stop(*_) -> None:
        # Once is enough, and a second SIGTERM must not run this again: Event.set() takes a lock that the
        # interrupted first call may hold (a deadlocked engine, orphaned). They come in bursts: the kernel
        # sends PR_SET_PDEATHSIG's signal each time the engine is handed to another of a dead parent's threads.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    try:
        config, core, listener = prepare_engine(config)
    except Exception as err:
        # One line, said by the supervisor; the traceback only at DEBUG.
        log.debug("engine start-up failed", exc_info=True)
        status.send(("failed", describe_error(err)))
        sys.exit(STARTUP_FAILED)
    status.send(("ready", None))
    status.close()
    try:
        run_engine(config, core, listener, stop)
    except Exception:
        log.exception("engine failed")
        sys.exit(1)


def prepare_engine(config: EngineProcessConfig) -> tuple[EngineProcessConfig, EngineCore, Listener]:
    """Everything that can fail at start-up: the model loaded and warm, the socket bound (a stale socket
    file of a killed engine is replaced)."""
    if not config.models:
        config = dataclasses.replace(config, models=model_sources([]))
    core = build_core(config)
    if os.path.exists(config.address):
        os.unlink(config.address)
    listener = Listener(config.address, family="AF_UNIX", authkey=config.authkey)
    return config, core, listener


def build_core(config: EngineProcessConfig) -> EngineCore:
    from cosystream.metrics import EngineMetrics
    from cosystream.models import load_model

    device = resolve_device(config.device)
    use_device(device)
    if device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)
    engine_config = config.engine
    if device.type != "cuda" and engine_config.graph_mode is GraphMode.GRAPHS:
        log.info("no CUDA device: running eager")
        engine_config = dataclasses.replace(engine_config, graph_mode=GraphMode.EAGER)
    started = time.perf_counter()
    sources = config.models or model_sources([])
    for source in sources:
        check_served_precision(source, device)  # (serve checks it first, but for --device auto)
    models = [load_model(source.path, device=device, precision=source.precision) for source in sources]
    if device.type == "cuda":
        engine_config = fit_slab(engine_config, models, device, *torch.cuda.mem_get_info(device))
    metrics = EngineMetrics(str(config.index or 0))
    core = EngineCore(models, engine_config, device, metrics, [source.name for source in sources], config.adaptive)
    warm_up(core)
    log.info(
        "engine ready on %s in %.1f s: %d slots, batch buckets %s, %s; %s",
        device,
        time.perf_counter() - started,
        engine_config.max_sessions,
        core.runner.batch_buckets,
        engine_config.graph_mode.value,
        ", ".join(
            f"model {s.name} ({s.path or 'embedded'}, {s.precision}"
            + (f", {len(r.compiled_keys)} shapes compiled" if r is not None and r.compiled_keys else "")
            + ")"
            for s, r in zip(sources, core.runners, strict=True)
        ),
    )
    return core


def fit_slab(
    engine_config: EngineConfig, models: Sequence, device: torch.device, free_bytes: int, total_bytes: int
) -> EngineConfig:
    """``engine_config`` with as many slots as ``device``'s free memory holds (``runtime.slab.plan_slab``): the
    ``--max-sessions`` asked, or fewer, said in the log; the slab's size is logged either way."""
    per_slot = sum(slot_bytes(model.cache_specs()) for model in models) + max(
        slot_bytes(model.cache_specs()) for model in models
    )  # (every model's slab, and a version loaded beside the largest while serving)
    plan = plan_slab(engine_config.max_sessions, per_slot, free_bytes, total_bytes)
    gib = 1 << 30
    if not plan.fits:
        log.warning(
            "--max-sessions %d does not fit in %s's free memory (%.1f of %.1f GiB, %.1f GiB kept free, %d "
            "bytes a slot): %d slots",
            plan.asked,
            device,
            free_bytes / gib,
            total_bytes / gib,
            plan.margin_bytes / gib,
            per_slot,
            plan.slots,
        )
    log.info(
        "state slab on %s: %d slots x %d bytes = %.1f MiB (device memory %.1f GiB free of %.1f GiB)",
        device,
        plan.slots,
        per_slot,
        plan.slab_bytes / (1 << 20),
        free_bytes / gib,
        total_bytes / gib,
    )
    if plan.fits:
        return engine_config
    max_batch = min(engine_config.max_batch or plan.slots, plan.slots)
    return dataclasses.replace(engine_config, max_sessions=plan.slots, max_batch=max_batch)


def warm_up(core: EngineCore) -> None:
    """Run every (bucket, T) shape of every model once on its scratch slot, so no first request pays for it."""
    for runner in core.runners:
        warm_up_runner(runner)


def warm_up_runner(runner: Runner) -> None:
    scratch = runner.slab.scratch_slot
    with torch.no_grad():
        for frames in runner.config.frame_buckets:
            for bucket in runner.batch_buckets:
                pcm = torch.zeros((bucket, frames * FRAME_SAMPLES))
                runner.run([scratch] * bucket, pcm)
    runner.slab.reset(scratch)


def model_info(model: torch.nn.Module, source: ModelSource | None = None) -> ipc.ModelInfo:
    """How ``model``, loaded from ``source`` (None: the embedded model under its own name), is described to
    the frontends."""
    source = source or ModelSource(model.config.name, None)
    return ipc.ModelInfo(
        name=source.name,
        version=content_version(source.path),
        path=source.path,
        language=model.config.language,
        vocabulary=list(model.vocabulary),
        vocabulary_kind=vocabulary_kind(source.path),
        parameters=sum(p.numel() for p in model.parameters()),
        output_delay_frames=output_delay_frames(model),
        precision=source.precision,
    )


def server_info(
    model: torch.nn.Module,
    device: torch.device,
    max_sessions: int,
    graph_mode: GraphMode,
    top_k: int,
    models: Sequence[ipc.ModelInfo] | None = None,
) -> ipc.EngineInfo:
    """The engine's ``Hello`` on this device: for ``models`` (the first the default), or for ``model`` alone."""
    return ipc.EngineInfo(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        models=tuple(models) if models else (model_info(model),),
        max_sessions=max_sessions,
        graph_mode=graph_mode.value,
        top_k=top_k,
    )


def run_engine(config: EngineProcessConfig, core: EngineCore, listener: Listener, stop: threading.Event) -> None:
    """The loop, until ``stop``: greet new frontends, read what arrived (without waiting while there is work),
    handle admin ops, run one scheduled step, send each frontend one message, report."""
    models = _Models(config, core)
    frontends = FrontendConnections(core, listener, stop, models.loader)
    reports = _Reports(core)
    if core.metrics is not None:
        for name, runner in zip(core.names, core.runners, strict=True):
            core.metrics.set_compiled_shapes(name, len(runner.compiled_keys))
    compiling = BackgroundCompile.for_engine(config, core, core.metrics)
    watched = len(core.runners)  # (models loaded while serving get their missing shapes compiled too)
    iteration_start = time.perf_counter()
    try:
        while not stop.is_set():
            if frontends.accept(models.info):
                reports.announced = None  # the new frontend learns the counts
            waited_s = frontends.receive(IDLE_WAIT_S)
            models.update(frontends.ids)
            if compiling is not None:
                if len(core.runners) > watched:
                    watched = compile_new_models(compiling, core, models.infos, watched)
                compiling.between_steps(core.report)
            core.step()
            reports.announce(frontends.ids)
            frontends.send(core.take_outbox())
            iteration_end = time.perf_counter()
            core.observe_load(iteration_end - iteration_start - waited_s)  # (adaptive: the loop's busy time)
            iteration_start = iteration_end
            reports.periodic(time.monotonic())
    finally:
        if compiling is not None:
            compiling.close()
        listener.close()
        frontends.close()
        if os.path.exists(config.address):
            os.unlink(config.address)
        log.info("engine stopped")


def compile_new_models(compiling: BackgroundCompile, core: EngineCore, infos: list, watched: int) -> int:
    """Hand the models installed since the first ``watched`` to the background compiler; returns how many
    there are now."""
    for index in range(watched, len(core.runners)):
        if (info := infos[index]) is not None:
            source = ModelSource(info.name, info.path, info.precision)
            compiling.add(core.names[index], core.runners[index], source)
    return len(core.runners)


class _Models:
    """The models as the frontends are told of them (the ``Hello`` info, each model index's info) and the loads
    and unloads the frontends ask for (``model_swap``)."""

    def __init__(self, config: EngineProcessConfig, core: EngineCore):
        self.core = core
        sources = config.models or model_sources([])
        # Per model index, as the frontends see it (None once freed).
        self.infos: list[ipc.ModelInfo | None] = [
            dataclasses.replace(model_info(m, s), id=index)
            for index, (m, s) in enumerate(zip(core.models, sources, strict=True))
        ]
        info = server_info(
            core.model,
            core.device,
            core.config.max_sessions,  # (on CUDA, what the device's memory holds: fit_slab)
            core.runner.config.graph_mode,
            core.runner.top_k,
            self.infos,
        )
        self.info = dataclasses.replace(info, held_models=len(core.held_models))  # what a new frontend is told
        self.loader = ModelLoader(core, self._build)
        self._changes = core.model_changes

    def _build(self, name: str, path: str, precision: str = "") -> tuple[Runner, ipc.ModelInfo]:
        """The loader's ``build``, in its thread."""
        from cosystream.models import load_model

        core, infos = self.core, self.infos
        use_device(core.device)  # (the current CUDA device is per thread)
        served = core.served.get(name)  # (a new version keeps the precision its name is served at)
        current = infos[served].precision if served is not None and infos[served] is not None else PRECISIONS[0]
        source = ModelSource(name, path, precision or current)
        check_precision(source.precision, core.device)
        model = load_model(path, device=core.device, precision=source.precision)
        runner = core.prepare(model)
        warm_up_runner(runner)
        return runner, model_info(model, source)

    def update(self, frontends: dict[Connection, int]) -> None:
        """Admin ops and finished loads, then any change of the models served to every frontend. Before the
        step: nothing the frontends get may name a model id they have not been told of."""
        core, loader = self.core, self.loader
        if core.admin_ops or not loader.done.empty() or (loader.preparing and not loader.waiting):
            self.info = admin(core, loader, self.info, self.infos, frontends)
        if core.model_changes != self._changes:
            self._changes = core.model_changes
            self.info = announce_models(core, self.info, self.infos, frontends.values())


class _Reports:
    """What the engine says of itself: ``Active`` to every frontend when the counts change, the metrics' session
    gauges every METRICS_PERIOD_S, a log line of the scheduler's work every STATS_LOG_PERIOD_S."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.announced: tuple | None = None  # (sessions, listening frontends, load) as frontends were last told
        self._last_metrics = 0.0
        self._last_stats = time.monotonic()
        self._logged = dataclasses.replace(core.scheduler.stats)

    def announce(self, frontends: dict[Connection, int]) -> None:
        core = self.core
        counts = (core.session_count, core.listening_frontends, core.report)
        if frontends and counts != self.announced:
            self.announced = counts
            for frontend in frontends.values():
                core.post(frontend, ipc.Active(*counts))

    def periodic(self, now: float) -> None:
        core = self.core
        if now - self._last_metrics > METRICS_PERIOD_S:
            self._last_metrics = now
            core.metrics.set_active(core.active_sessions())
            core.metrics.set_model_sessions(core.model_sessions())
        if now - self._last_stats > STATS_LOG_PERIOD_S:
            self._logged = log_stats(core, self._logged, now - self._last_stats)
            self._last_stats = now


def log_stats(core: EngineCore, before, period_s: float):
    """One log line of what the scheduler did since ``before`` (a copy of its stats)."""
    now = dataclasses.replace(core.scheduler.stats)
    steps = now.realtime_steps - before.realtime_steps
    rows = now.realtime_rows - before.realtime_rows
    frames = now.realtime_frames - before.realtime_frames
    batch_frames = now.batch_frames - before.batch_frames
    if steps or batch_frames:
        log.info(
            "last %.0f s: %d realtime steps, %.1f rows and %.2f frames per row per step, %d deadline misses,"
            " %d near their deadline (BATCH squeezed); %d batch steps, %d batch frames",
            period_s,
            steps,
            rows / max(1, steps),
            frames / max(1, rows),
            now.deadline_misses - before.deadline_misses,
            now.pressed - before.pressed,
            now.batch_steps - before.batch_steps,
            batch_frames,
        )
    return now
