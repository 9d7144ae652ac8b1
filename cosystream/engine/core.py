"""The engine core: sessions' slots, their queued frames, the scheduler and the runners, in one loop.

It runs in the engine process (``engine/process.py``), single-threaded, and knows nothing of gRPC.
``handle()`` applies what a frontend sent; ``step()`` runs one scheduled model step and files the
per-frame results into that frontend's outbox; ``take_outbox()`` returns one message per frontend.

The core may hold several models (the first is the default): each has its own state slab and runner.
Slots are numbered across all models (``max_sessions`` is the capacity of the whole engine) and a session
keeps the same row in its model's slab, so a step of one model's rows hands the scheduler's slots straight
to that model's runner.

Models can be loaded while serving (``prepare`` in any thread, then ``install`` in the loop's): a model's
index never changes and is never reused, so a name has a current index (``served``) and, after a new version
of it was installed, older ones that live sessions still run. A session moves to its name's current version
at its next ``Reset`` (the caches are zeroed there anyway); an index no slot holds any longer, and that is not
served, is freed (its slab and runner dropped).

With ``--adaptive HEAVY=LIGHT`` (``engine/adaptive.py``) a session is kept under the name it asked for, and
runs each utterance on that name's current version, or on LIGHT's while the engine's projected load is
high: the same move between utterances as for a new version.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from cosystream.engine import ipc
from cosystream.engine.adaptive import AdaptiveConfig, AdaptivePolicy, Switch
from cosystream.engine.config import EngineConfig
from cosystream.engine.frame_queue import FrameQueue
from cosystream.engine.headroom import (
    RETRY_AFTER_S,
    THIN_INTERIM_MS,
    Degradation,
    Headroom,
    LoadReport,
)
from cosystream.engine.scheduler import (
    AdmissionError,
    Priority,
    Scheduler,
    SchedulerConfig,
    StepPlan,
)
from cosystream.runtime.runner import Runner, RunnerConfig, StepResult
from cosystream.runtime.slab import StateSlab

log = logging.getLogger(__name__)


class StepObserver(Protocol):
    """Where the core reports what it did (``cosystream.metrics.EngineMetrics`` in the engine process): the
    core knows no metrics library."""

    def observe_step(
        self, priority: str, rows: int, frames: int, seconds: float, deadline_misses: int
    ) -> None: ...

    def set_active(self, counts: dict[str, int]) -> None: ...

    def set_model_sessions(self, counts: dict[str, int]) -> None:
        """Sessions per served model name (the version they run aside)."""
        ...

    def set_fallback(self, heavy: str, light: bool) -> None:
        """Whether ``heavy``'s new utterances run on its LIGHT model."""
        ...

    def observe_adaptive(self, heavy: str, light: bool) -> None:
        """``heavy``'s new utterances now run on its LIGHT model (``light``) or on itself (a switch)."""
        ...

    def set_load(self, load: float) -> None:
        """The engine's projected realtime load (``engine/adaptive.py``), once per window."""
        ...

    def set_overloaded(self, overloaded: bool) -> None:
        """Whether the engine is overloaded (``engine/headroom.py``), once per window."""
        ...

    def refused_for_load(self) -> None:
        """A new REALTIME session was refused: admitting it would have passed the load limit."""
        ...

    def set_compiled_shapes(self, model: str, count: int) -> None:
        """How many of ``model``'s step shapes run compiled (a CPU engine; at start, then as each is swapped in)."""
        ...


@dataclass(slots=True)
class _RealtimeWindow:
    """A load window's realtime steps, summed (their steps, rows, frames and compute seconds, and the realtime
    sessions open at each), and its busy time (what the adaptive policy was fed: the load's numerator)."""

    steps: int = 0
    rows: int = 0
    frames: int = 0
    sessions: int = 0
    compute_s: float = 0.0
    busy_s: float = 0.0


