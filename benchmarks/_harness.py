"""Shared by the end-to-end benchmarks: start ``cosystream serve`` in a subprocess, measure its CPU time,
run the latency probe (``clients/latency_probe.py``) in another process against it, and read the server's
GPU gauges during a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COMPILER = "cs-compiler"  # the background compiler (cosystream/engine/background_compile.py)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            tree.setdefault(parent, []).append(int(entry))
    return tree


def _descendants(root: int) -> list[int]:
    tree, found, stack = _children(), [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(tree.get(pid, []))
    return found


def _name(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.index("(") + 1 : stat.rindex(")")]


def cpu_by_process(root: int) -> dict[str, float]:
    """User + system CPU seconds of ``root`` and each live descendant, by process name (``cs-engine``,
    ``cs-frontend-1``, ...: the names ``cosystream serve`` gives them; others by name and pid). The background
    compiler's whole tree (its compiler runs, ended ones too) is one entry, ``cs-compiler``."""
    tree = _children()
    seconds: dict[str, float] = {}
    stack = [(root, None)]
    while stack:
        pid, within = stack.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        key = within or (name if name.startswith("cs-") else f"{name}-{pid}")
        used = int(fields[11]) + int(fields[12])
        if key == COMPILER and within is None:
            used += int(fields[13]) + int(fields[14])  # (its children's, once they are waited for)
        seconds[key] = seconds.get(key, 0.0) + used / CLOCK_TICKS
        stack.extend((child, COMPILER if key == COMPILER else None) for child in tree.get(pid, []))
    return seconds


def cpu_seconds(root: int) -> float:
    """User + system CPU of ``root`` and all its descendants (live ones)."""
    return sum(cpu_by_process(root).values())


class Server:
    """``cosystream serve`` on free ports; ``with Server(...) as s: s.address``."""

    def __init__(self, *extra: str, engine_share: float | None = None):
        """``extra``: more serve flags. The second pass is off unless they say ``--final-model``: these
        benchmarks measure the streaming path, and Whisper's finals (held 1-3 s on a CPU, its worker beside
        the engine on the same cores) would be the tail of every latency and the share of every CPU figure.

        ``engine_share``: emulate a host whose engine, not its frontends or the load generator, is the limit
        (a GPU server, or a large CPU host with a small engine share): the engine runs alone on the last CPU
        with busy-looping processes at its own priority beside it, so that it gets about this share of that
        CPU (1/2, 1/3, 1/4, ...), and the server's other processes and the probe run on the other CPUs. On a
        small host the probe and the frontends otherwise saturate the cores before the engine does, and
        admission by the engine's load cannot be seen at work (docs/PERFORMANCE.md, "Overload")."""
        if "--final-model" not in extra:
            extra = (*extra, "--final-model", "off")
        self.port = free_port()
        self.metrics_port = free_port()
        self.args = [
            sys.executable,
            "-m",
            "cosystream",
            "--log-level",
            "WARNING",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--http-port",
            "0",
            *extra,
        ]
        self.process: subprocess.Popen | None = None
        self.engine_share = engine_share
        self.client_cpus: set[int] | None = None  # where the probe runs (None: anywhere)
        self._hogs: list[subprocess.Popen] = []
        if engine_share is not None:
            cpus = sorted(os.sched_getaffinity(0))
            hogs = round(1 / engine_share) - 1
            if len(cpus) < 2 or not 0 < engine_share <= 1 or hogs < 0:
                raise SystemExit(f"an engine share of {engine_share} needs 2+ CPUs and 0 < share <= 1")
            self._engine_cpu, self.client_cpus = cpus[-1], set(cpus[:-1])
            self._hog_count = hogs

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def __enter__(self) -> Server:
        self.log = tempfile.TemporaryFile()
        cpus = self.client_cpus
        self.process = subprocess.Popen(
            self.args,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )
        deadline = time.monotonic() + 180  # CUDA graphs for every bucket are captured before the port opens
        while time.monotonic() < deadline:
            with socket.socket() as s:  # the gRPC port opens once the engine is warm
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    if self.engine_share is not None:
                        self._confine_engine()
                    return self
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        self.log.seek(0)
        raise RuntimeError("server did not start:\n" + self.log.read().decode())

    def _confine_engine(self) -> None:
        """Move every thread of the engine process to the engine's CPU and start the busy loops beside it."""
        engines = [pid for pid in _descendants(self.process.pid) if _name(pid) == "cs-engine"]
        if len(engines) != 1:
            raise RuntimeError(f"expected one cs-engine process under the server, found {len(engines)}")
        engine = engines[0]
        for tid in os.listdir(f"/proc/{engine}/task"):
            os.sched_setaffinity(int(tid), {self._engine_cpu})
        nice = os.getpriority(os.PRIO_PROCESS, engine)
        cpu = self._engine_cpu

        def beside_the_engine() -> None:
            os.sched_setaffinity(0, {cpu})
            os.setpriority(os.PRIO_PROCESS, 0, nice)

        self._hogs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=beside_the_engine)
            for _ in range(self._hog_count)
        ]

    def __exit__(self, *exc) -> None:
        for hog in self._hogs:
            hog.kill()
            hog.wait()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def probe_command(server: Server, json_path: str, *args: str) -> list[str]:
    """The latency probe's command line against ``server``, writing its JSON to ``json_path``."""
    return [
        sys.executable,
        str(ROOT / "clients" / "latency_probe.py"),
        "--server",
        server.address,
        "--metrics-url",
        server.metrics_url,
        "--json",
        json_path,
        *args,
    ]


