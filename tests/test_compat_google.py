"""The Google Cloud Speech-to-Text v1 protocol, driven by the unmodified google-cloud-speech client.

The model here may be untrained, so these tests pin the protocol (events, finals, offsets, errors), not
the words.
"""

from __future__ import annotations

import asyncio
import io
import time
import wave

import grpc
import numpy as np
import pytest

from tests.servers import local_server
from tests.speech import closer_to, encode, needs_espeak, silence, speech, two_speakers

speech_v1 = pytest.importorskip("google.cloud.speech_v1", reason="needs google-cloud-speech (the compat extra)")
from google.api_core import exceptions  # noqa: E402
from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from cosystream.server.compat.bridge import AbortGuard  # noqa: E402
from cosystream.server.compat.google_speech import EARLY_CODES  # noqa: E402
from cosystream.v1 import cosystream_pb2 as pb  # noqa: E402
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc  # noqa: E402

pytestmark = needs_espeak

SERVICE = "google.cloud.speech.v1.Speech"
SENTENCE = "the quick brown fox jumps over the lazy dog"
OTHER = "please call me back tomorrow morning"
Encoding = speech_v1.RecognitionConfig.AudioEncoding
Event = speech_v1.StreamingRecognizeResponse.SpeechEventType


@pytest.fixture(scope="module")
def server():
    with local_server(max_sessions=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    channel = grpc.insecure_channel(server.address)
    yield speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=channel))
    channel.close()


def streaming_config(rate_hz=16000, encoding=Encoding.LINEAR16, language_code="en-US", streaming=None, **config):
    recognition = speech_v1.RecognitionConfig(
        encoding=encoding, sample_rate_hertz=rate_hz, language_code=language_code, **config
    )
    return speech_v1.StreamingRecognitionConfig(config=recognition, **(streaming or {}))


def chunks(data: bytes, chunk_bytes: int = 3200):
    for offset in range(0, len(data), chunk_bytes):
        yield speech_v1.StreamingRecognizeRequest(audio_content=data[offset : offset + chunk_bytes])


def recognize(client, config, data: bytes, chunk_bytes: int = 3200) -> list:
    """The raw protobuf responses of one stream through the client's ``streaming_recognize`` helper."""
    responses = client.streaming_recognize(config, chunks(data, chunk_bytes), timeout=60)
    return [type(r).pb(r) for r in responses]


def check_google_contract(responses, voice_events: bool, interim_results: bool) -> list:
    """Assert what a Google client relies on; return the finals in order."""
    state, finals, last_end_s = "idle", [], 0.0
    for response in responses:
        kinds = [bool(response.results), response.speech_event_type != 0, response.HasField("error")]
        assert sum(kinds) == 1, f"exactly one of results / event / error per response: {response}"
        if response.speech_event_type == Event.SPEECH_ACTIVITY_BEGIN:
            assert voice_events and state == "idle", state
            state = "speaking"
        elif response.speech_event_type == Event.SPEECH_ACTIVITY_END:
            assert voice_events and state == "speaking", state
            state = "ended"
        for result in response.results:
            end_s = result.result_end_time.ToTimedelta().total_seconds()
            assert end_s >= last_end_s, "result_end_time never goes back"
            last_end_s = end_s
            texts = [a.transcript for a in result.alternatives]
            assert texts and len(set(texts)) == len(texts), "one alternative, or distinct ones on a final"
            assert result.is_final or len(texts) == 1, "interims carry one alternative"
            if result.is_final:
                assert state == ("ended" if voice_events else "idle"), f"final while {state}"
                assert result.stability == 0.0 and 0.0 <= result.alternatives[0].confidence <= 1.0
                finals.append(result)
                state = "idle"
            else:
                assert interim_results, "no interims unless asked"
                if voice_events:
                    assert state == "speaking", f"interim while {state}"
                assert 0.0 < result.stability <= 1.0 and not result.alternatives[0].words
    assert state == "idle", f"stream ended while {state}"
    return finals


def word_offsets_s(result) -> list[tuple[float, float]]:
    return [
        (w.start_time.ToTimedelta().total_seconds(), w.end_time.ToTimedelta().total_seconds())
        for w in result.alternatives[0].words
    ]


def wav_bytes(audio: np.ndarray, rate_hz: int, channels: int) -> bytes:
    pcm = encode(np.repeat(audio, channels), "LINEAR16")  # interleaved: each sample on every channel
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(pcm)
    return out.getvalue()


# --- the happy paths ------------------------------------------------------------------------------


