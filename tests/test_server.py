"""End-to-end over real gRPC on loopback: an engine process and a frontend, speech from espeak-ng.

The model here may be untrained, so these tests pin the protocol (events, finals, errors, slots), not
the words; recognition quality is measured by the accuracy benchmark.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import threading
import time
import weakref

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cosystream.decoding.beam import BeamConfig
from cosystream.decoding.config import DecoderConfig
from cosystream.frontend.session import Session
from cosystream.models.loading import DEFAULT_MODEL_DIR
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import HeldStream, local_server
from tests.speech import encode, needs_espeak, silence, speech

pytestmark = needs_espeak

MAX_SESSIONS = 4
SENTENCE = "the quick brown fox jumps over the lazy dog"
OTHER = "please call me back tomorrow morning"


@pytest.fixture(scope="module")
def server():
    with local_server(max_sessions=MAX_SESSIONS, max_message_bytes=256 << 10) as srv:
        yield srv


def config(rate_hz=16000, encoding=pb.LINEAR16, **kwargs) -> pb.StreamingRecognizeRequest:
    return pb.StreamingRecognizeRequest(
        config=pb.StreamingConfig(encoding=encoding, sample_rate_hz=rate_hz, **kwargs)
    )


def audio_requests(data: bytes, chunk_bytes: int, pace_s: float = 0.0):
    for offset in range(0, len(data), chunk_bytes):
        if pace_s:
            time.sleep(pace_s)
        yield pb.StreamingRecognizeRequest(audio=data[offset : offset + chunk_bytes])


def run_stream(stub, first, data: bytes, chunk_bytes: int = 3200, extra=(), pace_s: float = 0.0):
    def requests():
        yield first
        yield from audio_requests(data, chunk_bytes, pace_s)
        yield from extra

    return list(stub.StreamingRecognize(requests(), timeout=60))


def check_event_contract(responses) -> list[pb.StreamingResult]:
    """Assert the event contract of the proto's comments; return the finals in order."""
    state, index, finals = "idle", 0, []
    session_ids = {r.session_id for r in responses}
    assert len(session_ids) <= 1 and "" not in session_ids
    last_interim, stable = "", True
    for response in responses:
        assert response.HasField("latency")
        if response.HasField("speech_event"):
            kind = response.speech_event.type
            if kind == pb.SpeechEvent.SPEECH_STARTED:
                assert state == "idle", f"SPEECH_STARTED while {state}"
                state, last_interim = "speaking", ""
            else:
                assert kind == pb.SpeechEvent.SPEECH_ENDED and state == "speaking", f"SPEECH_ENDED while {state}"
                state = "ended"
        for result in response.results:
            assert result.utterance_index == index
            if result.is_final:
                assert state == "ended", f"final while {state}"
                assert result.stability == 1.0
                if stable:
                    assert result.transcript.startswith(last_interim)
                finals.append(result)
                state, index, stable = "idle", index + 1, True
            else:
                assert state == "speaking", f"interim while {state}"
                assert result.stability in (0.5, 1.0)
                # Greedy interims (stability 1) only grow; beam-search interims (0.5) may revise words.
                stable = stable and result.stability == 1.0
                if stable:
                    assert result.transcript.startswith(last_interim), "an interim must extend the previous one"
                assert result.transcript != last_interim, "interims only when the text changes"
                last_interim = result.transcript
    assert state == "idle", f"stream ended while {state}"
    return finals


def started_offsets(responses) -> list[int]:
    return [
        r.speech_event.offset_ms
        for r in responses
        if r.HasField("speech_event") and r.speech_event.type == pb.SpeechEvent.SPEECH_STARTED
    ]


# --- the happy paths ------------------------------------------------------------------------------


