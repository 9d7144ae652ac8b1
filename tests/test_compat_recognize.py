"""Google's whole-file ``Recognize`` and ``LongRunningRecognize`` (with ``google.longrunning.Operations``),
driven by the unmodified google-cloud-speech client against a real server on loopback with tokens."""

from __future__ import annotations

import io
import threading
import time
import wave

import grpc
import numpy as np
import pytest
import soundfile

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import HeldStream, local_server, local_server_with
from tests.speech import closer_to, encode, needs_espeak, silence, speech, two_speakers
from tests.test_http import heard

speech_v1 = pytest.importorskip("google.cloud.speech_v1", reason="needs google-cloud-speech (the compat extra)")
from google.api_core import exceptions  # noqa: E402
from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport  # noqa: E402
from google.longrunning import operations_pb2, operations_pb2_grpc  # noqa: E402

pytestmark = needs_espeak

SENTENCE = "the quick brown fox jumps over the lazy dog"
OTHER = "please call me back tomorrow morning"
ONE = "one-00112233445566778899aabb"  # max_sessions=1
OTHER_TOKEN = "two-ffeeddccbbaa998877665544"
Encoding = speech_v1.RecognitionConfig.AudioEncoding


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The token on every call of a channel (the operations client polls without per-call metadata)."""

    def __init__(self, token: str):
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"one {ONE} max_sessions=1\ntwo {OTHER_TOKEN}\n")
    with local_server_with(max_sessions=8, auth_tokens=str(tokens)) as srv:
        yield srv


def speech_client(server, token: str = ONE):
    channel = grpc.intercept_channel(grpc.insecure_channel(server.address), _Bearer(token))
    return speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=channel)), channel


@pytest.fixture(scope="module")
def client(server):
    client, channel = speech_client(server)
    yield client
    channel.close()


def config(rate_hz=16000, encoding=Encoding.LINEAR16, **fields):
    return speech_v1.RecognitionConfig(
        encoding=encoding, sample_rate_hertz=rate_hz, language_code="en-US", **fields
    )


def audio(content: bytes):
    return speech_v1.RecognitionAudio(content=content)


def two_sentences(rate_hz: int = 16000) -> np.ndarray:
    parts = [silence(0.3, rate_hz), speech(SENTENCE, rate_hz=rate_hz), silence(1.0, rate_hz)]
    return np.concatenate([*parts, speech(OTHER, rate_hz=rate_hz), silence(0.5, rate_hz)])


def wav_bytes(samples: np.ndarray, rate_hz: int, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(encode(np.repeat(samples, channels), "LINEAR16"))
    return out.getvalue()


def active_sessions(server) -> int:
    with grpc.insecure_channel(server.address) as channel:
        info = pb_grpc.CosyStreamStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), metadata=(("authorization", f"Bearer {ONE}"),)
        )
    return info.active_sessions


def wait_no_sessions(server, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (held := active_sessions(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held == 0, f"{held} engine slots still held"


# --- Recognize -----------------------------------------------------------------------------------


def test_recognize_gives_one_result_per_utterance_with_word_offsets(client, server):
    samples = two_sentences()
    response = client.recognize(
        config=config(enable_word_time_offsets=True), audio=audio(encode(samples, "LINEAR16"))
    )
    results = type(response).pb(response).results
    assert len(results) == 2, results
    first, second = results
    assert heard(first.alternatives[0].transcript), first
    assert heard(second.alternatives[0].transcript, OTHER), second
    ends_s = [r.result_end_time.ToTimedelta().total_seconds() for r in results]
    assert 0 < ends_s[0] < ends_s[1] <= len(samples) / 16000 + 0.1
    for result in results:
        assert result.language_code == "en-us" and 0 <= result.alternatives[0].confidence <= 1
        words = result.alternatives[0].words
        assert [w.word for w in words] == result.alternatives[0].transcript.split()
        starts = [w.start_time.ToTimedelta().total_seconds() for w in words]
        assert starts == sorted(starts) and all(
            w.end_time.ToTimedelta() > w.start_time.ToTimedelta() for w in words
        )
    assert type(response).pb(response).total_billed_time.seconds >= int(len(samples) / 16000)
    wait_no_sessions(server)


@pytest.mark.parametrize("form", ["wav-8k-stereo-unspecified", "flac", "mulaw-8k", "wav-declared-linear16"])
def test_recognize_takes_containers_and_raw_g711(client, form):
    rate_hz = 8000 if "8k" in form else 16000
    samples = np.concatenate([silence(0.3, rate_hz), speech(SENTENCE, rate_hz=rate_hz), silence(0.7, rate_hz)])
    if form.startswith("wav"):
        stereo = "stereo" in form
        content = wav_bytes(samples, rate_hz, 2 if stereo else 1)
        request = config(rate_hz=0, encoding=Encoding.ENCODING_UNSPECIFIED if stereo else Encoding.LINEAR16)
    elif form == "flac":
        buffer = io.BytesIO()
        soundfile.write(buffer, samples, rate_hz, format="FLAC")
        content, request = buffer.getvalue(), config(rate_hz=0, encoding=Encoding.FLAC)
    else:
        content, request = encode(samples, "MULAW"), config(rate_hz=8000, encoding=Encoding.MULAW)
    results = type(response := client.recognize(config=request, audio=audio(content))).pb(response).results
    assert len(results) == 1 and heard(results[0].alternatives[0].transcript), results


# --- LongRunningRecognize and Operations -----------------------------------------------------------


def test_long_running_recognize_operation_result(client, server):
    content = encode(two_sentences(), "LINEAR16")
    operation = client.long_running_recognize(config=config(), audio=audio(content))
    result = operation.result(timeout=120)
    transcripts = [r.alternatives[0].transcript for r in result.results]
    assert len(transcripts) == 2 and heard(transcripts[0]) and heard(transcripts[1], OTHER), transcripts
    assert operation.metadata.progress_percent == 100
    assert operation.metadata.last_update_time >= operation.metadata.start_time
    name = operation.operation.name
    operations = client.transport.operations_client
    assert operations.get_operation(name).done
    assert name in [op.name for op in operations.list_operations(name="", filter_="")]
    other, channel = speech_client(server, OTHER_TOKEN)
    with pytest.raises(exceptions.NotFound):  # another token's operation is not there for it
        other.transport.operations_client.get_operation(name)
    channel.close()
    operations.delete_operation(name)
    with pytest.raises(exceptions.NotFound):
        operations.get_operation(name)
    wait_no_sessions(server)


def test_cancel_operation_ends_its_session(client, server):
    content = bytes(2 * 16000 * 240)  # 4 minutes of silence (7.7 MB): still running when cancelled
    operation = client.long_running_recognize(config=config(), audio=audio(content))
    assert not operation.done()
    operation.cancel()
    with pytest.raises(exceptions.Cancelled):
        operation.result(timeout=30)
    wait_no_sessions(server)


def test_an_operation_of_another_frontend_process_is_not_found_with_the_reason(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = operations_pb2_grpc.OperationsStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetOperation(
                operations_pb2.GetOperationRequest(name="cosystream-1-00ff"),
                metadata=(("authorization", f"Bearer {ONE}"),),
            )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "frontend process that started them" in info.value.details()


# --- refusals ------------------------------------------------------------------------------------


def test_uri_is_invalid_argument(client):
    for call in (client.recognize, client.long_running_recognize):
        with pytest.raises(exceptions.InvalidArgument) as info:
            call(config=config(), audio=speech_v1.RecognitionAudio(uri="gs://bucket/audio.raw"))
        assert "content" in info.value.message and "uri" in info.value.message


def test_sync_input_over_60_s_is_invalid_argument_before_decoding(client, server):
    raw = bytes(2 * 16000 * 61)
    header_claims = wav_bytes(np.zeros(8000 * 61, np.float32), 8000)
    for request, content in (
        (config(), raw),
        (config(rate_hz=0, encoding=Encoding.ENCODING_UNSPECIFIED), header_claims),
    ):
        with pytest.raises(exceptions.InvalidArgument) as info:
            client.recognize(config=request, audio=audio(content))
        assert "61.0 s" in info.value.message and "LongRunningRecognize" in info.value.message
    with pytest.raises(exceptions.InvalidArgument) as info:
        client.recognize(config=config(rate_hz=0, encoding=Encoding.FLAC), audio=audio(b"fLaC" + bytes(500)))
    assert "the audio content" in info.value.message
    assert active_sessions(server) == 0


def test_quota_refusals_are_resource_exhausted(client, server):
    stop = threading.Event()

    def held():
        yield pb.StreamingRecognizeRequest(config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000))
        while not stop.wait(0.05):
            yield pb.StreamingRecognizeRequest(audio=b"\0" * 320)

    content = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(0.5)]), "LINEAR16")
    operations = client.transport.operations_client
    listed = len(list(operations.list_operations(name="", filter_="")))
    with grpc.insecure_channel(server.address) as channel:
        call = pb_grpc.CosyStreamStub(channel).StreamingRecognize(
            held(), metadata=(("authorization", f"Bearer {ONE}"),), timeout=60
        )
        next(iter(call.initial_metadata()), None)  # the token's one session is taken
        try:
            with pytest.raises(exceptions.ResourceExhausted, match="max_sessions=1"):
                client.recognize(config=config(), audio=audio(content))
            with pytest.raises(exceptions.ResourceExhausted, match="max_sessions=1"):
                client.long_running_recognize(config=config(), audio=audio(content))
        finally:
            stop.set()
            list(call)
    wait_no_sessions(server)
    assert len(list(operations.list_operations(name="", filter_=""))) == listed, "a refused operation is not kept"
    results = type(response := client.recognize(config=config(), audio=audio(content))).pb(response).results
    assert len(results) == 1, "the quota was given back"


def test_a_full_engine_is_resource_exhausted_and_the_slot_comes_back():
    """Admission: with the engine's one slot held, Recognize fails with RESOURCE_EXHAUSTED and so does the
    operation's result (the session was accepted, then refused by the engine)."""
    content = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(0.5)]), "LINEAR16")
    with local_server(max_sessions=1) as full, grpc.insecure_channel(full.address) as channel:
        client = speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=channel))
        held = HeldStream(pb_grpc.CosyStreamStub(channel))
        next(iter(held.call.initial_metadata()), None)
        try:
            with pytest.raises(exceptions.ResourceExhausted):
                client.recognize(config=config(), audio=audio(content))
            operation = client.long_running_recognize(config=config(), audio=audio(content))
            with pytest.raises(exceptions.ResourceExhausted):
                operation.result(timeout=60)
        finally:
            held.close()
        results = type(response := client.recognize(config=config(), audio=audio(content))).pb(response).results
        assert len(results) == 1, "the slot came back"


