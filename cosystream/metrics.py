"""Prometheus metrics: the only module that imports ``prometheus_client``.

With several processes (frontends + engine), ``cosystream serve`` sets ``PROMETHEUS_MULTIPROC_DIR``
before any process starts; each process then writes its samples there and the supervisor's HTTP
endpoint aggregates them.

The supervisor's endpoint also serves the GPU gauges (``cosystream_gpu_*``), read through NVML at each scrape
by :class:`GpuCollector` (``cosystream/nvml.py``): no thread samples them and no engine records them.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator

from cosystream.nvml import GpuReading, Nvml, NvmlUnavailable

log = logging.getLogger(__name__)

STEP_BUCKETS_S = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SECOND_PASS_BUCKETS_S = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


@functools.cache
def _metrics() -> dict:
    """The process's metric objects by name, made once, on first use: importing this module imports no prometheus_client,
    so ``serve`` can set ``PROMETHEUS_MULTIPROC_DIR`` after reading its flags (prometheus_client reads it
    when it is imported)."""
    from prometheus_client import Counter, Gauge, Histogram

    ACTIVE_SESSIONS = Gauge(
        "cosystream_active_sessions", "Open sessions.", ["priority"], multiprocess_mode="livesum"
    )
    FRAMES = Counter("cosystream_frames", "10 ms frames stepped through the model.", ["priority"])
    STEP_SECONDS = Histogram("cosystream_step_seconds", "Model step time (runner.run).", buckets=STEP_BUCKETS_S)
    BATCH_SIZE = Histogram("cosystream_batch_size", "Sessions (rows) per model step.", buckets=BATCH_BUCKETS)
    DEADLINE_MISSES = Counter("cosystream_deadline_misses", "REALTIME frames stepped later than their deadline.")
    # Per served model name (serve --model NAME=DIR), and the adaptive fallback (serve --adaptive HEAVY=LIGHT).
    MODEL_SESSIONS = Gauge(
        "cosystream_model_sessions",
        "Sessions per model (every version of it).",
        ["model"],
        multiprocess_mode="livesum",
    )
    ADAPTIVE_FALLBACK = Gauge(
        "cosystream_adaptive_fallback",
        "1 while new utterances of this HEAVY model run on its LIGHT model (serve --adaptive).",
        ["model"],
        multiprocess_mode="livemax",
    )
    ADAPTIVE_SWITCHES = Counter(
        "cosystream_adaptive_switches", "Adaptive mode changes of this HEAVY model, by new mode.", ["model", "to"]
    )
    ENGINE_LOAD = Gauge(
        "cosystream_engine_load",
        "The engine's projected realtime load: busy share of its loop, LIGHT rows counted at HEAVY's cost.",
        ["engine"],
        multiprocess_mode="livemax",
    )
    COMPILED_SHAPES = Gauge(
        "cosystream_compiled_shapes",
        "(bucket, T) shapes of the model's step running compiled on a CPU engine (the rest run eager).",
        ["engine", "model"],
        multiprocess_mode="livemax",
    )
    ENGINE_OVERLOADED = Gauge(
        "cosystream_engine_overloaded",
        "1 while the projected realtime load has stayed at or over serve --admit-load (engine/headroom.py).",
        ["engine"],
        multiprocess_mode="livemax",
    )
    DEGRADATION = Gauge(
        "cosystream_engine_degradation",
        "What the engine sheds under realtime pressure (engine/headroom.py): 0 nothing, 1 BATCH squeezed, "
        "2 and interims thinned, 3 and new realtime sessions refused.",
        ["engine"],
        multiprocess_mode="livemax",
    )
    REFUSED_FOR_LOAD = Counter(
        "cosystream_engine_refused_for_load",
        "New REALTIME sessions refused because one more would have passed the load limit (RetryInfo sent).",
        ["engine"],
    )
    # Per engine process (serve --engines, --device cuda:all): "0" when there is one.
    ENGINE_SESSIONS = Gauge(
        "cosystream_engine_sessions",
        "Sessions holding a slot, per engine.",
        ["engine"],
        multiprocess_mode="livesum",
    )
    RESULT_LATENCY = Histogram(
        "cosystream_result_latency_seconds",
        "From receiving the audio that completed a frame to sending the result it produced.",
        ["priority"],
        buckets=LATENCY_BUCKETS_S,
    )
    FIRST_RESULT_LATENCY = Histogram(
        "cosystream_first_result_latency_seconds",
        "From receiving an utterance's first speech frame to sending its first non-empty result.",
        buckets=LATENCY_BUCKETS_S,
    )
    REJECTED = Counter("cosystream_rejected_sessions", "Sessions refused or ended early.", ["reason"])
    # Per token name (serve --auth-tokens; the name, never the token).
    TOKEN_SESSIONS = Gauge(
        "cosystream_token_sessions", "Open sessions per token.", ["token"], multiprocess_mode="livesum"
    )
    TOKEN_REFUSED = Counter(
        "cosystream_token_refused_sessions", "Sessions of a known token refused, by reason.", ["token", "reason"]
    )
    TOKEN_AUDIO = Counter(
        "cosystream_token_audio_seconds",
        "Audio received per token with usage limits (max_audio_s_per_min / _per_day), counted as its streams end.",
        ["token"],
    )
    # The HTTP port (serve --http-port).
    HTTP_REQUESTS = Counter(
        "cosystream_http_requests", "HTTP requests answered, by route and status.", ["route", "status"]
    )
    WEBSOCKETS = Gauge(
        "cosystream_websocket_sessions", "Realtime WebSocket connections open.", multiprocess_mode="livesum"
    )
    # Resumable sessions (StreamingConfig.resumable) whose connection dropped: resumed, or freed after the window.
    SESSIONS_RESUMED = Counter("cosystream_sessions_resumed", "Held sessions a client resumed.")
    SESSIONS_EXPIRED = Counter(
        "cosystream_sessions_expired", "Held sessions freed because no client resumed them within the window."
    )
    RESUMES_FORWARDED = Counter(
        "cosystream_resumes_forwarded",
        "Resumes that reached this frontend for a session another frontend of the server holds, passed on to it.",
    )
    # The second pass (serve --final-model), per frontend process.
    SECOND_PASS_JOBS = Counter(
        "cosystream_second_pass_jobs",
        "Utterances offered to the second pass, by outcome: used (its text is the final), gated (it answered, "
        "the streaming final stands), late, failed, cancelled, refused (queue full or off).",
        ["outcome"],
    )
    SECOND_PASS_EARLY = Counter(
        "cosystream_second_pass_early",
        "Utterances read early, at a pause before their end (serve --final-early-ms), by outcome: kept (the "
        "utterance ended on that pause: the read is its final's) or dropped (the speech went on).",
        ["outcome"],
    )
    SECOND_PASS_SECONDS = Histogram(
        "cosystream_second_pass_seconds",
        "From an utterance queued for the second pass to its answer (used or gated).",
        buckets=SECOND_PASS_BUCKETS_S,
    )
    SECOND_PASS_BATCH = Histogram(
        "cosystream_second_pass_batch_size", "Utterances read in one second-pass call.", buckets=BATCH_BUCKETS[:6]
    )
    return dict(locals())


PRIORITIES = ("realtime", "batch")
REJECT_REASONS = (
    "full",
    "shed",
    "overloaded",
    "invalid_argument",
    "draining",
    "idle_timeout",
    "unauthenticated",
    "permission_denied",
    "quota",
    "usage_quota",
    "resume_not_found",
    "resume_refused",
)


class EngineMetrics:
    """What the engine process records per step."""

    def __init__(self, engine: str = "0") -> None:
        self._m = _metrics()
        self.engine = engine
        for priority in PRIORITIES:  # every series exists from start-up, at 0
            self._m["FRAMES"].labels(priority)
            self._m["ACTIVE_SESSIONS"].labels(priority).set(0)
        self._m["ENGINE_SESSIONS"].labels(engine).set(0)
        self._m["DEGRADATION"].labels(engine).set(0)

    def observe_step(self, priority: str, rows: int, frames: int, seconds: float, deadline_misses: int) -> None:
        self._m["FRAMES"].labels(priority).inc(rows * frames)
        self._m["STEP_SECONDS"].observe(seconds)
        self._m["BATCH_SIZE"].observe(rows)
        if deadline_misses:
            self._m["DEADLINE_MISSES"].inc(deadline_misses)

    def set_active(self, counts: dict[str, int]) -> None:
        for priority, count in counts.items():
            self._m["ACTIVE_SESSIONS"].labels(priority).set(count)
        self._m["ENGINE_SESSIONS"].labels(self.engine).set(sum(counts.values()))

    def set_model_sessions(self, counts: dict[str, int]) -> None:
        for model, count in counts.items():
            self._m["MODEL_SESSIONS"].labels(model).set(count)

    def set_fallback(self, heavy: str, light: bool) -> None:
        self._m["ADAPTIVE_FALLBACK"].labels(heavy).set(1 if light else 0)

    def observe_adaptive(self, heavy: str, light: bool) -> None:
        self.set_fallback(heavy, light)
        self._m["ADAPTIVE_SWITCHES"].labels(heavy, "light" if light else "heavy").inc()

    def set_load(self, load: float) -> None:
        self._m["ENGINE_LOAD"].labels(self.engine).set(load)

    def set_compiled_shapes(self, model: str, count: int) -> None:
        self._m["COMPILED_SHAPES"].labels(self.engine, model).set(count)

    def set_overloaded(self, overloaded: bool) -> None:
        self._m["ENGINE_OVERLOADED"].labels(self.engine).set(int(overloaded))

    def set_degradation(self, stage: int) -> None:
        self._m["DEGRADATION"].labels(self.engine).set(stage)

    def refused_for_load(self) -> None:
        self._m["REFUSED_FOR_LOAD"].labels(self.engine).inc()


class FrontendMetrics:
    """What a frontend process records per session and response."""

    def __init__(self) -> None:
        self._m = _metrics()
        for priority in PRIORITIES:
            self._m["RESULT_LATENCY"].labels(priority)
        for reason in REJECT_REASONS:
            self._m["REJECTED"].labels(reason)

    def observe_result(self, priority: str, seconds: float) -> None:
        self._m["RESULT_LATENCY"].labels(priority).observe(seconds)

    def observe_first_result(self, seconds: float) -> None:
        self._m["FIRST_RESULT_LATENCY"].observe(seconds)

    def rejected(self, reason: str, token: str | None = None) -> None:
        """A refused or cut session; ``token``: the name of the token it came with (auth on)."""
        self._m["REJECTED"].labels(reason).inc()
        if token is not None:
            self._m["TOKEN_REFUSED"].labels(token, reason).inc()

    def http_request(self, route: str, status: int) -> None:
        """An HTTP request answered; ``route`` is its route's pattern (``unmatched`` for none)."""
        self._m["HTTP_REQUESTS"].labels(route, str(status)).inc()

    def websocket(self, opened: bool) -> None:
        gauge = self._m["WEBSOCKETS"]
        gauge.inc() if opened else gauge.dec()

    def resumed(self) -> None:
        self._m["SESSIONS_RESUMED"].inc()

    def expired(self) -> None:
        self._m["SESSIONS_EXPIRED"].inc()

    def forwarded(self) -> None:
        self._m["RESUMES_FORWARDED"].inc()

    def token_audio(self, token: str, seconds: float) -> None:
        """A stream of ``token`` (one with usage limits) ended, having sent ``seconds`` of audio."""
        self._m["TOKEN_AUDIO"].labels(token).inc(seconds)

    def token_session(self, token: str, opened: bool) -> None:
        """A session of ``token`` opened (or, ``opened=False``, ended)."""
        gauge = self._m["TOKEN_SESSIONS"].labels(token)
        gauge.inc() if opened else gauge.dec()


