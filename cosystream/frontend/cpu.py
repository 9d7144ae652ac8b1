"""The CPU a frontend's host has left, projected per session: admission's fourth signal.

A frontend's streams cost CPU (~10 ms per second of audio each, on the cores it shares with the other
frontends, the engine on a CPU host, the second pass and whatever else runs there). Past what the cores
give, chunks wait in sockets and every result is late; the signals measured after the fact (the audio's
lateness, the loop lag) see it only once the calls admitted meanwhile are already too many (a burst of
opens comes faster than any window: ``docs/PERFORMANCE.md``, "The audio's lateness"). So the CPU is priced
the way the engine's load is (``engine/headroom.py``), before the session is taken:

    projected = busy - batch + batch at real time + cost x (realtime sessions open + 1 - realtime sessions
                in the window)

``busy``: the cores in use over the last :data:`WINDOW_S` on the CPUs this frontend may run on (its
affinity; in a container with a CPU quota, the container's usage against its quota), by every process;
``batch``: the share of this frontend's own CPU spent reading BATCH audio (shed first: BATCH is then read
no faster than real time); ``batch at real time``: what of it is left once it is shed, each BATCH stream read
at real time (BATCH slowed, not stopped: four files at 1.5x real time shed a third of their CPU, not all of
it); ``cost``: this frontend's CPU per REALTIME session over the window (its own CPU
time, its realtime share by audio read, over the mean of the realtime sessions it held), so the sessions
opened since the window are priced before their audio shows in it. Past ``serve --admit-cpu`` of the
cores, new REALTIME sessions are refused (RESOURCE_EXHAUSTED with a RetryInfo), and while the host is past
it with realtime sessions on this frontend, its BATCH streams are read no faster than real time.

Niced work is not counted as busy: it yields the CPU to the streams (the engine's background compiler runs
at the idle class, the second-pass worker at nice 10, a decoder's build thread at 19). A cgroup's usage
cannot tell it apart, so in a container with a CPU quota it counts. Off by default (``--admit-cpu 0``) until
measured on more hosts than one; GetServerInfo reports the figures either way (``LoadStatus.host_cpu_busy``,
``host_cpu_cores``, ``cpu_per_session``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from cosystream.priority import Priority

log = logging.getLogger(__name__)

ADMIT_CPU = 0.0
"""The share of the host's cores past which a frontend's projection refuses new REALTIME sessions
(``serve --admit-cpu``); 0, the default: only reported."""
SAMPLE_S = 0.25
WINDOW_S = 2.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_dirs(root: Path, proc_cgroup: str, controller: str) -> list[Path]:
    """This process's cgroup folder for ``controller`` ("" for cgroup v2) and its parents, innermost first."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (not controller and not controllers):
            base = root / controller if controller else root
            if not base.is_dir():
                return []
            parts = [part for part in path.strip("/").split("/") if part]
            dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
            return [folder for folder in dirs if folder.is_dir()] or [base]
    return []


