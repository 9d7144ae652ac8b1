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
