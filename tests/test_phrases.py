"""Phrase boosting: phrases checked and normalized, new words pronounced by espeak-ng, the session's lexicon
and context graph, the beam search that hears a boosted name it misses without, and the phrases of our API,
Google's ``speech_contexts`` and Riva's ``boosted_lm_words`` on real servers."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from cosystream.decoding.config import DecoderConfig, DecoderFactory
from cosystream.decoding.phrases import (
    DEFAULT_BOOST,
    MAX_PHRASES,
    Boosting,
    Phrase,
    PhraseError,
    normalize,
)
from cosystream.models.loading import DEFAULT_MODEL_DIR, load_model
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import local_server
from tests.speech import needs_espeak, silence, speech
from tests.test_server import check_event_contract, config, run_stream

NAMED = "the meeting with siobhan nguyen is at noon"  # a name the lexicon lacks ("siobhan", "nguyen")
NAME = "Siobhan Nguyen"
PLAIN = "the weather is nice today"


@pytest.fixture(scope="module")
def factory():
    model = load_model(DEFAULT_MODEL_DIR)
    return DecoderFactory(DecoderConfig().resolve(None), model.vocabulary)


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL_DIR).eval()


def utterance(text: str) -> np.ndarray:
    return np.concatenate([silence(0.2), speech(text), silence(0.3)])


def offline_text(model, factory, audio: np.ndarray, phrases=()) -> str:
    with torch.no_grad():
        logprobs = torch.log_softmax(model.forward(torch.from_numpy(audio)[None]), -1)[0]
    values, ids = logprobs.topk(8, -1)
    decoder = factory(factory.boosting(normalize(phrases)) if phrases else None)
    decoder.push(ids.numpy(), values.numpy(), 0)
    decoder.finalize()
    return decoder.text


# --- checking and normalizing --------------------------------------------------------------------


def test_phrases_are_written_as_the_models_words():
    assert normalize([("Siobhan  Nguyen!", 5), ("state-of-the-art", 0), ("O'Brien's", 2)]) == (
        Phrase(("siobhan", "nguyen"), 5.0),
        Phrase(("state", "of", "the", "art"), DEFAULT_BOOST),
        Phrase(("o'brien's",), 2.0),
    )


@pytest.mark.parametrize(
    ("phrases", "match"),
    [
        ([("  ", 1)], "phrase 1 is empty"),
        ([("R2D2", 1)], "'r2d2' cannot be spelled"),
        ([("zorblax", 25)], "boost 25 is out of range"),
        ([("zorblax", -1)], "boost -1 is out of range"),
        ([("zorblax", float("nan"))], "out of range"),
        ([("a " * 11, 1)], "more than 10 words"),
        ([("word", 1)] * (MAX_PHRASES + 1), f"more than {MAX_PHRASES} phrases"),
        ([("x" * 6000, 1), ("y" * 6000, 1)], "more than 10000 characters"),
    ],
)
def test_bad_phrases_are_refused_naming_them(phrases, match):
    with pytest.raises(PhraseError, match=match):
        normalize(phrases)


# --- the session's lexicon and context graph --------------------------------------------------


def test_new_words_are_the_sessions_alone(factory):
    shared = factory.lexicon
    root, size = shared.root, shared.size
    children = dict(root[0])
    boosting = factory.boosting(normalize([(NAME, 0)]))
    assert "siobhan" in boosting.lexicon.words and "siobhan" not in shared.words
    assert shared.root is root and shared.size == size and shared.root[0] == children
    assert boosting.lexicon.size == size + sum(w not in shared.words for w in ("siobhan", "nguyen"))
    node = boosting.lexicon.root  # the session's trie spells the new word; the shared one does not
    for unit in boosting.lexicon.words["siobhan"]:
        node = node[0][boosting.lexicon.ids[unit]]
    assert "siobhan" in node[1]


def test_words_gain_their_boost_and_a_phrase_in_order_gains_once_more(factory):
    boosting = Boosting(normalize([("blue whale", 3), ("whale song", 5)]), factory.lexicon)
    state, gain = boosting.step(None, "blue")
    assert gain == 3
    state, gain = boosting.step(state, "whale")
    assert gain == 5 + 3  # whale's own boost (the larger), and "blue whale" complete
    state, gain = boosting.step(state, "song")
    assert gain == 5 + 5  # "whale song" completes from where "blue whale" ended
    assert boosting.step(None, "the") == (None, 0.0)
    assert boosting.step(None, "song")[1] == 5  # out of order: the word alone


@needs_espeak
def test_the_g2p_spells_the_lexicons_own_words_as_the_lexicon_does(factory):
    factory.boosting(normalize([("zorblax", 0)]))
    speller = factory._speller
    assert speller.agreement > 0.95
    assert speller.spell("hello") == factory.lexicon.words["hello"]
    assert speller.spell("zorblax")  # a made-up word is pronounced by espeak-ng's rules


# --- what the search hears ---------------------------------------------------------------------


@needs_espeak
def test_a_boosted_name_is_heard_where_it_is_missed_without(model, factory):
    audio = utterance(NAMED)
    assert "siobhan nguyen" not in offline_text(model, factory, audio)
    assert offline_text(model, factory, audio, [(NAME, 0)]) == NAMED


@needs_espeak
def test_unrelated_phrases_leave_ordinary_speech_alone(model, factory):
    audio = utterance(PLAIN)
    unrelated = [(NAME, 0), ("zorblax quindle", 0), ("kubernetes", 0), ("acme corporation", 0)]
    assert offline_text(model, factory, audio, unrelated) == offline_text(model, factory, audio) == PLAIN


# --- real servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with local_server(max_sessions=4) as srv:
        yield srv


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.CosyStreamStub(channel)


def stream_text(stub, phrases=()) -> str:
    data = (utterance(NAMED) * 32767).astype("<i2").tobytes()
    first = config(phrases=[pb.Phrase(text=text, boost=boost) for text, boost in phrases])
    finals = check_event_contract(run_stream(stub, first, data))
    return " ".join(f.transcript for f in finals)


@needs_espeak
def test_a_streams_phrases_are_boosted(stub):
    assert "siobhan nguyen" not in stream_text(stub)
    assert stream_text(stub, [(NAME, 0)]) == NAMED
    assert "siobhan nguyen" not in stream_text(stub)  # (the session's words went with it)


@pytest.mark.parametrize(
    ("phrases", "match"),
    [([("R2D2", 1)], "phrases: phrase 'R2D2': 'r2d2' cannot be spelled"), ([("x", 30)], "boost 30")],
)
def test_a_stream_with_bad_phrases_is_invalid_argument(stub, phrases, match):
    with pytest.raises(grpc.RpcError) as info:
        stream_text(stub, phrases)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in info.value.details()


@needs_espeak
def test_google_speech_contexts_are_boosted(server):
    pytest.importorskip("google.cloud.speech_v1")
    from google.cloud.speech_v1 import SpeechClient, SpeechContext
    from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport

    from tests.test_compat_google import recognize, streaming_config

    data = (utterance(NAMED) * 32767).astype("<i2").tobytes()
    with grpc.insecure_channel(server.address) as channel:
        client = SpeechClient(transport=SpeechGrpcTransport(channel=channel))

        def heard(contexts) -> str:
            responses = recognize(client, streaming_config(speech_contexts=contexts), data)
            return " ".join(r.alternatives[0].transcript for x in responses for r in x.results if r.is_final)

        assert "siobhan nguyen" not in heard([])
        assert heard([SpeechContext(phrases=[NAME], boost=10)]) == NAMED


@needs_espeak
def test_riva_boosted_lm_words(server):
    riva = pytest.importorskip("riva.client")

    data = (utterance(NAMED) * 32767).astype("<i2").tobytes()
    service = riva.ASRService(riva.Auth(uri=server.address))

    def recognize(words):
        streaming = riva.StreamingRecognitionConfig(
            config=riva.RecognitionConfig(
                encoding=riva.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000, language_code="en-US"
            ),
            interim_results=False,
        )
        riva.add_word_boosting_to_config(streaming.config, words, 10.0)
        chunks = (data[i : i + 3200] for i in range(0, len(data), 3200))
        responses = service.streaming_response_generator(chunks, streaming)
        return " ".join(r.alternatives[0].transcript for x in responses for r in x.results if r.is_final)

    assert "siobhan nguyen" not in recognize([])
    assert recognize(["siobhan", "nguyen"]) == NAMED


# --- OpenAI's prompt ----------------------------------------------------------------------------------

PROMPT = "Notes of the meeting with Siobhan Nguyen."


def test_a_prompts_longer_words_become_phrases(server):
    from cosystream.server.http.common import PROMPT_BOOST, prompt_phrases

    servicer = server.frontend.servicer
    phrases = prompt_phrases(servicer, "", "Call 555-0100: Siobhan's team, Nguyen & co. Nguyen!")
    assert [(p.text, p.boost) for p in phrases] == [
        (w, PROMPT_BOOST) for w in ("Call", "Siobhan's", "team", "Nguyen")
    ]
    assert prompt_phrases(servicer, "", "") == [] and prompt_phrases(servicer, "", "a b c 12") == []
    terms = prompt_phrases(servicer, "", "Siobhan Nguyen, Kubernetes;\nAcme Corp")  # a list of terms
    assert [(p.text, p.boost) for p in terms] == [("Siobhan Nguyen", 0), ("Kubernetes", 0), ("Acme Corp", 0)]


@pytest.fixture(scope="module")
def http_server():
    from tests.test_http import local_http_server

    with local_http_server() as srv:
        srv.http_url = f"http://127.0.0.1:{srv.frontend.http_port}"
        yield srv


@needs_espeak
def test_openai_transcriptions_prompt(http_server):
    openai = pytest.importorskip("openai")
    from tests.test_http import wav_file

    wav = wav_file(utterance(NAMED), 16000)
    with openai.OpenAI(base_url=f"{http_server.http_url}/v1", api_key="unused", max_retries=0) as client:
        plain = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav)).text
        prompted = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav), prompt=PROMPT).text
    assert "siobhan nguyen" not in plain.lower()
    assert prompted.lower().rstrip(".") == NAMED


@needs_espeak
def test_openai_realtime_transcription_prompt(http_server):
    import asyncio
    import json

    websockets = pytest.importorskip("websockets")
    from tests.test_http import appends, events_until, session_update, ws_url

    pcm = (utterance(NAMED) * 32767).astype("<i2").tobytes() + bytes(16000)

    async def run(prompt: str) -> str:
        async with websockets.connect(ws_url(http_server)) as ws:
            await ws.recv()  # session.created
            update = json.loads(session_update({"type": "audio/pcm", "rate": 16000}))
            update["session"]["audio"]["input"]["transcription"] = {"model": "whisper-1", "prompt": prompt}
            await ws.send(json.dumps(update))
            assert json.loads(await ws.recv())["type"] == "session.updated"
            for message in appends(pcm, 3200):
                await ws.send(message)
            events = await events_until(ws, "conversation.item.input_audio_transcription.completed")
            return events[-1]["transcript"]

    assert "siobhan nguyen" not in asyncio.run(run("")).lower()
    assert asyncio.run(run(PROMPT)).lower().rstrip(".") == NAMED
