"""Models loaded while the engine serves: a new version beside the old, or a new model.

A load goes: a frontend's ``Load`` -> :class:`ModelLoader` loads it, builds its slab and runner (its CUDA
graphs captured) and warms it in a thread of its own, on a CUDA stream of its own, while the loop goes on
stepping -> ``Prepare`` to every frontend (each makes ready to decode it) -> their ``Prepared`` -> the loop
installs it between two steps (``EngineCore.install``, O(1)) -> ``Models`` to every frontend, before anything
names the new model -> ``Loaded`` to the frontend that asked. Sessions move to it at their utterance
boundaries (``EngineCore``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cosystream.engine import ipc
from cosystream.engine.core import EngineCore
from cosystream.model_files import RESERVED_NAMES
from cosystream.runtime.runner import Runner

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """What :class:`ModelLoader` hands the loop: a model ready to install, or why there is none."""

    frontend: int
    request: int
    name: str
    runner: Runner | None
    info: ipc.ModelInfo | None
    error: str
    load_s: float  # loading, the runner (graphs) and the warm-up, in the loader's thread


class ModelLoader:
    """Loads models while the engine serves, one at a time, in a thread of the engine process.

    ``start`` begins a load; the loop takes what is ready from ``done`` (a queue it polls between steps) and
    installs it. The thread touches nothing the loop uses: it builds a new model, slab and runner
    (``EngineCore.prepare``) and warms them on their own scratch slot."""

    def __init__(self, core: EngineCore, build: Callable[[str, str, str], tuple[Runner, ipc.ModelInfo]]):
        """``build(name, path, precision)``: the model at ``path`` loaded at ``precision`` ("": as ``name`` is
        served), with its runner (``EngineCore.prepare``) warm, and its info; called in the loader's thread,
        on its CUDA stream, with the current device set."""
        self.core = core
        self.build = build
        self.done: queue.SimpleQueue[LoadedModel] = queue.SimpleQueue()
        self._busy = False
        # The loaded model the frontends are making ready to decode: those still to answer, and their refusals.
        self.preparing: LoadedModel | None = None
        self.waiting: set[int] = set()
        self.refusals: list[str] = []

    def forget(self, frontend: int) -> None:
        """A frontend went away: it answers no ``Prepare``."""
        self.waiting.discard(frontend)

    def start(self, frontend: int, request: int, name: str, path: str, precision: str = "") -> str | None:
        """Begin loading ``path`` as ``name`` at ``precision``; None, or why it cannot begin."""
        if name in RESERVED_NAMES:
            return f"{name!r} cannot name a model: it asks for the default one"
        if self._busy:
            return "another model is being loaded: try again once it is done"
        self._busy = True
        threading.Thread(
            target=self._load, args=(frontend, request, name, path, precision), daemon=True, name="model-load"
        ).start()
        return None

    def finished(self) -> None:
        """The loop took the last load's result: a new one may start."""
        self._busy = False

    def _load(self, frontend: int, request: int, name: str, path: str, precision: str) -> None:
        started = time.perf_counter()
        runner = info = None
        error = ""
        device = self.core.device
        # At a low CPU priority (Linux schedules threads on their own): on a CPU host the loop's steps come first.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            # Its own CUDA stream: the loop's steps and syncs on the default stream neither wait for nor
            # disturb the load's copies, captures and warm-up.
            side = (
                torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()
            )
            with side, torch.no_grad():
                runner, info = self.build(name, path, precision)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
        except Exception as err:
            log.debug("loading model %s from %s failed", name, path, exc_info=True)
            runner = info = None
            text = str(err).strip()
            error = f"cannot load {path}: {text.splitlines()[0] if text else type(err).__name__}"
        self.done.put(LoadedModel(frontend, request, name, runner, info, error, time.perf_counter() - started))