def make_runner_config(config: EngineConfig) -> RunnerConfig:
    """Every runner's settings in an engine of ``config`` (the background compiler's too: its packages' keys
    must be the engine's)."""
    return RunnerConfig(
        max_batch=config.max_batch,
        frame_buckets=config.frame_buckets,
        graph_mode=config.graph_mode,
        top_k=config.top_k,
        compile=config.compile,
        compile_cache_dir=config.compile_cache_dir,
        compile_budget_s=config.compile_budget_s,
    )


class EngineCore:
    def __init__(
        self,
        models: torch.nn.Module | Sequence[torch.nn.Module],
        config: EngineConfig,
        device: torch.device,
        metrics: StepObserver | None = None,
        names: Sequence[str] | None = None,
        adaptive: AdaptiveConfig | None = None,
        clock=time.monotonic,
    ):
        """``models``: one model, or several (sessions name one by its index; 0 is the default), served under
        ``names`` (None: their indices). ``adaptive``: models that fall back to lighter ones under load
        (their names must be served); ``clock``: the adaptive policy's (the tests' fake one)."""
        # Per model index; None once freed.
        self.models: list[torch.nn.Module | None] = (
            [models] if isinstance(models, torch.nn.Module) else list(models)
        )
        if not self.models:
            raise ValueError("the engine needs at least one model")
        names = [str(i) for i in range(len(self.models))] if names is None else list(names)
        if len(names) != len(self.models) or len(set(names)) != len(names):
            raise ValueError("one distinct name per model")
        self.config = config
        self.device = device
        self.metrics = metrics
        self.runner_config = runner_config = make_runner_config(config)
        # Every slab has a row per engine slot: a session may be on any model.
        self.slabs: list[StateSlab | None] = [
            StateSlab(m.cache_specs(), config.max_sessions, device=device) for m in self.models
        ]
        self.runners: list[Runner | None] = [
            Runner(m, slab, runner_config) for m, slab in zip(self.models, self.slabs, strict=True)
        ]
        self.names = names  # per model index, the name it is (or was) served under
        self.served: dict[str, int] = {name: index for index, name in enumerate(names)}  # the default first
        self._holders = [0] * len(self.models)  # per model index, the slots on it
        # Per slot: reset (or opened) and given no frame since, so it can move to a new version right away.
        self._fresh = bytearray(config.max_sessions)
        self.model, self.slab, self.runner = self.models[0], self.slabs[0], self.runners[0]  # the default's now
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_sessions=config.max_sessions,
                models=len(self.models),
                max_batch=self.runner.max_rows,
                frame_buckets=config.frame_buckets,
                row_buckets=self.runner.batch_buckets,
                deadline_s=config.deadline_s,
                batch_step_budget_s=config.batch_step_budget_s,
                realtime_batch_window_s=config.realtime_batch_window_s,
                batch_max_duty=config.batch_max_duty or (1.0 if device.type == "cuda" else 0.5),
            )
        )
        self.queue = FrameQueue(config.max_sessions, config.queue_frames, max(config.frame_buckets))
        self._owner: list[tuple[int, int] | None] = [None] * config.max_sessions
        self._priority: list[Priority] = [Priority.REALTIME] * config.max_sessions
        self._model_of = [0] * config.max_sessions  # each slot's model
        # Free slots across every model, popped from the end: slot 0 is handed out first.
        self._free = list(range(config.max_sessions - 1, -1, -1))
        self._slot_of: dict[tuple[int, int], int] = {}
        self._realtime_open = 0  # sessions of Priority.REALTIME holding a slot
        self._outbox: dict[int, ipc.ToFrontend] = {}
        self._listening: set[int] = set()  # frontends whose gRPC port is open
        self.freed_models = 0  # model versions freed since start-up (replaced or unloaded, and unused)
        self.model_changes = 0  # counts installs, unloads and frees: frontends are told when it moves
        self.admin_ops: list[tuple[int, ipc.Op]] = []  # (frontend, Load, Unload or Prepared op): the process's
        self._asked = [""] * config.max_sessions  # per slot: the model name the session asked for
        # The projected load (``cosystream_engine_load``) is measured whether or not any model falls back.
        adaptive = adaptive or AdaptiveConfig()
        for heavy, light in adaptive.pairs:
            for name in (heavy, light):
                if name not in self.served:
                    raise ValueError(f"--adaptive {heavy}={light}: no model {name!r} is served")
        self.adaptive = AdaptivePolicy(adaptive, clock)
        self._fallbacks = adaptive.fallbacks  # HEAVY name -> LIGHT name; empty: none falls back
        for heavy in self._fallbacks if metrics is not None else ():
            metrics.set_fallback(heavy, False)  # (the series exists from start-up)
        self.headroom = Headroom(config.admit_load, config.overload_window_s, clock)
        self.report: LoadReport | None = None  # the last window's, for the frontends (``Active``)
        self._window = _RealtimeWindow()  # this load window's, for headroom's projection
        self._batch_s = 0.0  # BATCH step time since the last observe_load (not realtime load)
        self._projection_s = 0.0  # what realtime LIGHT rows would have cost more on HEAVY, likewise

    # --- frontend messages -----------------------------------------------------------------------

    def handle(self, frontend: int, message: bytes) -> None:
        """One frontend message (``ipc.ToEngine.pack()``): its ops in order, then its frames."""
        message = ipc.ToEngine.unpack(message)
        # Deadlines and the batching window count from arrival here, in the engine.
        arrival_s = time.monotonic()
        ends = []
        for op in message.ops:
            match op:
                case ipc.End():
                    ends.append(op.key)  # (after this message's frames: they are among those it ends)
                case ipc.Open():
                    self._open(frontend, op.key, Priority(op.priority), op.model)
                case ipc.Reset():
                    slot = self._slot_of.get((frontend, op.key))
                    if slot is not None:
                        self._reset(frontend, op.key, slot)
                case ipc.Close():
                    slot = self._slot_of.pop((frontend, op.key), None)
                    if slot is not None:
                        self._release(slot)
                        self.scheduler.remove(slot)
                case ipc.Listening():
                    self._listening.add(frontend)
                case ipc.Load() | ipc.Unload() | ipc.Prepared():
                    self.admin_ops.append((frontend, op))
        for key, frames in message.runs():
            slot = self._slot_of.get((frontend, key))
            if slot is not None:
                self._enqueue(slot, frames, arrival_s)
        for key in ends:
            slot = self._slot_of.get((frontend, key))
            if slot is not None:
                self.scheduler.end_utterance(slot)

    def disconnect(self, frontend: int) -> None:
        """A frontend went away: free every slot it held."""
        self._listening.discard(frontend)
        for (owner, key), slot in list(self._slot_of.items()):
            if owner == frontend:
                del self._slot_of[(owner, key)]
                self._release(slot)
                self.scheduler.remove(slot)
        self._outbox.pop(frontend, None)

    def _current(self, asked: str) -> int | None:
        """The model index the next utterance of a session that asked for ``asked`` runs on: its current
        version, or its LIGHT model's while the adaptive policy says so (None: ``asked`` is not served)."""
        index = self.served.get(asked)
        if index is not None and self._fallbacks and self.adaptive.light:
            light = self.served.get(self._fallbacks.get(asked, ""))
            if light is not None:
                return light
        return index

    def _open(self, frontend: int, key: int, priority: Priority, model: int) -> None:
        # A frontend names the index its latest models list gave; one replaced since gets the current version
        # (Opened says which), one unloaded since is refused.
        current = self._current(self.names[model]) if 0 <= model < len(self.names) else None
        if current is None:
            what = f"model {self.names[model]!r} is no longer served" if 0 <= model < len(self.names) else ""
            self._box(frontend).events.append(ipc.Rejected(key, what or f"no model {model} in this engine"))
            return
        asked, model = self.names[model], current
        if priority == Priority.REALTIME and self.headroom.admit_load:  # (off: no count per open)
            sched = self.scheduler
            floor = sched.config.batch_min_duty if sched.batch_open else 0.0  # (BATCH keeps it: priced in)
            why = self.headroom.refuse(self._realtime_open, self._realtime_step_cost, floor)
            if why is not None:
                self._box(frontend).events.append(ipc.Rejected(key, why, RETRY_AFTER_S, "overloaded"))
                if self.metrics is not None:
                    self.metrics.refused_for_load()
                return
        try:
            shed = self.scheduler.admit(priority)
        except AdmissionError as err:
            self._box(frontend).events.append(ipc.Rejected(key, str(err)))
            return
        if shed is not None:
            owner = self._owner[shed]
            assert owner is not None
            del self._slot_of[owner]
            self._release(shed)
            self._box(owner[0]).events.append(
                ipc.Shed(owner[1], "a BATCH session was ended to make room for REALTIME sessions; retry later")
            )
        slot = self._free.pop()  # (admit() made room: there is one)
        self.scheduler.add(slot, priority, model)
        self._owner[slot] = (frontend, key)
        self._priority[slot] = priority
        self._realtime_open += priority == Priority.REALTIME
        self._model_of[slot] = model
        self._asked[slot] = asked
        self._holders[model] += 1
        self._fresh[slot] = 1
        self._slot_of[(frontend, key)] = slot
        self._box(frontend).events.append(ipc.Opened(key, model))

    def _reset(self, frontend: int, key: int, slot: int) -> None:
        """A new utterance: zeroed caches, on the current version of the session's model."""
        self.slabs[self._model_of[slot]].reset(slot)
        self._fresh[slot] = 1
        self._move_to_current(frontend, key, slot)

    def _move_to_current(self, frontend: int, key: int, slot: int) -> None:
        """Between utterances: a session of a replaced version goes on with the current one (or, adaptive,
        with its LIGHT or HEAVY model as the load says)."""
        model = self._model_of[slot]
        current = self._current(self._asked[slot])
        if current is None or current == model:
            return
        self.slabs[current].reset(slot)  # (rows no session holds are zero already: this is cheap insurance)
        self._model_of[slot] = current
        self._holders[current] += 1
        self.scheduler.move(slot, current)
        # Before any result of its next utterance (events precede results, and nothing of this session is in
        # flight): the frontend decodes those with the new version.
        self._box(frontend).events.append(ipc.Moved(key, current))
        self._drop_holder(model)

    def _release(self, slot: int) -> None:
        self._owner[slot] = None
        self._realtime_open -= self._priority[slot] == Priority.REALTIME
        self.queue.clear(slot)
        model = self._model_of[slot]
        self.slabs[model].reset(slot)  # zeroed for the next session on it
        self._free.append(slot)
        self._drop_holder(model)

    def _drop_holder(self, model: int) -> None:
        self._holders[model] -= 1
        if self._holders[model] == 0 and self.served.get(self.names[model]) != model:
            self._free_model(model)

    # --- models loaded while serving -------------------------------------------------------------

    def prepare(self, model: torch.nn.Module) -> Runner:
        """A runner for ``model`` over a slab of its own, graphs captured on CUDA: what :meth:`install`
        takes. Touches nothing of the core's state, so it may run in another thread while the loop steps
        (with that thread on a CUDA stream of its own)."""
        slab = StateSlab(model.cache_specs(), self.config.max_sessions, device=self.device)
        runner = Runner(model, slab, self.runner_config)
        if runner.batch_buckets != self.runner.batch_buckets:
            raise ValueError("a model's batch buckets must be the engine's")  # (same slab size: cannot happen)
        return runner

    def install(self, name: str, runner: Runner) -> tuple[int, int | None]:
        """Serve ``runner``'s model as ``name``, from now on, for new sessions (and for live sessions of an
        older version of ``name`` from their next utterance); in the loop's thread. Returns its index and the
        index it replaced (None: a new name). O(1) but for freeing a replaced version no session holds."""
        index = len(self.models)
        previous = self.served.get(name)
        self.models.append(runner.model)
        self.slabs.append(runner.slab)
        self.runners.append(runner)
        self.names.append(name)
        self._holders.append(0)
        added = self.scheduler.add_model(previous)
        assert added == index, (added, index)
        self.served[name] = index
        self.model_changes += 1
        if index == next(iter(self.served.values())):
            self.model, self.slab, self.runner = runner.model, runner.slab, runner
        if previous is not None and self._holders[previous] == 0:
            self._free_model(previous)
        return index, previous

    def move_idle(self, model: int | None = None) -> int:
        """Move the sessions of ``model`` (None: of any model) that are between utterances (reset, and no
        frame since) to the version they run next now, not at their next ``Reset``; how many moved. O(slots)."""
        moved = 0
        for slot, fresh in enumerate(self._fresh):
            owner = self._owner[slot]
            if fresh and owner is not None and (model is None or self._model_of[slot] == model):
                before = self._model_of[slot]
                self._move_to_current(owner[0], owner[1], slot)
                moved += self._model_of[slot] != before
        return moved

    # --- the adaptive model under load -----------------------------------------------------------

    def observe_load(self, busy_s: float) -> Switch | None:
        """The loop was busy ``busy_s`` since the last call (everything but waiting for input): fed to the
        adaptive policy as realtime load, BATCH steps taken out and LIGHT rows counted at HEAVY's cost. On a
        switch, sessions between utterances move at once, the others at their next utterance."""
        policy = self.adaptive
        windows = policy.windows
        realtime_busy_s = busy_s - self._batch_s + self._projection_s
        policy.add(realtime_busy_s)
        self._window.busy_s += realtime_busy_s
        self._batch_s = self._projection_s = 0.0
        switch = policy.update()
        if policy.windows != windows:
            self._observe_window(policy.load)
        if switch is None or not self._fallbacks:
            return None
        moved = self.move_idle()
        log.info(
            "projected load %.2f: new utterances of %s run on %s (%d sessions between utterances moved now)",
            switch.load,
            ", ".join(self._fallbacks),
            ", ".join(self._fallbacks.values()) if switch.light else "themselves",
            moved,
        )
        if self.metrics is not None:
            for heavy in self._fallbacks:
                self.metrics.observe_adaptive(heavy, switch.light)  # (set_load above has the load that did it)
        return switch

    def _observe_window(self, load: float) -> None:
        """A load window ended: the overload state, the metrics and the frontends' report."""
        window, self._window = self._window, _RealtimeWindow()
        self.scheduler.realtime_load = min(1.0, load)  # (BATCH's duty cap subtracts it, IPC and results included)
        stage = self.headroom.stage
        counts = self.active_sessions()
        steps = window.steps
        mean_rows, mean_frames = (window.rows / steps, window.frames / steps) if steps else (0.0, 0.0)
        # The sessions that made the window's load: those open at its steps, not those left at its end (a
        # burst of calls ending in it would charge their load to the few left).
        sessions = window.sessions / steps if steps else counts["realtime"]
        # (the part of the load that was model steps)
        compute = load * min(1.0, window.compute_s / window.busy_s) if window.busy_s > 0 else load
        if self.headroom.observe(load, mean_rows, mean_frames, sessions, compute):
            limit = self.headroom.limit
            if self.headroom.overloaded:
                log.warning(
                    "overloaded: projected realtime load %.2f at or over %g for %g s; new realtime sessions "
                    "are refused and the load health service says NOT_SERVING",
                    load,
                    limit,
                    self.headroom.window_s,
                )
            else:
                log.info("no longer overloaded: projected realtime load %.2f under %g", load, limit)
        if self.headroom.stage != stage:
            self._degrade(stage, load)
        if self.metrics is not None:
            self.metrics.set_load(load)
            self.metrics.set_overloaded(self.headroom.overloaded)
        self.report = LoadReport(
            load=round(load, 2),
            realtime=counts["realtime"],
            batch=counts["batch"],
            free_slots=len(self._free),
            queued_frames=self.scheduler.queued_frames(),
            overloaded=self.headroom.overloaded,
            admit_load=self.headroom.admit_load,
            refused=self.headroom.refused,
            stage=self.headroom.stage,
        )

    def _degrade(self, before: Degradation, load: float) -> None:
        """The degradation stage changed (``engine/headroom.py``): BATCH squeezed or not, said and counted."""
        stage = self.headroom.stage
        self.scheduler.batch_squeezed = stage >= Degradation.BATCH_SQUEEZED
        (log.warning if stage > before else log.info)(
            "degradation %s -> %s: projected realtime load %.2f (2 s: %.2f) of %g%s",
            before.name.lower(),
            stage.name.lower(),
            load,
            self.headroom.recent,
            self.headroom.limit,
            {
                Degradation.NONE: "; nothing shed",
                Degradation.BATCH_SQUEEZED: "; BATCH steps squeezed to their floor share",
                Degradation.INTERIMS_THINNED: f"; BATCH squeezed, interims at most every {THIN_INTERIM_MS} ms",
                Degradation.ADMISSION_CLOSED: "; BATCH squeezed, interims thinned, new realtime sessions refused",
            }[stage],
        )
        if self.metrics is not None:
            self.metrics.set_degradation(int(stage))

    def _project(self, plan: StepPlan, compute_s: float) -> None:
        """What a realtime step with rows on a LIGHT fallback would have cost more on HEAVY (the scheduler's
        cost model of HEAVY; its share of the rows)."""
        fallback = [slot for slot in plan.slots if self._asked[slot] != self.names[plan.model]]
        if not fallback:
            return
        heavy = self.served.get(self._asked[fallback[0]])
        if heavy is None:
            return
        heavy_s = self.scheduler.estimate_cost_s(plan.rows, plan.frames, heavy)
        light_s = self.scheduler.estimate_cost_s(plan.rows, plan.frames, plan.model)
        if math.isfinite(heavy_s) and light_s > 0:
            self._projection_s += compute_s * (heavy_s / light_s - 1) * len(fallback) / plan.rows

    def unload(self, name: str) -> int:
        """Stop serving ``name``: new sessions asking for it are refused, live ones finish on it (it is freed
        after the last). Returns its index; raises ``KeyError`` for a name not served, ``ValueError`` for the
        default model."""
        index = self.served[name]
        if index == next(iter(self.served.values())):
            raise ValueError(f"{name!r} is the default model: it cannot be unloaded (load a new version instead)")
        del self.served[name]
        self.model_changes += 1
        if self._holders[index] == 0:
            self._free_model(index)
        return index

    def _free_model(self, index: int) -> None:
        log.info(
            "model %s (index %d) freed: no session runs it and it is no longer served", self.names[index], index
        )
        self.models[index] = self.slabs[index] = self.runners[index] = None
        self.freed_models += 1
        self.model_changes += 1

    @property
    def held_models(self) -> list[int]:
        """The model indices the engine holds (served, or still run by a session)."""
        return [index for index, model in enumerate(self.models) if model is not None]

    def _enqueue(self, slot: int, frames: np.ndarray, arrival_s: float) -> None:
        self._fresh[slot] = 0
        # Frontends keep fewer frames than the queue holds in flight per session: a frame that does not fit
        # is a frontend bug, not load (FrameQueue.push drops it rather than stop every session).
        self.scheduler.add_frames(slot, self.queue.push(slot, frames), arrival_s)

    # --- steps -----------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def wait_s(self, idle_s: float) -> float:
        """How long the loop may block waiting for input before a step is due."""
        if self.scheduler.has_work():
            return 0.0
        due = self.scheduler.next_due_s()
        return idle_s if due is None else min(idle_s, max(0.0, due - time.monotonic()))

    def step(self) -> StepPlan | None:
        """Run one scheduled step, if any: the scheduler's plan, the runner's result, filed back by
        :meth:`update_from_output`."""
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        runner = self.runners[plan.model]
        # Gathered straight into the runner's input buffer: no copy of the step's audio between the two.
        pcm = self.queue.take(plan.slots, plan.frames, runner.input_buffer(plan.rows, plan.frames))
        started = time.perf_counter()
        result = runner.run(plan.slots, pcm)
        compute_s = time.perf_counter() - started
        self.update_from_output(plan, result, compute_s)
        if plan.priority is Priority.BATCH:
            self._batch_s += compute_s
        else:
            window = self._window
            window.steps += 1
            window.rows += plan.rows
            window.frames += plan.frames
            window.sessions += self._realtime_open
            window.compute_s += compute_s
            if self._fallbacks:
                self._project(plan, compute_s)
        return plan

    def _realtime_step_cost(self, rows: int, frames: int) -> float:
        """The scheduler's estimate of a realtime step of the default model (headroom's projection)."""
        model = next(iter(self.served.values()))
        return self.scheduler.estimate_cost_s(min(rows, self.config.max_batch), frames, model)

    def update_from_output(self, plan: StepPlan, result: StepResult, compute_s: float) -> None:
        """File a step's result back: its cost to the scheduler, each row's tokens to its frontend's outbox,
        the step to the metrics."""
        self.scheduler.update_cost(plan.rows, plan.frames, compute_s, plan.priority, plan.model)
        owners = [self._owner[slot] for slot in plan.slots]
        frontends = {frontend for frontend, _ in owners}
        if len(frontends) == 1:  # (one frontend, or a step of one frontend's sessions): the arrays as they are
            self._box(frontends.pop()).add_step(
                [key for _, key in owners], result.ids, result.logprobs, plan.queue_wait_s, compute_s
            )
        else:
            for frontend in sorted(frontends):
                rows = [row for row, (f, _) in enumerate(owners) if f == frontend]
                self._box(frontend).add_step(
                    [owners[row][1] for row in rows],
                    result.ids[rows],
                    result.logprobs[rows],
                    [plan.queue_wait_s[row] for row in rows],
                    compute_s,
                )
        if self.metrics is not None:
            self.metrics.observe_step(
                plan.priority.name.lower(), plan.rows, plan.frames, compute_s, plan.deadline_misses
            )

    @property
    def session_count(self) -> int:
        """Sessions holding a slot, from every frontend."""
        return len(self._slot_of)

    @property
    def listening_frontends(self) -> int:
        """Frontends connected whose gRPC port is open."""
        return len(self._listening)

    def post(self, frontend: int, event: ipc.Event) -> None:
        """Queue an event for ``frontend`` in its next message."""
        self._box(frontend).events.append(event)

    def model_sessions(self) -> dict[str, int]:
        """Sessions per served model name (every version of it; 0 for a name no session runs)."""
        counts = dict.fromkeys(self.served, 0)
        for slot in self._slot_of.values():
            name = self.names[self._model_of[slot]]
            counts[name] = counts.get(name, 0) + 1
        return counts

    def active_sessions(self) -> dict[str, int]:
        counts = {p.name.lower(): 0 for p in Priority}
        for slot in self._slot_of.values():
            counts[self._priority[slot].name.lower()] += 1
        return counts

    # --- outboxes --------------------------------------------------------------------------------

    def _box(self, frontend: int) -> ipc.ToFrontend:
        box = self._outbox.get(frontend)
        if box is None:
            box = self._outbox[frontend] = ipc.ToFrontend()
        return box

    def take_outbox(self) -> dict[int, ipc.ToFrontend]:
        boxes, self._outbox = self._outbox, {}
        return boxes
