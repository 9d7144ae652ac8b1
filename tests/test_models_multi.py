"""Several models served at once: each session runs on the model its config names.

The second model is built here: the default network over letters, freshly initialized (seeded) and saved
as a model directory of its own, so it differs from the default in weights, vocabulary and decoding (greedy
against the default's beam search over phonemes). The engine-level tests need no espeak-ng; the end-to-end
ones speak through it.
"""

from __future__ import annotations

import json
import string
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from cosystream.engine import ipc
from cosystream.engine.config import EngineConfig
from cosystream.engine.core import EngineCore
from cosystream.engine.scheduler import Scheduler, SchedulerConfig
from cosystream.model_files import DEFAULT_MODEL_DIR, model_name
from cosystream.models import FRAME_SAMPLES, content_version, load_model, save_model
from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel
from cosystream.priority import Priority
from cosystream.server.http.common import native_model
from cosystream.server.http.errors import ApiError
from cosystream.v1 import cosystream_pb2 as pb
from tests.servers import HeldStream, Served, local_server, serve_argv
from tests.speech import encode, needs_espeak, silence, speech

SENTENCE = "the quick brown fox jumps over the lazy dog"
LETTERS = "test-letters"


def build_letter_model(directory) -> str:
    """The default architecture over letters, seeded random weights, saved with ``save_model``."""
    data = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    data.update(name=LETTERS, vocabulary=["<blank>", " ", "'", *string.ascii_lowercase])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = ConvCtcModel(ConvCtcConfig.from_dict(data))
    save_model(model, directory)
    return str(directory)


@pytest.fixture(scope="module")
def letters_dir(tmp_path_factory) -> str:
    return build_letter_model(tmp_path_factory.mktemp("letters"))


# --- the engine, in this process --------------------------------------------------------------------


def test_scheduler_steps_one_model_per_step_and_serves_every_model():
    sched = Scheduler(SchedulerConfig(max_sessions=4, max_batch=4, models=2, realtime_batch_window_s=0))
    for slot, model in enumerate([0, 1, 0, 1]):
        sched.add(slot, Priority.REALTIME, model)
        sched.add_frames(slot, 3, arrival_s=slot * 1e-3)
    stepped = {0: [], 1: []}
    while (plan := sched.schedule()) is not None:
        assert {slot % 2 for slot in plan.slots} == {plan.model}, "rows of one model per step"
        stepped[plan.model].extend(plan.slots * plan.frames)
    assert sorted(stepped[0]) == [0, 0, 0, 2, 2, 2] and sorted(stepped[1]) == [1, 1, 1, 3, 3, 3]
    sched.remove(0)
    with pytest.raises(ValueError, match="model 2 out of range"):
        sched.add(0, Priority.BATCH, 2)