def run_probe(server: Server, json_path: str, *args: str) -> dict:
    """Run the latency probe against ``server`` in its own process (on the client CPUs when the server
    confines its engine), and return its JSON."""
    cpus = server.client_cpus
    subprocess.run(
        probe_command(server, json_path, *args),
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    return json.loads(Path(json_path).read_text())


def probe(server: Server, *args: str) -> tuple[dict, float]:
    """Run the latency probe in its own process; returns its JSON and the server's CPU seconds meanwhile."""
    result, cpu = probe_cpu(server, *args)
    return result, server_seconds(cpu)


def server_seconds(cpu: dict[str, float]) -> float:
    """The server's CPU seconds in :func:`probe_cpu`'s breakdown: the probe's own left out, and the background
    compiler's (a one-off, on cycles nothing else wanted: its own entry in the breakdown)."""
    return sum(seconds for name, seconds in cpu.items() if name not in ("probe", COMPILER))


def probe_cpu(server: Server, *args: str) -> tuple[dict, dict[str, float]]:
    """Like :func:`probe`, with the CPU seconds meanwhile of each server process by name, and the probe's
    own (all its processes) as ``probe``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        before = cpu_by_process(server.process.pid)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = run_probe(server, out.name, *args)
        after = cpu_by_process(server.process.pid)
        done = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = {name: seconds - before.get(name, 0.0) for name, seconds in after.items()}
        cpu["probe"] = done.ru_utime + done.ru_stime - children.ru_utime - children.ru_stime
        return result, cpu


_GPU_SAMPLE = re.compile(r"^cosystream_gpu_(\w+)\{([^}]*)\} (\S+)$", re.M)


def gpu_gauges(metrics_url: str) -> dict[str, dict]:
    """The server's GPU gauges by NVML index: ``{"0": {"name": ..., "memory_used_bytes": ...,
    "utilization_percent": ..., ..., "clocks_events": [the active reasons]}}``; {} where it has none (no
    NVML there). A gauge the device does not give is absent from its entry."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    gpus: dict[str, dict] = {}
    for metric, label_text, value in _GPU_SAMPLE.findall(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        gpu = gpus.setdefault(labels["gpu"], {"name": labels.get("name")})
        if metric == "clocks_event_reason":
            events = gpu.setdefault("clocks_events", [])
            if float(value):
                events.append(labels["reason"])
        else:
            gpu[metric] = float(value)
    return gpus


class GpuSample:
    """``with GpuSample(server, delay_s) as sample: <a run>``, then ``sample.gauges``: :func:`gpu_gauges` read
    once, ``delay_s`` into the run (mid-run: utilization is NVML's last second, not the idle after), or as
    the run ends if it ended sooner."""

    def __init__(self, server: Server, delay_s: float):
        self.metrics_url = server.metrics_url
        self.gauges: dict[str, dict] | None = None
        self._timer = threading.Timer(delay_s, self._read)

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # read again as the run ends, where a second failure raises
            self.gauges = gpu_gauges(self.metrics_url)

    def __enter__(self) -> GpuSample:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()
        self._timer.join()
        if self.gauges is None and exc[0] is None:
            self.gauges = gpu_gauges(self.metrics_url)


def p(entry: dict, metric: str, q: str = "p99") -> float:
    value = entry[metric][q]
    return float("nan") if value is None else value


def dump(result: dict, path: str | None) -> None:
    print(json.dumps(result, indent=2))
    if path:
        Path(path).write_text(json.dumps(result, indent=2))