def test_partials_events_and_word_offsets(client):
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    config = streaming_config(
        enable_word_time_offsets=True,
        enable_word_confidence=True,
        streaming={"interim_results": True, "enable_voice_activity_events": True},
    )
    responses = recognize(client, config, data)
    finals = check_google_contract(responses, voice_events=True, interim_results=True)
    assert len(finals) == 1
    assert any(not r.is_final for response in responses for r in response.results), "interims were asked for"
    begin = next(r for r in responses if r.speech_event_type == Event.SPEECH_ACTIVITY_BEGIN)
    assert 0.2 <= begin.speech_event_time.ToTimedelta().total_seconds() <= 0.5
    final = finals[0]
    words = word_offsets_s(final)
    assert [w.word for w in final.alternatives[0].words] == final.alternatives[0].transcript.split()
    assert all(start < end for start, end in words)
    assert [start for start, _ in words] == sorted(start for start, _ in words)
    assert words[-1][1] <= final.result_end_time.ToTimedelta().total_seconds() + 0.01
    assert all(0.0 <= w.confidence <= 1.0 for w in final.alternatives[0].words)


def test_two_utterances_two_finals(client):
    audio = np.concatenate([silence(0.5), speech(SENTENCE), silence(1.5), speech(OTHER), silence(1.0)])
    responses = recognize(client, streaming_config(), encode(audio, "LINEAR16"))
    finals = check_google_contract(responses, voice_events=False, interim_results=False)
    assert len(finals) == 2 and len(responses) == 2
    assert not finals[0].alternatives[0].words, "no words unless asked"


def test_single_utterance_ends_the_stream_while_the_client_still_sends(client):
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0), speech(OTHER)]), "LINEAR16")
    sent_s = []

    def requests():
        yield from chunks(data)
        while len(sent_s) < 3000:  # then silence, as a microphone would, for up to 30 s
            sent_s.append(time.monotonic())
            time.sleep(0.01)
            yield speech_v1.StreamingRecognizeRequest(audio_content=bytes(320))

    config = streaming_config(streaming={"single_utterance": True, "interim_results": True})
    started = time.monotonic()
    responses = [type(r).pb(r) for r in client.streaming_recognize(config, requests(), timeout=60)]
    assert time.monotonic() - started < 20
    events = [r.speech_event_type for r in responses if r.speech_event_type]
    assert events == [Event.END_OF_SINGLE_UTTERANCE]
    index = next(i for i, r in enumerate(responses) if r.speech_event_type)
    after = responses[index + 1 :]
    assert len(after) == 1 and after[0].results[0].is_final, (
        "END_OF_SINGLE_UTTERANCE, then the final, then the end"
    )
    assert all(not r.is_final for response in responses[:index] for r in response.results)


@pytest.mark.parametrize(
    ("rate_hz", "channels", "encoding"),
    [(8000, 2, Encoding.ENCODING_UNSPECIFIED), (16000, 1, Encoding.LINEAR16)],
)
def test_wav_header_is_parsed_and_stripped(client, rate_hz, channels, encoding):
    audio = np.concatenate([silence(0.3, rate_hz), speech(SENTENCE, rate_hz=rate_hz), silence(1.0, rate_hz)])
    data = wav_bytes(audio, rate_hz, channels)
    config = streaming_config(rate_hz=0, encoding=encoding)
    finals = check_google_contract(
        recognize(client, config, data, 1001), voice_events=False, interim_results=False
    )
    assert len(finals) == 1


def test_mulaw(client):
    audio = np.concatenate([silence(0.3, 8000), speech(SENTENCE, rate_hz=8000), silence(1.0, 8000)])
    config = streaming_config(rate_hz=8000, encoding=Encoding.MULAW)
    responses = recognize(client, config, encode(audio, "MULAW"), 801)
    assert len(check_google_contract(responses, voice_events=False, interim_results=False)) == 1


def test_half_close_flushes_the_last_final(client):
    data = encode(np.concatenate([silence(0.2), speech(SENTENCE)]), "LINEAR16")  # no trailing silence
    config = streaming_config(streaming={"enable_voice_activity_events": True})
    responses = recognize(client, config, data)
    assert len(check_google_contract(responses, voice_events=True, interim_results=False)) == 1
    assert recognize(client, streaming_config(), b"") == []


@pytest.mark.parametrize("encoding", [Encoding.LINEAR16, Encoding.MULAW])
def test_separate_recognition_per_channel(client, server, encoding):
    """Two channels, each its own session: each channel's finals come back tagged 1 or 2, with its own
    words (a downmix would give both sentences mixed in one)."""
    name = "LINEAR16" if encoding == Encoding.LINEAR16 else "MULAW"
    data, sentences = two_speakers(SENTENCE, OTHER, encoding=name), [SENTENCE, OTHER]
    config = streaming_config(
        encoding=encoding, audio_channel_count=2, enable_separate_recognition_per_channel=True
    )
    responses = recognize(client, config, data, chunk_bytes=4 * 1601)  # frames split across requests
    finals = {1: [], 2: []}
    for response in responses:
        for result in response.results:
            assert result.channel_tag in (1, 2)
            if result.is_final:
                finals[result.channel_tag].append(result.alternatives[0].transcript)
    assert finals[1] and finals[2], responses
    assert closer_to(" ".join(finals[1]), sentences) == SENTENCE
    assert closer_to(" ".join(finals[2]), sentences) == OTHER
    with grpc.insecure_channel(server.address) as channel:  # both channels' sessions are gone
        info = pb_grpc.CosyStreamStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert info.active_sessions == 0