def admin(core: EngineCore, loader: ModelLoader, info: ipc.EngineInfo, infos: list, frontends) -> ipc.EngineInfo:
    """``Load``, ``Unload`` and ``Prepared`` ops, and loads the loader finished: a load goes ``Load`` -> (the
    loader's thread) -> ``Prepare`` to every frontend -> their ``Prepared`` -> installed between two steps ->
    ``Models`` -> ``Loaded``. Returns the info a new frontend's ``Hello`` gets."""
    for frontend, op in core.admin_ops:
        match op:
            case ipc.Load():
                error = loader.start(frontend, op.request, op.name, op.path, op.precision)
                if error:
                    core.post(frontend, ipc.Loaded(op.request, None, ipc.BUSY, error, 0.0, 0.0))
            case ipc.Unload():
                core.post(frontend, ipc.Unloaded(op.request, _unload(core, op.name)))
            case ipc.Prepared() if loader.preparing is not None and op.request == loader.preparing.request:
                loader.waiting.discard(frontend)
                if op.error:
                    loader.refusals.append(op.error)
    core.admin_ops.clear()
    while not loader.done.empty():
        loaded = loader.done.get()
        if loaded.runner is None:
            log.warning("model %s not loaded: %s", loaded.name, loaded.error)
            core.post(loaded.frontend, ipc.Loaded(loaded.request, None, ipc.LOAD_FAILED, loaded.error, 0.0, 0.0))
            loader.finished()
            continue
        # Its id once installed: the next index (one load at a time, and only installs add indices).
        loaded.info = dataclasses.replace(loaded.info, id=len(core.models))
        loader.preparing, loader.waiting, loader.refusals = loaded, set(frontends.values()), []
        for frontend in loader.waiting:
            core.post(frontend, ipc.Prepare(loaded.request, loaded.info))
    loaded = loader.preparing
    if loaded is None or loader.waiting:
        return info
    loader.preparing = None
    loader.finished()
    if loader.refusals:
        error = f"the server cannot decode {loaded.info.path}: {loader.refusals[0]}"
        log.warning("model %s not installed: %s", loaded.name, error)
        core.post(loaded.frontend, ipc.Loaded(loaded.request, None, ipc.UNDECODABLE, error, 0.0, loaded.load_s))
        return info
    # What the loop pays for a new model: the install, the announcement, the idle sessions' moves.
    started = time.perf_counter()
    index, previous = core.install(loaded.name, loaded.runner)
    assert index == loaded.info.id
    infos.append(loaded.info)
    info = announce_models(core, info, infos, frontends.values())  # the new id, before anything names it
    moved = 0 if previous is None else core.move_idle(previous)
    install_s = time.perf_counter() - started
    log.info(
        "model %s version %s serving (index %d%s): loaded and warmed in %.2f s beside the served models, "
        "installed between two steps in %.3f ms",
        loaded.name,
        loaded.info.version,
        index,
        ""
        if previous is None
        else f", replacing index {previous}: {moved} idle sessions moved, the others move at their next utterance",
        loaded.load_s,
        install_s * 1e3,
    )
    core.post(loaded.frontend, ipc.Loaded(loaded.request, loaded.info, "", "", install_s, loaded.load_s))
    return info


def _unload(core: EngineCore, name: str) -> str:
    """Stop serving ``name``; "" or why not."""
    try:
        index = core.unload(name)
    except KeyError:
        return f"no model {name!r} is served here"
    except ValueError as err:
        return str(err)
    log.info("model %s (index %d) no longer served; live sessions finish on it", name, index)
    return ""


def announce_models(core: EngineCore, info: ipc.EngineInfo, infos: list, frontends) -> ipc.EngineInfo:
    """Free the infos of freed models, and tell every frontend what is served now: the new ``Hello`` info."""
    for index, model in enumerate(core.models):
        if model is None:
            infos[index] = None
    info = dataclasses.replace(
        info, models=tuple(infos[index] for index in core.served.values()), held_models=len(core.held_models)
    )
    for frontend in frontends:
        core.post(frontend, ipc.Models(info.models, info.held_models))
    return info
