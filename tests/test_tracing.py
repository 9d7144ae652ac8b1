"""Per-utterance traces (``serve --otlp-endpoint``, ``cosystream/frontend/tracing.py``): the spans' names,
parents and timings through the SDK's in-memory exporter on an in-process server, a client's ``traceparent``
followed, and a real ``cosystream serve`` exporting OTLP/HTTP to a collector on loopback."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cosystream.frontend.tracing import TracingConfig, start_tracing
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import Served, local_server
from tests.speech import encode, needs_espeak, silence, speech
from tests.test_server import check_event_contract, config

STAGES = {"receive", "vad", "queue", "step", "decode", "send"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def two_utterances() -> bytes:
    audio = [speech("the quick brown fox"), silence(1.0), speech("jumps over the lazy dog"), silence(1.0)]
    return encode(np.concatenate(audio), "LINEAR16")


def stream(stub, audio: bytes, metadata=()) -> list:
    def requests():
        yield config(interim_results=True)
        for offset in range(0, len(audio), 3200):
            yield pb.StreamingRecognizeRequest(audio=audio[offset : offset + 3200])

    return list(stub.StreamingRecognize(requests(), timeout=60, metadata=metadata))


def by_utterance(spans) -> dict[int, dict[str, object]]:
    """Each traced utterance's spans by name (its root as "utterance")."""
    roots = {s.context.span_id: s for s in spans if s.name == "utterance"}
    found: dict[int, dict[str, object]] = {}
    for root in roots.values():
        children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
        found[root.attributes["cosystream.utterance_index"]] = {"utterance": root, **children}
    return found


@contextmanager
def traced_server(sample: float) -> Iterator[tuple[pb_grpc.CosyStreamStub, list]]:
    """An in-process server whose frontend traces to the SDK's in-memory exporter; the list holds the
    finished spans once the block ends."""
    exporter, spans = InMemorySpanExporter(), []
    with local_server() as server:
        tracer = start_tracing(TracingConfig("http://127.0.0.1:9/v1/traces", sample=sample), exporter)
        server.frontend.servicer.tracer = tracer
        try:
            with grpc.insecure_channel(server.address) as channel:
                yield pb_grpc.CosyStreamStub(channel), spans
        finally:
            tracer.provider.force_flush()
            spans += exporter.get_finished_spans()
            server.frontend.servicer.tracer = None
            tracer.shutdown()


@needs_espeak
def test_each_utterance_is_a_trace_of_its_stages_in_order():
    with traced_server(1.0) as (stub, spans):
        responses = stream(stub, two_utterances())
    finals = check_event_contract(responses)
    assert len(finals) == 2 and "lazy dog" in finals[1].transcript, finals
    utterances = by_utterance(spans)
    assert sorted(utterances) == [0, 1], [s.name for s in spans]
    for index, named in utterances.items():
        root = named["utterance"]
        assert set(named) == STAGES | {"utterance"}, sorted(named)
        assert all(s.context.trace_id == root.context.trace_id for s in named.values())
        assert root.parent is None  # (no traceparent: a trace of its own)
        attributes = root.attributes
        assert attributes["cosystream.session_id"] == responses[0].session_id
        assert (
            attributes["cosystream.priority"] == "realtime" and attributes["cosystream.final_pass"] == "streaming"
        )
        assert attributes["cosystream.words"] == len(finals[index].transcript.split())
        assert attributes["cosystream.audio_ms"] == finals[index].end_ms - finals[index].start_ms
        assert named["vad"].attributes["cosystream.endpoint"] == "silence"
        assert named["step"].attributes["cosystream.steps"] >= 1
        assert named["queue"].attributes["cosystream.queue_max_ms"] >= 0
        # Inside the utterance, and in the order of its final's path: endpoint, engine, decode, send.
        for span in named.values():
            assert root.start_time <= span.start_time <= span.end_time <= root.end_time, span.name
        assert named["vad"].end_time <= named["queue"].start_time <= named["step"].start_time
        assert named["step"].end_time <= named["decode"].start_time <= named["decode"].end_time
        assert named["decode"].end_time <= named["send"].start_time
        assert named["send"].end_time == root.end_time
    first, second = utterances[0]["utterance"], utterances[1]["utterance"]
    assert first.context.trace_id != second.context.trace_id and first.start_time < second.start_time


@needs_espeak
def test_a_clients_sampled_traceparent_is_followed_and_unsampled_utterances_cost_no_span():
    audio = two_utterances()
    with traced_server(0.0) as (stub, spans):
        stream(stub, audio)  # sampled at 0: nothing
        stream(stub, audio, metadata=[("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01")])
        stream(stub, audio, metadata=[("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-00")])  # not sampled
    utterances = by_utterance(spans)
    assert sorted(utterances) == [0, 1] and len(spans) == 2 * (len(STAGES) + 1)
    for named in utterances.values():
        root = named["utterance"]
        assert f"{root.context.trace_id:032x}" == TRACE_ID and f"{root.parent.span_id:016x}" == PARENT_ID


class Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace collector on loopback: the export requests it was sent, decoded."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.requests: list = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf":
                    collector.requests.append(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def spans(self) -> list[tuple[str, dict, object]]:
        """(service.name, span) for every span received."""
        found = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    found += [(resource.get("service.name"), span) for span in scope.spans]
        return found


@needs_espeak
def test_a_real_server_exports_its_utterances_spans_over_otlp():
    collector = Collector()
    try:
        with Served("--frontends", "1", "--otlp-endpoint", collector.url, "--trace-sample", "1") as served:
            finals = check_event_contract(stream(served.stub(), two_utterances()))
            assert len(finals) == 2
            deadline = time.monotonic() + 20  # (spans are batched: sent every few seconds)
            while len([s for _, s in collector.spans() if s.name == "utterance"]) < 2:
                assert time.monotonic() < deadline, collector.spans()
                time.sleep(0.2)
    finally:
        collector.shutdown()
    spans = collector.spans()
    assert {service for service, _ in spans} == {"cosystream"}
    roots = [s for _, s in spans if s.name == "utterance"]
    for root in roots:
        children = {s.name for _, s in spans if s.parent_span_id == root.span_id}
        assert children == STAGES and root.end_time_unix_nano > root.start_time_unix_nano
    assert abs(roots[0].start_time_unix_nano / 1e9 - time.time()) < 120  # (epoch times, not monotonic ones)