def test_partials_then_final(stub):
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    responses = run_stream(stub, config(interim_results=True, enable_word_time_offsets=True), data)
    finals = check_event_contract(responses)
    assert len(finals) == 1
    interims = [res for r in responses for res in r.results if not res.is_final]
    assert interims, "interim results were asked for"
    final = finals[0]
    assert 200 <= final.start_ms <= 500 and final.end_ms > final.start_ms + 1000
    assert final.stability == 1.0 and 0.0 <= final.confidence <= 1.0
    assert [w.word for w in final.words] == final.transcript.split()
    assert all(w.start_ms < w.end_ms for w in final.words)
    # The embedded model ships a language model, so the server runs beam search: interims may be revised.
    assert {res.stability for res in interims} == {0.5}


def letter_model(directory) -> str:
    """The default model's network over letters, with seeded random weights (greedy-decodable, untrained),
    saved with them (a directory without weights is refused)."""
    from tests.test_models_multi import build_letter_model

    return build_letter_model(directory)


@pytest.mark.parametrize("decoding", ["beam-size-1", "greedy-letters"])
def test_single_hypothesis_interims_only_grow(decoding, tmp_path):
    """A decoder whose text only grows (beam search with one hypothesis; greedy decoding of a letter model)
    sends interims of stability 1, each extending the one before."""
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    if decoding == "greedy-letters":
        served = {"decoder": DecoderConfig("greedy"), "model_path": letter_model(tmp_path)}
    else:
        served = {"decoder": DecoderConfig("beam", beam=BeamConfig(beam_size=1))}
    with local_server(max_sessions=2, **served) as srv:
        channel = grpc.insecure_channel(srv.address)
        responses = run_stream(pb_grpc.CosyStreamStub(channel), config(interim_results=True), data)
        channel.close()
    finals = check_event_contract(responses)  # stability 1: each interim extends the one before
    interims = [res for r in responses for res in r.results if not res.is_final]
    assert len(finals) == 1 and len(interims) >= 2
    assert {res.stability for res in interims} == {1.0}
    assert finals[0].transcript.startswith(interims[-1].transcript)


def test_two_utterances_split_by_a_pause(stub):
    first, second = speech(SENTENCE), speech(OTHER)
    audio = np.concatenate([silence(0.5), first, silence(1.5), second, silence(1.0)])
    responses = run_stream(stub, config(), encode(audio, "LINEAR16"))
    finals = check_event_contract(responses)
    assert [f.utterance_index for f in finals] == [0, 1]
    assert not any(not res.is_final for r in responses for res in r.results), "no interims unless asked"
    second_start_ms = int((0.5 + len(first) / 16000 + 1.5) * 1000)
    assert finals[0].end_ms < second_start_ms - 500
    assert abs(finals[1].start_ms - second_start_ms) < 300