SECOND_PASS_OUTCOMES = ("used", "gated", "late", "failed", "cancelled", "refused")


class SecondPassMetrics:
    """A frontend's second pass (``cosystream.secondpass.worker.SecondPassObserver``)."""

    def __init__(self) -> None:
        self._m = _metrics()
        for outcome in SECOND_PASS_OUTCOMES:
            self._m["SECOND_PASS_JOBS"].labels(outcome)
        for outcome in ("kept", "dropped"):
            self._m["SECOND_PASS_EARLY"].labels(outcome)

    def job_ended(self, outcome: str, seconds: float) -> None:
        self._m["SECOND_PASS_JOBS"].labels(outcome).inc()
        if outcome in ("used", "gated"):
            self._m["SECOND_PASS_SECONDS"].observe(seconds)

    def batch_read(self, size: int, seconds: float) -> None:
        self._m["SECOND_PASS_BATCH"].observe(size)

    def early_ended(self, kept: bool) -> None:
        self._m["SECOND_PASS_EARLY"].labels("kept" if kept else "dropped").inc()


# Per GPU, labels gpu (NVML's index), name and uuid: (name, help, GpuReading field).
GPU_GAUGES = (
    (
        "cosystream_gpu_memory_used_bytes",
        "Device memory in use, by every process on the GPU.",
        "memory_used_bytes",
    ),
    ("cosystream_gpu_memory_total_bytes", "Device memory in all.", "memory_total_bytes"),
    (
        "cosystream_gpu_utilization_percent",
        "Share of NVML's last sample period (1/6 to 1 s) in which a kernel ran on the GPU.",
        "utilization_percent",
    ),
    (
        "cosystream_gpu_memory_utilization_percent",
        "Share of NVML's last sample period in which device memory was read or written.",
        "memory_utilization_percent",
    ),
    ("cosystream_gpu_temperature_celsius", "GPU die temperature.", "temperature_celsius"),
    ("cosystream_gpu_power_watts", "Power drawn by the board.", "power_watts"),
    ("cosystream_gpu_power_limit_watts", "The power limit the driver enforces.", "power_limit_watts"),
)
GPU_CLOCKS_EVENT = "cosystream_gpu_clocks_event_reason"
GPU_LABELS = ("gpu", "name", "uuid")