@dataclass(frozen=True, slots=True)
class Quota:
    """A cgroup's CPU quota: its cores, and the file holding its usage (v2: ``cpu.stat`` usage_usec, v1:
    ``cpuacct.usage`` in ns; None: v1 with no ``cpuacct`` controller mounted for it, the cores still count but
    their use is not known)."""

    cores: float
    usage: Path | None
    v2: bool

    def used_s(self) -> float | None:
        text = _read(self.usage) if self.usage is not None else None
        if text is None:
            return None
        if not self.v2:
            return int(text) / 1e9
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        return None


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: str | None = None) -> Quota | None:
    """The CPU quota of this process's cgroup or the nearest parent with one (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``); None: no quota (or no cgroup file system). Under v1 the usage is the ``cpuacct``
    controller's, of this process's own ``cpuacct`` cgroup where that controller is mounted on its own."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    for folder in _cgroup_dirs(root, proc_cgroup, ""):
        text = _read(folder / "cpu.max")
        if text and not text.startswith("max") and (usage := folder / "cpu.stat").exists():
            quota, period = text.split()[:2]
            return Quota(int(quota) / int(period), usage, v2=True)
    for folder in _cgroup_dirs(root, proc_cgroup, "cpu"):
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0:
            usages = [d / "cpuacct.usage" for d in _cgroup_dirs(root, proc_cgroup, "cpuacct")[:1]]
            usages += [
                root / "cpuacct" / folder.relative_to(root / "cpu") / "cpuacct.usage",
                folder / "cpuacct.usage",
            ]
            usage = next((path for path in usages if path.exists()), None)
            return Quota(int(quota) / int(period), usage, v2=False)
    return None


class HostCpu:
    """The cores this process may use and their busy time, every process's: a cgroup quota's usage when
    one is set below the CPUs it may run on, else ``/proc/stat`` for those CPUs (niced work left out)."""

    def __init__(self, stat: Path = Path("/proc/stat"), quota: Quota | None = None, cpus: set[int] | None = None):
        self._stat = stat
        self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self.quota = quota if quota is not None and quota.cores < len(self.cpus) else None
        self.cores = self.quota.cores if self.quota is not None else float(len(self.cpus))

    def busy_s(self) -> float | None:
        """CPU seconds spent busy on those cores since boot (or since the cgroup began); None: unreadable."""
        if self.quota is not None:
            return self.quota.used_s()
        text = _read(self._stat)
        if text is None:
            return None
        busy = 0
        for line in text.splitlines():
            name, *ticks = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in self.cpus:
                continue
            # user nice system idle iowait irq softirq steal (guest time is already in user); niced work (the
            # engine's background compiler, the second-pass worker) yields to the rest: not counted
            busy += sum(int(tick) for index, tick in enumerate(ticks[:8]) if index not in (1, 3, 4))
        return busy / CLOCK_TICKS


@dataclass(frozen=True, slots=True)
class _Sample:
    at_s: float
    busy_s: float
    own_s: float
    realtime_audio_s: float
    batch_audio_s: float
    realtime_sessions: int
    batch_sessions: int


@dataclass(frozen=True, slots=True)
class CpuWindow:
    """The last window's figures: cores busy (of ``cores``), this frontend's cores on BATCH (and of them,
    those its BATCH streams would take read at real time), its cores per REALTIME session, and the mean of
    its realtime sessions."""

    cores: float
    busy: float
    batch: float
    per_session: float
    sessions: float
    batch_at_real_time: float = 0.0

    def projected(self, open_now: int) -> float:
        """The cores busy with one more REALTIME session, ``open_now`` open (BATCH's share above real time
        left out: shed first)."""
        shed = self.batch - self.batch_at_real_time
        return self.busy - shed + self.per_session * max(0.0, open_now + 1 - self.sessions)


class CpuHeadroom:
    """A frontend's view of its host's CPU, sampled every :data:`SAMPLE_S` once :meth:`start` is called."""

    def __init__(
        self,
        host: HostCpu | None = None,
        own_s=time.process_time,
        clock=time.monotonic,
        realtime_sessions=None,
        batch_sessions=None,
    ):
        """``own_s``: this process's CPU seconds; ``realtime_sessions`` and ``batch_sessions``: the REALTIME and
        BATCH streams it reads now."""
        self.host = host if host is not None else HostCpu(quota=cgroup_quota())
        self._own_s = own_s
        self._clock = clock
        self._realtime_sessions = realtime_sessions or (lambda: 0)
        self._batch_sessions = batch_sessions or (lambda: 0)
        self._audio = {Priority.REALTIME: 0.0, Priority.BATCH: 0.0}
        self._samples: deque[_Sample] = deque()
        self._task: asyncio.Task | None = None
        self.sampled = 0  # samples taken so far (a new one: busy_now moved)
        self._unreadable = False  # (said once)
        self.window: CpuWindow | None = None  # None until a whole window is sampled

    def read_audio(self, priority: Priority, audio_s: float) -> None:
        """A stream of ``priority`` read ``audio_s`` seconds of audio."""
        if priority in self._audio:
            self._audio[priority] += audio_s

    def start(self) -> None:
        """Sample on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="host-cpu")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_S)

    def sample(self) -> None:
        """Take one sample and update :attr:`window` from the oldest one within :data:`WINDOW_S`."""
        busy_s = self.host.busy_s()
        if busy_s is None:
            if not self._unreadable:
                self._unreadable = True
                quota = self.host.quota
                where = "its cgroup has a CPU quota but no cpuacct usage" if quota else "/proc/stat is unreadable"
                log.warning("the host's CPU use cannot be read (%s): admission by CPU refuses nothing", where)
            return
        now = self._clock()
        sample = _Sample(
            now,
            busy_s,
            self._own_s(),
            self._audio[Priority.REALTIME],
            self._audio[Priority.BATCH],
            self._realtime_sessions(),
            self._batch_sessions(),
        )
        self._samples.append(sample)
        self.sampled += 1
        while len(self._samples) > 2 and self._samples[1].at_s <= now - WINDOW_S:
            self._samples.popleft()
        first = self._samples[0]
        span_s = now - first.at_s
        if span_s < WINDOW_S * 0.99:
            return
        own = (sample.own_s - first.own_s) / span_s
        realtime_audio = sample.realtime_audio_s - first.realtime_audio_s
        batch_audio = sample.batch_audio_s - first.batch_audio_s
        audio = realtime_audio + batch_audio
        batch = own * batch_audio / audio if audio > 0 else 0.0
        n = len(self._samples) - 1
        sessions = sum(s.realtime_sessions for s in islice(self._samples, 1, None)) / n
        # BATCH read at real time: each stream 1 s of audio per second, at the window's CPU per BATCH audio second.
        batch_streams = sum(s.batch_sessions for s in islice(self._samples, 1, None)) / n
        at_real_time = batch * min(1.0, batch_streams * span_s / batch_audio) if batch_audio > 0 else 0.0
        per_session = (own - batch) / sessions if sessions >= 1 and realtime_audio > 0 else None
        if per_session is None and self.window is not None:
            per_session = self.window.per_session  # (the last measured, while no realtime runs)
        self.window = CpuWindow(
            self.host.cores,
            (sample.busy_s - first.busy_s) / span_s,
            batch,
            per_session or 0.0,
            sessions,
            at_real_time,
        )

    @property
    def busy_now(self) -> float:
        """The cores busy over the last sample's interval alone (for BATCH's pace: no window's delay)."""
        if len(self._samples) < 2:
            return 0.0
        last, before = self._samples[-1], self._samples[-2]
        return (last.busy_s - before.busy_s) / max(1e-9, last.at_s - before.at_s)