# --- the operation store's bounds, no server -------------------------------------------------------


def test_the_store_is_bounded_in_count_and_time():
    import asyncio

    from cosystream.server.compat.bridge import CompatError
    from cosystream.server.compat.operations import OperationLimits, OperationStore

    now = [0.0]
    store = OperationStore(OperationLimits(max_operations=2, retention_s=10.0), clock=lambda: now[0])

    async def scenario():
        release = asyncio.Event()

        async def run(metadata):
            await release.wait()
            return operations_pb2.Operation(name="result")  # any message packs

        first, second = store.start(operations_pb2.Operation(), run), store.start(operations_pb2.Operation(), run)
        with pytest.raises(CompatError) as info:
            store.start(operations_pb2.Operation(), run)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, "all held operations still run"
        release.set()
        await asyncio.gather(first.task, second.task)
        assert first.operation.done and first.operation.response.Is(operations_pb2.Operation.DESCRIPTOR)
        third = store.start(operations_pb2.Operation(), run)  # room made: the oldest finished one goes
        assert [e.operation.name for e in store._entries.values()] == [second.operation.name, third.operation.name]
        await third.task
        now[0] = 10.5  # past the retention of both
        store.start(operations_pb2.Operation(), run).task.cancel()
        assert len(store) == 1

    asyncio.run(scenario())