class GpuCollector:
    """The GPU gauges, read through NVML when ``/metrics`` is scraped (a prometheus_client custom collector).
    A field a device does not give is left out of that device's series; a read that fails altogether leaves
    out the GPU series of that scrape, never the scrape."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self._failed = False

    def describe(self) -> Iterator:
        return self._families([])  # the names, for the registry's check against clashes

    def collect(self) -> Iterator:
        try:
            readings = self.nvml.read()
        except Exception:
            if not self._failed:  # once: a GPU in trouble would say it at every scrape
                log.exception("GPU gauges: reading NVML failed; they are left out while it fails")
            self._failed = True
            readings = []
        return (family for family in self._families(readings) if family.samples)

    @staticmethod
    def _families(readings: list[GpuReading]) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily

        for name, help_text, field in GPU_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=GPU_LABELS)
            for reading in readings:
                value = getattr(reading, field)
                if value is not None:
                    family.add_metric([str(reading.index), reading.name, reading.uuid], value)
            yield family
        family = GaugeMetricFamily(
            GPU_CLOCKS_EVENT,
            "1 while NVML gives this reason for the GPU's current clocks (clocks event reasons, formerly throttle "
            "reasons: sw_power_cap, hw_thermal_slowdown, ...; gpu_idle when idle).",
            labels=(*GPU_LABELS, "reason"),
        )
        for reading in readings:
            for reason, active in (reading.active_clocks_events() or {}).items():
                family.add_metric([str(reading.index), reading.name, reading.uuid, reason], int(active))
        yield family


def gpu_collector() -> GpuCollector | None:
    """The GPU gauges' collector, or None with one INFO line saying why there are none."""
    try:
        nvml = Nvml()
    except NvmlUnavailable as err:
        log.info("GPU gauges: none on /metrics (%s)", err)
        return None
    log.info("GPU gauges on /metrics: %s", nvml.describe())
    return GpuCollector(nvml)


def serve_metrics(port: int, host: str = "0.0.0.0", gpu_gauges: bool = True) -> None:
    """Expose ``/metrics`` on ``port`` (aggregating all processes when in multiprocess mode), with the GPU
    gauges unless ``gpu_gauges`` is False or NVML has nothing to read."""
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess, start_http_server

    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    start_http_server(port, addr=host, registry=registry)
    # After the bind: a busy port fails first, with its one line and nothing before it.
    collector = gpu_collector() if gpu_gauges else None
    if collector is not None:
        registry.register(collector)


def process_exited(pid: int) -> None:
    """Drop a dead process's live gauges (multiprocess mode)."""
    from prometheus_client import multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(pid)