def test_finalize_ends_the_utterance_now(stub):
    words = speech(SENTENCE)
    half = len(words) // 2
    data_a = encode(np.concatenate([silence(0.2), words[:half]]), "LINEAR16")
    data_b = encode(np.concatenate([words[half:], silence(1.0)]), "LINEAR16")

    def requests():
        yield config()
        yield from audio_requests(data_a, 3200)
        yield pb.StreamingRecognizeRequest(control=pb.Control(type=pb.Control.FINALIZE))
        yield from audio_requests(data_b, 3200)

    responses = list(stub.StreamingRecognize(requests(), timeout=60))
    finals = check_event_contract(responses)
    assert len(finals) == 2
    assert abs(finals[0].end_ms - (200 + half * 1000 // 16000)) < 100


def test_half_close_flushes_the_last_final(stub):
    data = encode(np.concatenate([silence(0.2), speech(SENTENCE)]), "LINEAR16")  # no trailing silence
    responses = run_stream(stub, config(), data)
    finals = check_event_contract(responses)
    assert len(finals) == 1
    assert finals[0].end_ms >= 200 + len(speech(SENTENCE)) * 1000 // 16000 - 300


def trimmed(text: str) -> np.ndarray:
    """espeak-ng's ``text`` cut at the 10 ms frame of its last sample above -34 dBFS: no silence after the
    last word (and no partial frame, which a half-close would flush as a new utterance after a FINALIZE)."""
    audio = speech(text)
    last = np.nonzero(np.abs(audio) > 0.02)[0][-1]
    return audio[: (last // 160 + 1) * 160]


CUT = "please call me back tomorrow morning"  # a cut at the last sample costs the default model "morning"


def test_an_utterance_cut_at_its_last_word_still_gets_it(stub):
    """Half-close or FINALIZE right after the last word: the server follows the utterance with the silence
    a causal model needs to emit that word, so the final is the one a pause would have given."""
    words = trimmed(CUT)
    paused = run_stream(stub, config(), encode(np.concatenate([silence(0.3), words, silence(1.0)]), "LINEAR16"))
    cut = run_stream(stub, config(), encode(np.concatenate([silence(0.3), words]), "LINEAR16"))
    finalized = run_stream(
        stub,
        config(),
        encode(np.concatenate([silence(0.3), words]), "LINEAR16"),
        extra=[pb.StreamingRecognizeRequest(control=pb.Control(type=pb.Control.FINALIZE))],
    )
    expected = [f.transcript for f in check_event_contract(paused)]
    assert expected[0].endswith("morning"), expected
    assert [f.transcript for f in check_event_contract(cut)] == expected
    assert [f.transcript for f in check_event_contract(finalized)] == expected


def delayed_default_model(directory) -> str:
    """The default model with two centred blocks appended that add nothing: its outputs, 120 ms later."""
    from cosystream.models import load_model, save_model
    from training.train import deepen

    model = load_model(DEFAULT_MODEL_DIR)
    config, weights = deepen(model.config, model.state_dict(), (*model.config.dilations, 4, 8), 0, 2)
    for i in range(len(model.config.dilations), len(config.dilations)):
        weights[f"blocks.{i}.conv.weight"].zero_()
    delayed = type(model)(config)
    delayed.load_state_dict(weights)
    save_model(delayed, directory)
    for path in DEFAULT_MODEL_DIR.iterdir():  # the lexicon and the language model
        if not (directory / path.name).exists():
            shutil.copy(path, directory / path.name)
    return str(directory)


def test_a_model_with_right_context_gets_its_last_words_and_true_word_times(stub, tmp_path):
    """A model whose outputs lag the audio (``output_delay_frames``): the server sends that much more
    silence after each utterance and moves word times back by it, so a cut utterance ends as it does with
    the default model (its first 120 ms are the delayed model's start-up, not the default's: not compared)."""
    data = encode(np.concatenate([silence(0.3), trimmed(CUT)]), "LINEAR16")
    request = config(enable_word_time_offsets=True)
    (reference,) = check_event_contract(run_stream(stub, request, data))
    with local_server(max_sessions=2, model_path=delayed_default_model(tmp_path)) as srv:
        channel = grpc.insecure_channel(srv.address)
        (delayed,) = check_event_contract(run_stream(pb_grpc.CosyStreamStub(channel), request, data))
        channel.close()
    assert delayed.transcript.split()[-3:] == reference.transcript.split()[-3:] == ["back", "tomorrow", "morning"]
    for ours, theirs in zip(delayed.words[-3:], reference.words[-3:], strict=True):
        assert abs(ours.start_ms - theirs.start_ms) <= 10 and abs(ours.end_ms - theirs.end_ms) <= 10
    assert delayed.end_ms == reference.end_ms


@pytest.mark.parametrize("encoding", ["LINEAR16", "MULAW", "ALAW"])
@pytest.mark.parametrize("rate_hz", [8000, 16000])
def test_rates_and_encodings(stub, encoding, rate_hz):
    audio = np.concatenate([silence(0.4, rate_hz), speech(SENTENCE, rate_hz=rate_hz), silence(1.0, rate_hz)])
    data = encode(audio, encoding)
    chunk = rate_hz * 20 // 1000 * (2 if encoding == "LINEAR16" else 1) + 1  # odd: samples split across chunks
    responses = run_stream(stub, config(rate_hz, getattr(pb, encoding)), data, chunk_bytes=chunk)
    finals = check_event_contract(responses)
    assert len(finals) == 1
    assert 300 <= started_offsets(responses)[0] <= 600


def test_empty_audio_half_close_ends_ok(stub):
    responses = run_stream(stub, config(), b"")
    assert responses == []


def test_server_info(stub):
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.max_sessions == MAX_SESSIONS and info.device == "cpu"
    assert info.models[0].vocabulary[0] == "<blank>" and info.models[0].is_default
    assert {pb.LINEAR16, pb.MULAW, pb.ALAW} <= set(info.encodings)  # (and the compressed ones, with PyAV)
    assert (info.min_sample_rate_hz, info.max_sample_rate_hz) == (8000, 48000)


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "cosystream.v1.CosyStream"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        names = {
            s.name for r in reflect.ServerReflectionInfo(iter([request])) for s in r.list_services_response.service
        }
        assert {"cosystream.v1.CosyStream", "grpc.health.v1.Health"} <= names


# --- bad input -------------------------------------------------------------------------------------


class Background:
    """A realtime session streaming speech at real-time pace while a test misbehaves beside it."""

    def __init__(self, stub):
        audio = np.concatenate([silence(0.2), speech(OTHER), silence(0.8)])
        self.data = encode(audio, "LINEAR16")
        self.responses: list | None = None
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(stub,))

    def _run(self, stub):
        try:
            self.responses = run_stream(stub, config(), self.data, chunk_bytes=640, pace_s=0.01)
        except Exception as err:
            self.error = err

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join(60)
        assert self.error is None, self.error
        assert len(check_event_contract(self.responses)) == 1


def expect_error(stub, requests, code: grpc.StatusCode, match: str):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamingRecognize(iter(requests), timeout=30))
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()


BAD_INPUT = [
    ([pb.StreamingRecognizeRequest(audio=b"\0\0")], grpc.StatusCode.INVALID_ARGUMENT, "first message"),
    ([config(), config()], grpc.StatusCode.INVALID_ARGUMENT, "only once"),
    ([config(encoding=7)], grpc.StatusCode.INVALID_ARGUMENT, "unknown encoding"),
    ([config(rate_hz=0)], grpc.StatusCode.INVALID_ARGUMENT, "sample_rate_hz is required"),
    ([config(rate_hz=100)], grpc.StatusCode.INVALID_ARGUMENT, "8000 to 48000"),
    ([config(rate_hz=10**6)], grpc.StatusCode.INVALID_ARGUMENT, "8000 to 48000"),
    ([config(priority=9)], grpc.StatusCode.INVALID_ARGUMENT, "unknown priority"),
    ([config(model="klingon")], grpc.StatusCode.INVALID_ARGUMENT, "unknown model"),
    (
        [
            pb.StreamingRecognizeRequest(
                config=pb.StreamingConfig(sample_rate_hz=16000, endpointing=pb.EndpointingConfig(silence_ms=15))
            )
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "silence_ms",
    ),
    ([config(), pb.StreamingRecognizeRequest(audio=b"\0" * (300 << 10))], grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ([], grpc.StatusCode.INVALID_ARGUMENT, "ended before"),
    ([config(), pb.StreamingRecognizeRequest()], grpc.StatusCode.INVALID_ARGUMENT, "empty request"),
]


def test_bad_input_is_refused_while_others_keep_going(stub):
    with Background(stub):
        for requests, code, match in BAD_INPUT:
            expect_error(stub, requests, code, match)


def test_idle_timeout(stub):
    def requests():
        yield config()
        time.sleep(4.0)  # the server's idle timeout is 3 s
        yield pb.StreamingRecognizeRequest(audio=b"\0\0")

    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamingRecognize(requests(), timeout=30))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def live_sessions() -> list[Session]:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is Session]


def test_a_finished_stream_lets_go_of_its_session_at_once(stub):
    """Nothing, the idle watchdog's timer included, keeps a finished stream's session (its resampler,
    VAD and decoder state) alive: the frontend's memory follows the open streams, not the recent ones."""
    wait_active(stub, 0)
    earlier = weakref.WeakSet(live_sessions())  # other tests' streams, on their way out

    def ours() -> int:
        return sum(s not in earlier for s in live_sessions())

    for _ in range(3):
        run_stream(stub, config(), encode(speech(OTHER), "LINEAR16"))
    deadline = time.monotonic() + 1.5  # well inside the 3 s idle timeout
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == 0


# --- slots -----------------------------------------------------------------------------------------


def wait_active(stub, expected: int, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stub.GetServerInfo(pb.GetServerInfoRequest()).active_sessions == expected:
            return
        time.sleep(0.05)
    raise AssertionError(f"active sessions never reached {expected}")


def test_full_server_refuses_and_cancel_frees_the_slot(stub):
    wait_active(stub, 0)
    held = [HeldStream(stub) for _ in range(MAX_SESSIONS)]
    wait_active(stub, MAX_SESSIONS)
    time.sleep(0.2)  # let the engine assign every slot
    extra = HeldStream(stub)
    extra.thread.join(10)
    assert extra.error is not None and extra.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "slots" in extra.error.details() or "full" in extra.error.details()
    # The initial metadata says a session has an engine slot: every held stream got it, the refused one none.
    assert all(dict(stream.call.initial_metadata()).get("cosystream-session-id") for stream in held)
    assert "cosystream-session-id" not in dict(extra.call.initial_metadata() or ())
    held[0].call.cancel()
    held[0].thread.join(10)
    wait_active(stub, MAX_SESSIONS - 1)
    again = HeldStream(stub)
    time.sleep(0.5)
    assert again.error is None and again.thread.is_alive()
    for stream in [*held[1:], again]:
        stream.close()
    wait_active(stub, 0)


def test_a_stream_that_half_closes_before_the_engine_answers_its_open_is_refused_not_ok(server, stub):
    """The engine is full and answers late (stopped with SIGSTOP for a moment): the stream half-closes first,
    with no audio or a little, and still gets the refusal, not an OK (which would say its audio was transcribed;
    it never had a slot)."""
    wait_active(stub, 0)
    held = [HeldStream(stub) for _ in range(MAX_SESSIONS)]
    engine = server.engine.process.pid
    try:
        wait_active(stub, MAX_SESSIONS)
        time.sleep(0.2)  # let the engine assign every slot
        config = pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000)
        )
        for audio in ([], [pb.StreamingRecognizeRequest(audio=b"\0" * 3200)]):
            outcome: list = []
            os.kill(engine, signal.SIGSTOP)
            try:
                call = stub.StreamingRecognize(iter([config, *audio]), timeout=30)
                late = threading.Thread(target=lambda call=call, outcome=outcome: outcome.append(_ended(call)))
                late.start()
                late.join(1.0)
                assert not outcome, f"the stream ended before the engine answered its open: {outcome}"
            finally:
                os.kill(engine, signal.SIGCONT)
            late.join(30)
            assert outcome == [grpc.StatusCode.RESOURCE_EXHAUSTED]
    finally:
        for stream in held:
            stream.close()
    assert all(stream.error is None for stream in held)
    wait_active(stub, 0)


def _ended(call) -> grpc.StatusCode:
    try:
        list(call)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_realtime_sheds_the_newest_batch_session(stub):
    wait_active(stub, 0)
    realtime = [HeldStream(stub) for _ in range(MAX_SESSIONS - 1)]
    batch = HeldStream(stub, priority=pb.BATCH)
    wait_active(stub, MAX_SESSIONS)
    time.sleep(0.2)
    newcomer = HeldStream(stub)
    batch.thread.join(10)
    assert batch.error is not None and batch.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "REALTIME" in batch.error.details()
    time.sleep(0.3)
    assert newcomer.error is None and newcomer.thread.is_alive()
    for stream in [*realtime, newcomer]:
        stream.close()
    wait_active(stub, 0)
