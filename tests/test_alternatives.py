"""N-best alternatives over real gRPC on loopback: StreamingConfig.max_alternatives and the finals' alternatives,
speech from espeak-ng (finals from the streaming beam search: no second pass)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from cosystream.decoding.greedy import MAX_ALTERNATIVES
from tests.servers import local_server
from tests.speech import encode, needs_espeak, silence, speech
from tests.test_server import SENTENCE, config, run_stream


@pytest.fixture(scope="module")
def server():
    with local_server(max_sessions=4) as srv:
        yield srv


@needs_espeak
def test_finals_carry_the_distinct_n_best_sorted(stub):
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    responses = run_stream(
        stub, config(interim_results=True, max_alternatives=3, enable_word_time_offsets=True), data
    )
    results = [r for response in responses for r in response.results]
    finals = [r for r in results if r.is_final]
    assert finals and all(not r.alternatives for r in results if not r.is_final)
    for final in finals:
        texts = [a.transcript for a in final.alternatives]
        assert 1 <= len(texts) <= 3 and len(set(texts)) == len(texts)
        assert texts[0] == final.transcript
        assert final.alternatives[0].confidence == pytest.approx(final.confidence)
        confidences = [a.confidence for a in final.alternatives]
        assert confidences == sorted(confidences, reverse=True)
        for alternative in final.alternatives:
            assert [w.word for w in alternative.words] == alternative.transcript.split()
    assert any(len(f.alternatives) > 1 for f in finals), [list(f.alternatives) for f in finals]


@needs_espeak
def test_one_alternative_unless_asked(stub):
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    finals = [r for response in run_stream(stub, config(), data) for r in response.results if r.is_final]
    assert finals and all(not f.alternatives for f in finals)


def test_more_than_the_maximum_is_refused(stub):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamingRecognize(iter([config(max_alternatives=MAX_ALTERNATIVES + 1)]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_alternatives" in info.value.details()


def check_alternatives(alternatives, limit: int = 3) -> list[str]:
    """Distinct, best first, at most ``limit``; returns the transcripts."""
    texts = [a.transcript for a in alternatives]
    assert 1 <= len(texts) <= limit and len(set(texts)) == len(texts), texts
    confidences = [a.confidence for a in alternatives]
    assert confidences == sorted(confidences, reverse=True)
    return texts


@needs_espeak
def test_google_streaming_and_recognize_return_up_to_max_alternatives(server):
    speech_v1 = pytest.importorskip(
        "google.cloud.speech_v1", reason="needs google-cloud-speech (the compat extra)"
    )
    from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport

    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    channel = grpc.insecure_channel(server.address)
    try:
        client = speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=channel))
        config = speech_v1.RecognitionConfig(
            encoding=speech_v1.RecognitionConfig.AudioEncoding.LINEAR16,
            sample_rate_hertz=16000,
            language_code="en-US",
            max_alternatives=3,
        )
        streamed = client.streaming_recognize(
            speech_v1.StreamingRecognitionConfig(config=config),
            (
                speech_v1.StreamingRecognizeRequest(audio_content=data[i : i + 3200])
                for i in range(0, len(data), 3200)
            ),
            timeout=60,
        )
        finals = [r for response in streamed for r in response.results if r.is_final]
        assert finals and any(len(check_alternatives(f.alternatives)) > 1 for f in finals)
        whole = client.recognize(config=config, audio={"content": data}, timeout=60)
        assert whole.results and any(len(check_alternatives(r.alternatives)) > 1 for r in whole.results)
    finally:
        channel.close()


@needs_espeak
def test_riva_streaming_and_offline_return_up_to_max_alternatives(server):
    riva_client = pytest.importorskip("riva.client", reason="needs nvidia-riva-client (the compat extra)")
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    asr = riva_client.ASRService(riva_client.Auth(uri=server.address))
    try:
        config = riva_client.RecognitionConfig(
            encoding=riva_client.AudioEncoding.LINEAR_PCM,
            sample_rate_hertz=16000,
            language_code="en-US",
            max_alternatives=3,
        )
        streaming = riva_client.StreamingRecognitionConfig(config=config)
        chunks = (data[i : i + 3200] for i in range(0, len(data), 3200))
        finals = [r for response in asr.streaming_response_generator(chunks, streaming) for r in response.results]
        finals = [r for r in finals if r.is_final]
        assert finals and any(len(check_alternatives(f.alternatives)) > 1 for f in finals)
        offline = asr.offline_recognize(data, config)
        assert offline.results and any(len(check_alternatives(r.alternatives)) > 1 for r in offline.results)
    finally:
        asr.auth.channel.close()