def test_a_request_over_the_native_limit_is_accepted(client):
    # 4 MB of silence in one request (Google allows 10 MB; the native default limit is 1 MiB).
    assert recognize(client, streaming_config(), bytes(4 << 20), 4 << 20) == []


# --- errors --------------------------------------------------------------------------------------


BAD_CONFIGS = [
    ({"language_code": "fr-FR"}, "bad language code"),
    ({"encoding": Encoding.AMR}, "AMR is not supported"),
    ({"encoding": Encoding.FLAC}, "expected a FLAC stream"),
    ({"rate_hz": 100}, "8000 to 48000"),
    ({"rate_hz": 0}, "sample_rate_hertz is required"),
    ({"encoding": Encoding.ENCODING_UNSPECIFIED}, "no WAV header"),
    ({"profanity_filter": True}, "profanity_filter (transcripts are not masked) is not supported"),
    (
        {"diarization_config": {"enable_speaker_diarization": True}},
        "diarization_config.enable_speaker_diarization",
    ),
    ({"alternative_language_codes": ["es-ES"]}, "alternative_language_codes es-ES (en-US only)"),
    ({"enable_spoken_punctuation": True}, "enable_spoken_punctuation is not supported"),
    (
        {"adaptation": {"custom_classes": [{"custom_class_id": "streets", "items": [{"value": "elm"}]}]}},
        "adaptation.custom_classes (phrase sets and speech_contexts are boosted; classes are not)",
    ),
    (
        {"adaptation": {"phrase_set_references": ["projects/p/locations/l/phraseSets/a", "b"]}},
        "one adaptation.phrase_set_references per stream",
    ),
    (
        {"streaming": {"voice_activity_timeout": {"speech_start_timeout": {"seconds": 5}}}},
        "voice_activity_timeout",
    ),
    (
        {
            "enable_separate_recognition_per_channel": True,
            "audio_channel_count": 2,
            "streaming": {"single_utterance": True},
        },
        "cannot be combined",
    ),
]


def test_hints_and_fields_google_treats_as_best_effort_are_accepted(client):
    """speech_contexts (hints), max_alternatives (up to that many), use_enhanced and metadata: what Google
    itself may not honour in full is accepted, and the stream is recognized (tests/test_alternatives.py
    pins max_alternatives)."""
    data = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)]), "LINEAR16")
    config = streaming_config(
        speech_contexts=[{"phrases": ["quick brown fox"]}],
        max_alternatives=3,
        use_enhanced=True,
        metadata={"interaction_type": "DICTATION"},
    )
    finals = check_google_contract(recognize(client, config, data), voice_events=False, interim_results=False)
    assert len(finals) == 1 and len(finals[0].alternatives) <= 3


@pytest.mark.parametrize(("config", "match"), BAD_CONFIGS)
def test_bad_config_is_invalid_argument(client, config, match):
    with pytest.raises(exceptions.InvalidArgument) as info:
        recognize(client, streaming_config(**config), bytes(3200))
    assert match in info.value.message


def test_a_rate_that_contradicts_the_wav_header_is_invalid_argument(client):
    data = wav_bytes(silence(0.5, 8000), 8000, 1)
    with pytest.raises(exceptions.InvalidArgument) as info:
        recognize(client, streaming_config(rate_hz=16000), data)
    assert "does not match the WAV header" in info.value.message


def test_audio_before_the_config_is_invalid_argument(client):
    plain_streaming_recognize = speech_v1.services.speech.SpeechClient.streaming_recognize
    with pytest.raises(exceptions.InvalidArgument) as info:
        list(plain_streaming_recognize(client, requests=chunks(bytes(320))))
    assert "Malordered" in info.value.message


def test_idle_before_the_first_response_is_out_of_range_not_retried(client):
    """DEADLINE_EXCEEDED would make the client retry with its half-consumed request iterator."""

    def requests():
        time.sleep(4.0)  # the server's idle timeout is 3 s
        yield from chunks(bytes(320))

    started = time.monotonic()
    with pytest.raises(exceptions.OutOfRange):
        list(client.streaming_recognize(streaming_config(), requests(), timeout=60))
    assert time.monotonic() - started < 8


# --- discovery -----------------------------------------------------------------------------------


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        listed = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in listed for s in r.list_services_response.service}
        assert {SERVICE, "cosystream.v1.CosyStream"} <= names
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)
        (answer,) = reflect.ServerReflectionInfo(iter([request]))
        assert answer.file_descriptor_response.file_descriptor_proto, answer


def test_unavailable_and_deadline_are_remapped_only_before_the_first_response():
    class Context:
        async def abort(self, code, details="", trailing_metadata=()):
            aborted.append(code)

    aborted: list[grpc.StatusCode] = []
    guard = AbortGuard(Context(), EARLY_CODES)
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL):
        asyncio.run(guard.abort(code, "x"))
    guard.responded = True
    asyncio.run(guard.abort(grpc.StatusCode.UNAVAILABLE, "x"))
    assert aborted == [
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
    ]