# --- separate recognition per channel ------------------------------------------------------------------


def _by_channel(results) -> dict[int, list[str]]:
    finals: dict[int, list[str]] = {}
    for result in results:
        finals.setdefault(result.channel_tag, []).append(result.alternatives[0].transcript)
    return finals


@pytest.fixture(scope="module")
def two_sessions_client(server):
    client, channel = speech_client(server, OTHER_TOKEN)  # (no max_sessions: two channels, two sessions)
    yield client
    channel.close()


@pytest.mark.parametrize("encoding", ["LINEAR16", "MULAW"])
def test_recognize_two_channels_each_its_own_session(client, two_sessions_client, server, encoding):
    """A two-speaker file: each channel's results tagged 1 or 2 with its own sentence (mixed, both
    sentences would overlap in one), in the order they end."""
    data = two_speakers(SENTENCE, OTHER, encoding=encoding)
    per_channel = config(
        encoding=getattr(Encoding, encoding), audio_channel_count=2, enable_separate_recognition_per_channel=True
    )
    with pytest.raises(exceptions.ResourceExhausted, match="max_sessions=1"):
        client.recognize(config=per_channel, audio=audio(data))  # each channel is a session of the token's
    wait_no_sessions(server)
    response = two_sessions_client.recognize(config=per_channel, audio=audio(data))
    results = type(response).pb(response).results
    finals = _by_channel(results)
    assert set(finals) == {1, 2}, results
    assert closer_to(" ".join(finals[1]), [SENTENCE, OTHER]) == SENTENCE, finals
    assert closer_to(" ".join(finals[2]), [SENTENCE, OTHER]) == OTHER, finals
    ends = [r.result_end_time.ToTimedelta() for r in results]
    assert ends == sorted(ends)
    wait_no_sessions(server)


