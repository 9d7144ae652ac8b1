"""Random request sequences against a live server (an engine process, a frontend, real gRPC on loopback):
every stream ends with a defined status, never INTERNAL or UNKNOWN; a well-formed stream that half-closes
ends OK; the server keeps serving; no slot is leaked."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cosystream.v1 import cosystream_pb2 as pb
from tests.conftest import speech_like
from tests.servers import local_server

DEFINED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
}
SPEECH = (np.clip(speech_like(3.0, seed=5), -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def server():
    with local_server(max_sessions=3, max_message_bytes=1 << 20, idle_timeout_s=2.0) as srv:
        yield srv


valid_config = st.builds(
    lambda encoding, rate, priority, interim, words: pb.StreamingRecognizeRequest(
        config=pb.StreamingConfig(
            encoding=encoding,
            sample_rate_hz=rate,
            priority=priority,
            interim_results=interim,
            enable_word_time_offsets=words,
        )
    ),
    st.sampled_from([pb.LINEAR16, pb.MULAW, pb.ALAW, pb.AUDIO_ENCODING_UNSPECIFIED]),
    st.sampled_from([8000, 16000, 22050, 44100, 48000]),
    st.sampled_from([pb.REALTIME, pb.BATCH, pb.PRIORITY_UNSPECIFIED]),
    st.booleans(),
    st.booleans(),
)
bad_first = st.sampled_from(
    [
        pb.StreamingRecognizeRequest(config=pb.StreamingConfig(sample_rate_hz=0)),
        pb.StreamingRecognizeRequest(config=pb.StreamingConfig(sample_rate_hz=7, encoding=9)),
        pb.StreamingRecognizeRequest(config=pb.StreamingConfig(sample_rate_hz=16000, model="nope")),
        pb.StreamingRecognizeRequest(audio=b"\x01\x02"),
        pb.StreamingRecognizeRequest(),
    ]
)
speech_audio = st.builds(
    lambda start, size: pb.StreamingRecognizeRequest(audio=SPEECH[start : start + size]),
    st.integers(0, len(SPEECH) - 1),
    st.integers(1, 6000),
)
random_audio = st.binary(min_size=0, max_size=3000).map(lambda b: pb.StreamingRecognizeRequest(audio=b))
finalize = st.just(pb.StreamingRecognizeRequest(control=pb.Control(type=pb.Control.FINALIZE)))
well_formed = st.one_of(speech_audio, random_audio, finalize)
malformed = st.sampled_from(
    [
        pb.StreamingRecognizeRequest(control=pb.Control(type=99)),
        pb.StreamingRecognizeRequest(config=pb.StreamingConfig(sample_rate_hz=16000)),
        pb.StreamingRecognizeRequest(),
    ]
)


@st.composite
def streams(draw):
    valid = draw(st.integers(0, 3)) > 0
    first = draw(valid_config if valid else bad_first)
    rest = draw(st.lists(st.one_of(well_formed, well_formed, well_formed, malformed), max_size=25))
    ending = draw(st.sampled_from(["half-close", "half-close", "cancel"]))
    cancel_after_s = draw(st.floats(0.0, 0.3))
    return first, valid, rest, ending, cancel_after_s


def run_stream(stub, first, rest, ending: str, cancel_after_s: float):
    """Send the requests; half-close or cancel; the status and responses."""
    done = threading.Event()

    def requests():
        yield first
        yield from rest
        if ending == "cancel":
            done.wait(5)  # keep the stream open until it is cancelled

    call = stub.StreamingRecognize(requests(), timeout=30)
    if ending == "cancel":
        threading.Timer(cancel_after_s, call.cancel).start()
    responses = []
    try:
        for response in call:
            responses.append(response)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
    done.set()
    return code, responses


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(streams())
def test_random_streams_end_with_a_defined_status_and_leak_nothing(server, stub, stream):
    first, valid, rest, ending, cancel_after_s = stream
    code, responses = run_stream(stub, first, rest, ending, cancel_after_s)
    assert code in DEFINED, (code, first, rest, ending)
    clean = valid and not any(r.HasField("config") or r.WhichOneof("request") is None for r in rest)
    clean = clean and not any(r.HasField("control") and r.control.type != pb.Control.FINALIZE for r in rest)
    if clean and ending == "half-close":
        assert code == grpc.StatusCode.OK, code
        kinds = [r.speech_event.type for r in responses if r.HasField("speech_event")]
        finals = [res for r in responses for res in r.results if res.is_final]
        assert (
            kinds.count(pb.SpeechEvent.SPEECH_STARTED) == kinds.count(pb.SpeechEvent.SPEECH_ENDED) == len(finals)
        )
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        assert responses and responses[-1].error.code == code.value[0], "no status response before the error"
    deadline = time.monotonic() + 10
    while server.frontend.servicer.active_streams or server.frontend.engine.active_sessions:
        assert time.monotonic() < deadline, "a slot is still held after the stream ended"
        time.sleep(0.02)


def test_the_server_still_serves_after_the_fuzzing(stub):
    requests = [
        pb.StreamingRecognizeRequest(config=pb.StreamingConfig(sample_rate_hz=16000)),
        *(pb.StreamingRecognizeRequest(audio=SPEECH[i : i + 3200]) for i in range(0, len(SPEECH), 3200)),
    ]
    responses = list(stub.StreamingRecognize(iter(requests), timeout=30))
    assert any(r.results and r.results[0].is_final for r in responses)