def test_batch_steps_are_of_one_model_too():
    sched = Scheduler(SchedulerConfig(max_sessions=4, max_batch=4, models=2, batch_frames=4))
    for slot in range(4):
        sched.add(slot, Priority.BATCH, slot // 2)
        sched.add_frames(slot, 8, arrival_s=0.0)
    models = []
    while (plan := sched.schedule()) is not None:
        assert {slot // 2 for slot in plan.slots} == {plan.model}
        models.append(plan.model)
        sched.update_cost(plan.rows, plan.frames, 1e-4, plan.priority, plan.model)
    assert set(models) == {0, 1}


FRAMES = np.random.default_rng(0).uniform(-0.3, 0.3, (24, FRAME_SAMPLES)).astype(np.float32)


def step_all(core: EngineCore, opens: list[ipc.Open]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Open sessions, send each the same frames, step until done: per key, its (ids, logprobs)."""
    message = ipc.ToEngine(ops=opens)
    for op in opens:
        message.add_frames(op.key, FRAMES)
    core.handle(0, message.pack())
    while core.step() is not None:
        pass
    box = core.take_outbox()[0]
    assert sorted(e.key for e in box.events if isinstance(e, ipc.Opened)) == sorted(op.key for op in opens)
    out: dict[int, list] = {}
    for key, ids, logprobs, *_ in box.rows():
        out.setdefault(key, []).append((ids, logprobs))
    return {key: tuple(np.concatenate(parts) for parts in zip(*runs, strict=True)) for key, runs in out.items()}


def test_each_session_is_stepped_by_its_own_model(letters_dir):
    """Two sessions with the same audio on an engine of two models get what each model alone gives."""
    default, letters = load_model(), load_model(letters_dir)
    config = EngineConfig(max_sessions=4, max_batch=4, realtime_batch_window_s=0)
    cpu = torch.device("cpu")
    both = step_all(EngineCore([default, letters], config, cpu), [ipc.Open(1, 1, 0), ipc.Open(2, 1, 1)])
    alone_default = step_all(EngineCore(default, config, cpu), [ipc.Open(1, 1)])
    alone_letters = step_all(EngineCore(letters, config, cpu), [ipc.Open(2, 1)])
    assert np.array_equal(both[1][0], alone_default[1][0]) and np.array_equal(both[2][0], alone_letters[2][0])
    assert not np.array_equal(both[1][0][..., 0], both[2][0][..., 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_models_replay_their_own_cuda_graphs(letters_dir):
    """On CUDA each model has its graphs: an engine of two models replaying them equals the eager one."""
    from cosystream.engine.process import use_device
    from cosystream.runtime.settings import GraphMode

    device = torch.device("cuda", 0)
    use_device(device)
    models = [load_model(device=device), load_model(letters_dir, device=device)]
    opens = [ipc.Open(1, 1, 0), ipc.Open(2, 1, 1), ipc.Open(3, 1, 1)]
    got = {}
    for mode in GraphMode:
        config = EngineConfig(max_sessions=4, max_batch=4, realtime_batch_window_s=0, graph_mode=mode)
        core = EngineCore(models, config, device)
        assert all((runner._graphs is not None) == (mode is GraphMode.GRAPHS) for runner in core.runners)
        got[mode] = step_all(core, opens)
    for key in (1, 2, 3):
        (ids, logprobs), (eager_ids, eager_logprobs) = got[GraphMode.GRAPHS][key], got[GraphMode.EAGER][key]
        assert np.array_equal(ids, eager_ids)
        np.testing.assert_allclose(logprobs, eager_logprobs, atol=1e-5)


def test_an_open_for_a_model_the_engine_lacks_is_rejected(letters_dir):
    core = EngineCore(load_model(letters_dir), EngineConfig(max_sessions=2), torch.device("cpu"))
    core.handle(0, ipc.ToEngine(ops=[ipc.Open(5, 1, 3)]).pack())
    (event,) = core.take_outbox()[0].events
    assert isinstance(event, ipc.Rejected) and event.key == 5 and core.session_count == 0


def test_versions_hash_the_files(letters_dir, tmp_path):
    assert content_version(None) == content_version(DEFAULT_MODEL_DIR) != content_version(letters_dir)
    copy = tmp_path / "copy"
    save_model(load_model(letters_dir), copy)
    assert content_version(copy) == content_version(letters_dir)
    weights = load_model(letters_dir)
    with torch.no_grad():
        next(weights.parameters()).add_(1e-3)
    save_model(weights, copy)
    assert content_version(copy) != content_version(letters_dir)


# --- a server of two models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(letters_dir):
    with local_server(max_sessions=6, models=[None, letters_dir]) as srv:
        yield srv


def stream(stub, model: str, data: bytes) -> list[pb.StreamingRecognizeResponse]:
    def requests():
        yield pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(
                encoding=pb.LINEAR16, sample_rate_hz=16000, model=model, interim_results=True
            )
        )
        for offset in range(0, len(data), 3200):
            yield pb.StreamingRecognizeRequest(audio=data[offset : offset + 3200])

    return list(stub.StreamingRecognize(requests(), timeout=60))


def test_server_info_lists_every_model(stub, letters_dir):
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    default, letters = info.models
    assert (default.name, letters.name) == (model_name(None), LETTERS)
    assert (default.is_default, letters.is_default) == (True, False)
    assert default.version == content_version(None) and letters.version == content_version(letters_dir)
    assert default.version != letters.version
    assert (default.vocabulary_kind, letters.vocabulary_kind) == ("phonemes", "letters")
    assert letters.vocabulary[3:] == list(string.ascii_lowercase)
    assert default.precision == letters.precision == "float32"
    assert default.output_delay_ms == letters.output_delay_ms == 0
    assert default.parameters > 0 and letters.parameters > 0
    assert info.max_sessions == 6  # shared by the models


@needs_espeak
def test_concurrent_sessions_each_on_the_model_they_named(stub):
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    versions = {m.name: m.version for m in stub.GetServerInfo(pb.GetServerInfoRequest()).models}
    names = ["", LETTERS, "default", model_name(None), LETTERS]
    got: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda i=i, name=name: got.__setitem__(i, stream(stub, name, data)))
        for i, name in enumerate(names)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    finals = {}
    for i, name in enumerate(names):
        served = LETTERS if name == LETTERS else model_name(None)
        results = [result for response in got[i] for result in response.results]
        assert results and {(r.model, r.model_version) for r in results} == {(served, versions[served])}
        finals[i] = " ".join(r.transcript for r in results if r.is_final)
    # The default model hears the sentence (all but a word of it: it is small), the untrained one does not.
    assert finals[0] == finals[2] == finals[3] and words_right(finals[0]) >= len(SENTENCE.split()) - 1
    assert finals[1] == finals[4] and words_right(finals[1]) <= 1


def words_right(transcript: str) -> int:
    return sum(a == b for a, b in zip(transcript.split(), SENTENCE.split(), strict=False))


def test_the_models_share_the_session_capacity(stub):
    held = [HeldStream(stub, model=LETTERS if i % 2 else "") for i in range(6)]
    try:
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        deadline = time.monotonic() + 30
        while info.active_sessions < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
            info = stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.active_sessions == info.max_sessions == 6
        with pytest.raises(grpc.RpcError) as caught:
            stream(stub, LETTERS, b"\0" * 3200)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for stream_ in held:
            stream_.close()
    assert all(stream_.error is None for stream_ in held), [s.error for s in held if s.error]


def test_an_unknown_model_is_refused_naming_the_served_ones(stub):
    with pytest.raises(grpc.RpcError) as caught:
        stream(stub, "nope", b"")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = caught.value.details()
    assert "'nope'" in message and repr(LETTERS) in message and repr(model_name(None)) in message


def test_http_names_every_served_model(server):
    servicer = server.frontend.servicer
    assert native_model(servicer, LETTERS) == LETTERS
    assert native_model(servicer, "whisper-1") == native_model(servicer, "") == ""
    with pytest.raises(ApiError, match=LETTERS):
        native_model(servicer, "nope")


@needs_espeak
def test_google_model_names_pick_a_served_model_or_the_default(server, stub):
    """Through Google's own client: a served model's name picks it; Google's names get the default model."""
    speech_v1 = pytest.importorskip(
        "google.cloud.speech_v1", reason="needs google-cloud-speech (the compat extra)"
    )
    from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport

    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")

    def native_final(model: str) -> str:
        return " ".join(
            r.transcript for response in stream(stub, model, data) for r in response.results if r.is_final
        )

    def google_final(client, model: str) -> str:
        config = speech_v1.StreamingRecognitionConfig(
            config=speech_v1.RecognitionConfig(
                encoding=speech_v1.RecognitionConfig.AudioEncoding.LINEAR16,
                sample_rate_hertz=16000,
                language_code="en-US",
                model=model,
            )
        )
        requests = (
            speech_v1.StreamingRecognizeRequest(audio_content=data[offset : offset + 3200])
            for offset in range(0, len(data), 3200)
        )
        responses = client.streaming_recognize(config, requests, timeout=60)
        return " ".join(
            r.alternatives[0].transcript for response in responses for r in response.results if r.is_final
        )

    default, letters = native_final(""), native_final(LETTERS)
    assert default != letters
    channel = grpc.insecure_channel(server.address)
    try:
        client = speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=channel))
        assert google_final(client, LETTERS) == letters
        for google_name in ("latest_long", "phone_call", "default", ""):
            assert google_final(client, google_name) == default, google_name
    finally:
        channel.close()


@needs_espeak
def test_riva_model_names_pick_a_served_model(server, stub):
    riva_client = pytest.importorskip("riva.client", reason="needs nvidia-riva-client (the compat extra)")
    from riva.client.proto import riva_asr_pb2 as rasr

    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    letters = " ".join(
        r.transcript for response in stream(stub, LETTERS, data) for r in response.results if r.is_final
    )
    service = riva_client.ASRService(riva_client.Auth(uri=server.address))
    try:
        reply = service.stub.GetRivaSpeechRecognitionConfig(rasr.RivaSpeechRecognitionConfigRequest())
        assert [c.model_name for c in reply.model_config] == [model_name(None), LETTERS]
        named = rasr.RivaSpeechRecognitionConfigRequest(model_name=LETTERS)
        assert [c.model_name for c in service.stub.GetRivaSpeechRecognitionConfig(named).model_config] == [LETTERS]

        def recognize(model: str) -> str:
            config = riva_client.StreamingRecognitionConfig(
                config=riva_client.RecognitionConfig(
                    encoding=riva_client.AudioEncoding.LINEAR_PCM,
                    sample_rate_hertz=16000,
                    language_code="en-US",
                    model=model,
                )
            )
            chunks = (data[offset : offset + 3200] for offset in range(0, len(data), 3200))
            responses = service.streaming_response_generator(chunks, config)
            return " ".join(r.alternatives[0].transcript for x in responses for r in x.results if r.is_final)

        assert recognize(LETTERS) == letters != recognize("")
        with pytest.raises(grpc.RpcError) as caught:
            recognize("nope")
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        service.auth.channel.close()


# --- cosystream serve -----------------------------------------------------------------------------------


def test_serve_names_its_models(letters_dir):
    with Served("--frontends", "1", "--model", f"a={DEFAULT_MODEL_DIR}", "--model", f"b={letters_dir}") as served:
        info = served.info()
        assert [(m.name, m.is_default) for m in info.models] == [("a", True), ("b", False)]
        assert [m.version for m in info.models] == [content_version(None), content_version(letters_dir)]
        with pytest.raises(grpc.RpcError) as caught:
            stream(served.stub(), LETTERS, b"")
        assert "'a', 'b'" in caught.value.details()


def test_serve_refuses_two_models_of_one_name(letters_dir):
    done = subprocess.run(
        serve_argv("--model", letters_dir, "--model", f"{LETTERS}={DEFAULT_MODEL_DIR}"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"cosystream serve: two models are named {LETTERS!r}: name them with NAME=DIR"
    ]
