"""The engine's configuration, importing no torch: ``serve``'s supervisor builds it from the flags and spawns
the engine process with it (``engine/launch.py``), which runs it (``engine/process.py``, ``engine/core.py``).

:class:`EngineConfig` is the core's settings, :class:`EngineProcessConfig` one engine process's (its socket,
models and device); :func:`resolve_devices` reads ``--device`` into one device name per engine process.
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from cosystream.engine.adaptive import AdaptiveConfig
from cosystream.engine.headroom import ADMIT_LOAD, OVERLOAD_WINDOW_S
from cosystream.engine.scheduler import BATCH_STEP_BUDGET_S, DEADLINE_S, MAX_SESSIONS, REALTIME_BATCH_WINDOW_S
from cosystream.model_files import ModelSource
from cosystream.runtime.buckets import FRAME_BUCKETS
from cosystream.runtime.settings import COMPILE_BUDGET_S, GraphMode


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's settings, built once from the flags; the scheduler's and the runner's configs are made
    from it (each default is the named constant's, stated once)."""

    max_sessions: int = MAX_SESSIONS
    max_batch: int | None = None  # rows per step; None: max_sessions
    frame_buckets: tuple[int, ...] = FRAME_BUCKETS
    queue_frames: int = 256  # frames a session may have queued in the engine (2.56 s of audio)
    deadline_s: float = DEADLINE_S
    batch_step_budget_s: float = BATCH_STEP_BUDGET_S
    realtime_batch_window_s: float = REALTIME_BATCH_WINDOW_S
    batch_max_duty: float | None = None  # None: 0.5 on a CPU, where frontends share the cores; 1 on CUDA
    graph_mode: GraphMode = GraphMode.EAGER
    top_k: int = 1  # token candidates per frame sent to frontends: what their text decoder reads
    # CPU: the step compiled ahead of time, one package per (bucket, T) cached on disk (``serve --compile``
    # fills the cache; by default only cached packages are used, the rest run eager); False: eager.
    compile: bool = True
    compile_budget_s: float | None = COMPILE_BUDGET_S  # start-up seconds for keys not in the cache
    compile_cache_dir: str | None = None  # None: runtime.compiled.default_cache_dir()
    # CPU: compile the shapes missing from the cache in a process of idle priority while serving, and swap each
    # in once checked (``engine/background_compile.py``; ``serve``'s default); False: they stay eager.
    background_compile: bool = False
    # New REALTIME sessions refused past this projected load (engine/headroom.py); 0: admission by count only.
    admit_load: float = ADMIT_LOAD
    overload_window_s: float = OVERLOAD_WINDOW_S

    def __post_init__(self) -> None:
        if self.max_batch is None:
            object.__setattr__(self, "max_batch", self.max_sessions)
        if self.max_sessions < 1 or self.max_batch < 1:
            raise ValueError("max_sessions and max_batch must be >= 1")
        if self.queue_frames < max(self.frame_buckets):
            raise ValueError("queue_frames must hold at least the largest frame bucket")
        if not 0 <= self.admit_load <= 4:  # (the projected load is at most 4)
            raise ValueError(f"--admit-load must be between 0 (off) and 4, got {self.admit_load}")
        if not 0 <= self.overload_window_s < math.inf:
            raise ValueError(f"--overload-window-s must be >= 0, got {self.overload_window_s}")


@dataclass(frozen=True, slots=True)
class EngineProcessConfig:
    address: str
    authkey: bytes
    engine: EngineConfig = field(default_factory=EngineConfig)
    # The models to serve, the first the default (``model_files.model_sources``); empty: the embedded model.
    models: tuple[ModelSource, ...] = ()
    adaptive: AdaptiveConfig | None = None  # models that fall back to lighter ones under load
    device: str = "auto"  # auto | cpu | cuda:N (auto: the engine picks, cuda:0 if there is one)
    cpu_threads: int = 1
    log_level: str = "INFO"
    log_format: str = "text"
    index: int | None = None  # of several engines (serve --engines, --device cuda:all); None: the only one

    @property
    def process_name(self) -> str:
        return "cs-engine" if self.index is None else f"cs-engine-{self.index}"


_COUNT_CUDA_DEVICES = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def cuda_device_count() -> int:
    """The CUDA devices the engine's torch sees, counted in a short-lived interpreter (about a second: torch's
    import), so that this process never loads torch. NVML would be quicker, but it counts every GPU whatever
    ``CUDA_VISIBLE_DEVICES`` says, and whether or not this torch was built with CUDA."""
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_CUDA_DEVICES], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise ValueError(f"cannot count the CUDA devices: {why}")
    return int(done.stdout)


def resolve_devices(name: str, engines: int = 1, cuda_count: Callable[[], int] = cuda_device_count) -> list[str]:
    """``--device`` and ``--engines`` as one device name per engine process: ``cuda:all`` is every CUDA
    device, ``cuda:0,cuda:1`` (or ``cuda:0,1``) a list of them, anything else ``engines`` engines on that device.
    ``auto`` stays ``auto`` (each engine picks: ``cuda:0`` if there is one, else the CPU); CUDA devices are
    counted (``cuda_count``) only when one is named. Raises ValueError (one line) for a device this machine
    lacks."""
    if engines < 1:
        raise ValueError("--engines must be >= 1")
    count = functools.cache(cuda_count)
    if name == "cuda:all":
        if not count():
            raise ValueError("--device cuda:all was asked for, but no CUDA device is available")
        names = [f"cuda:{i}" for i in range(count())]
    elif "," in name:
        names = [part if part.startswith(("cuda", "cpu")) else f"cuda:{part}" for part in name.split(",")]
    else:
        return [check_device(name, count)] * engines
    if engines != 1:
        raise ValueError(f"--device {name} starts one engine per device: --engines does not go with it")
    return [check_device(n, count) for n in names]


def check_device(name: str, count: Callable[[], int]) -> str:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``, checked against the ``count()`` CUDA devices there are
    (``cuda`` is ``cuda:0``); ``auto`` and ``cpu`` as they are. ValueError (one line) for one there is not."""
    kind, _, index = name.partition(":")
    if name == "auto" or kind == "cpu":
        return name
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device {name}: not a device (auto, cpu, cuda, cuda:N, cuda:all or a list of them)")
    devices = count()
    if not devices:
        raise ValueError(f"--device {name} was asked for, but no CUDA device is available")
    if int(index or 0) >= devices:
        raise ValueError(f"--device {name}: this machine has {devices} CUDA device(s), cuda:0..cuda:{devices - 1}")
    return f"cuda:{int(index or 0)}"