def test_long_running_recognize_a_stereo_flac_file_per_channel(two_sessions_client, server):
    client = two_sessions_client
    stereo = np.frombuffer(two_speakers(SENTENCE, OTHER), "<i2").reshape(-1, 2)
    buffer = io.BytesIO()
    soundfile.write(buffer, stereo, 16000, format="FLAC")
    operation = client.long_running_recognize(
        config=config(
            encoding=Encoding.FLAC, rate_hz=0, audio_channel_count=2, enable_separate_recognition_per_channel=True
        ),
        audio=audio(buffer.getvalue()),
    )
    response = operation.result(timeout=60)
    finals = _by_channel(type(response).pb(response).results)
    assert closer_to(" ".join(finals[1]), [SENTENCE, OTHER]) == SENTENCE, finals
    assert closer_to(" ".join(finals[2]), [SENTENCE, OTHER]) == OTHER, finals
    mixed = client.recognize(config=config(encoding=Encoding.FLAC, rate_hz=0), audio=audio(buffer.getvalue()))
    assert {r.channel_tag for r in type(mixed).pb(mixed).results} == {0}, "without it the channels are mixed"
    with pytest.raises(
        exceptions.InvalidArgument, match=r"audio_channel_count=3 does not match the FLAC header \(2\)"
    ):
        client.recognize(
            config=config(
                encoding=Encoding.FLAC,
                rate_hz=0,
                audio_channel_count=3,
                enable_separate_recognition_per_channel=True,
            ),
            audio=audio(buffer.getvalue()),
        )
    wait_no_sessions(server)
