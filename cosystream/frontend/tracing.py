"""Per-utterance traces: OpenTelemetry spans of where an utterance's time went, exported over OTLP.

``serve --otlp-endpoint URL`` (OTLP over HTTP/protobuf, e.g. ``http://collector:4318/v1/traces``) turns it
on, ``--trace-sample`` says which share of utterances is traced (0.01: one in a hundred; a client's sampled
W3C ``traceparent`` in the stream's metadata is always followed). Off, the default, costs nothing: no
OpenTelemetry import, one ``is None`` test per utterance and per engine result.

One trace per utterance, its spans (times in the frontend's clock; the engine shares the host's monotonic
clock, but its queue and step times are what it reports with the results, placed to end when they arrive,
so the hop back over the engine's socket is in neither)::

    utterance      from its first audio received to its final handed to the transport
      receive      its audio arriving: the first chunk to the last one before the endpoint
      vad          the speech detector: from the onset detected to the endpoint decided (silence, FINALIZE,
                   half-close, length limit: "silence", "finalize", "max_length")
      queue        the engine queue wait of its last step (attributes: steps, the total and the longest)
      step         the compute of its last step (attributes: the total over its steps)
      decode       the final's decoding (the search's end, the n-best, the words)
      second_pass  waiting for the second pass's final (serve --final-model), when it ran
      send         the final built to handed to the stream's response queue

The attributes say which session, model and pass; never what was said.

The OpenTelemetry SDK and exporter are the ``tracing`` extra (``pip install 'cosystream[tracing]'``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

TRACE_SAMPLE = 0.01
"""The share of utterances traced by default once ``--otlp-endpoint`` is given (``--trace-sample``)."""
SERVICE_NAME = "cosystream"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """``serve --otlp-endpoint`` and ``--trace-sample``."""

    endpoint: str
    sample: float = TRACE_SAMPLE

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"--otlp-endpoint must be an http:// or https:// URL (OTLP/HTTP), got {self.endpoint!r}"
            )
        if not 0 <= self.sample <= 1:
            raise ValueError(f"--trace-sample must be between 0 and 1, got {self.sample:g}")


def tracing_available() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def start_tracing(config: TracingConfig, exporter=None) -> UtteranceTracer:
    """This process's tracer: spans batched off the event loop (the SDK's worker thread) to ``exporter``
    (None: OTLP/HTTP to ``config.endpoint``). Raises ImportError naming the extra when it is not installed."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as err:
        raise ImportError(
            f"--otlp-endpoint needs the OpenTelemetry SDK: pip install 'cosystream[tracing]' ({err})"
        ) from err
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.endpoint)
    from cosystream import __version__

    provider = TracerProvider(
        resource=Resource.create({"service.name": SERVICE_NAME, "service.version": __version__}),
        sampler=ParentBased(TraceIdRatioBased(config.sample)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return UtteranceTracer(provider)


class UtteranceTracer:
    """Starts an :class:`UtteranceTrace` per utterance; :meth:`shutdown` sends what is batched."""

    def __init__(self, provider):
        from opentelemetry import propagate, trace

        self.provider = provider
        self._tracer = provider.get_tracer("cosystream.server")
        self._trace, self._propagate = trace, propagate
        # Monotonic seconds (the sessions' clock) to the epoch nanoseconds spans carry.
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def parent(self, metadata: dict[str, str] | None):
        """The context a client's W3C ``traceparent`` (and ``tracestate``) names, or None."""
        if not metadata or "traceparent" not in metadata:
            return None
        return self._propagate.extract(metadata)

    def start(self, started_s: float, attributes: dict, parent=None) -> UtteranceTrace | None:
        """A new utterance's trace from ``started_s`` (monotonic), or None when it is not sampled."""
        span = self._tracer.start_span(
            "utterance", context=parent, start_time=self.ns(started_s), attributes=attributes
        )
        if not span.is_recording():
            return None
        return UtteranceTrace(self, span, started_s)

    def ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def child(self, parent_span, name: str, start_s: float, end_s: float, attributes: dict | None = None) -> None:
        ctx = self._trace.set_span_in_context(parent_span)
        span = self._tracer.start_span(name, context=ctx, start_time=self.ns(start_s), attributes=attributes)
        span.end(end_time=self.ns(max(end_s, start_s)))

    def shutdown(self) -> None:
        self.provider.shutdown()  # (flushes the batch)


class UtteranceTrace:
    """What one sampled utterance records as it goes; its spans are made when its final is sent."""

    __slots__ = (
        "_compute_total_s",
        "_decode",
        "_last_step",
        "_queue_max_s",
        "_queue_total_s",
        "_steps",
        "_tracer",
        "ended_s",
        "held",
        "last_audio_s",
        "reason",
        "span",
        "started_s",
    )

    def __init__(self, tracer: UtteranceTracer, span, started_s: float):
        self._tracer, self.span, self.started_s = tracer, span, started_s
        self.last_audio_s = started_s  # (its first audio is the onset's chunk: started_s)
        self.ended_s: float | None = None  # the endpoint decided
        self.reason = ""
        self.held = False  # its final waited for the second pass
        self._steps = 0
        self._queue_total_s = self._queue_max_s = self._compute_total_s = 0.0
        self._last_step: tuple[float, float, float] | None = None  # (queue_s, compute_s, results arrived)
        self._decode: tuple[float, float] | None = None

    @staticmethod
    def attributes(session_id: str, index: int, priority: str, model: str) -> dict:
        """The root span's attributes known when the utterance starts."""
        return {
            "cosystream.session_id": session_id,
            "cosystream.utterance_index": index,
            "cosystream.priority": priority,
            "cosystream.model": model,
        }

    def audio(self, received_s: float) -> None:
        """Frames of the utterance's audio, from a chunk received at ``received_s``."""
        self.last_audio_s = max(self.last_audio_s, received_s)

    def step(self, queue_s: float, compute_s: float, arrived_s: float) -> None:
        self._steps += 1
        self._queue_total_s += queue_s
        self._queue_max_s = max(self._queue_max_s, queue_s)
        self._compute_total_s += compute_s
        self._last_step = (queue_s, compute_s, arrived_s)

    def endpoint(self, reason: str, decided_s: float) -> None:
        self.reason, self.ended_s = reason, decided_s

    def decoded(self, start_s: float, end_s: float) -> None:
        self._decode = (start_s, end_s)

    def sent(self, ready_s: float, sent_s: float, final) -> None:
        """The ``final`` (a ``StreamingResult``) was handed on at ``sent_s``, ready at ``ready_s``: every span
        is made and ended."""
        child, root = self._tracer.child, self.span
        ended = self.ended_s if self.ended_s is not None else self.last_audio_s
        child(root, "receive", self.started_s, min(self.last_audio_s, ended))
        child(root, "vad", self.started_s, ended, {"cosystream.endpoint": self.reason})
        if self._last_step is not None:
            queue_s, compute_s, arrived_s = self._last_step
            totals = {"cosystream.steps": self._steps}
            child(
                root,
                "queue",
                arrived_s - compute_s - queue_s,
                arrived_s - compute_s,
                totals
                | {
                    "cosystream.queue_total_ms": round(self._queue_total_s * 1e3, 3),
                    "cosystream.queue_max_ms": round(self._queue_max_s * 1e3, 3),
                },
            )
            child(
                root,
                "step",
                arrived_s - compute_s,
                arrived_s,
                totals | {"cosystream.compute_total_ms": round(self._compute_total_s * 1e3, 3)},
            )
        decode_end = ready_s
        if self._decode is not None:
            child(root, "decode", *self._decode)
            decode_end = self._decode[1]
        if self.held:
            child(root, "second_pass", decode_end, ready_s)
        child(root, "send", ready_s, sent_s)
        root.set_attributes(
            {
                "cosystream.model_version": final.model_version,
                "cosystream.final_pass": final.final_pass,
                "cosystream.audio_ms": final.end_ms - final.start_ms,
                "cosystream.words": len(final.transcript.split()),
            }
        )
        root.end(end_time=self._tracer.ns(sent_s))

    def abandon(self, why: str, now_s: float) -> None:
        """The stream ended before the utterance's final was sent."""
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, why))
        self.span.end(end_time=self._tracer.ns(now_s))
