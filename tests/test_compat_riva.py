"""The NVIDIA Riva ASR protocol, driven by the unmodified nvidia-riva-client, and the WAV sniffing and
downmixing the adapters share.

The model here may be untrained, so these tests pin the protocol (partials, finals, offsets, errors), not
the words.
"""

from __future__ import annotations

import io
import struct
import time
import wave

import grpc
import numpy as np
import pytest
import soundfile

from cosystream.audio.codecs import MULAW_TO_INT16, AudioEncoding
from cosystream.audio.wav import is_wav, parse_wav_header
from cosystream.server import compat
from cosystream.server.compat.bridge import Downmixer
from tests.servers import local_server
from tests.speech import closer_to, encode, needs_espeak, silence, speech, two_speakers

riva_client = pytest.importorskip("riva.client", reason="needs nvidia-riva-client (the compat extra)")
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402
from riva.client.proto import riva_asr_pb2 as rasr  # noqa: E402

SERVICE = "nvidia.riva.asr.RivaSpeechRecognition"
SENTENCE = "the quick brown fox jumps over the lazy dog"
OTHER = "please call me back tomorrow morning"
Encoding = riva_client.AudioEncoding


@pytest.fixture(scope="module")
def server():
    with local_server(max_sessions=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def asr(server):
    service = riva_client.ASRService(riva_client.Auth(uri=server.address))
    yield service
    service.auth.channel.close()


def streaming_config(rate_hz=16000, encoding=Encoding.LINEAR_PCM, interim_results=False, **config):
    config.setdefault("language_code", "en-US")
    recognition = riva_client.RecognitionConfig(encoding=encoding, sample_rate_hertz=rate_hz, **config)
    return riva_client.StreamingRecognitionConfig(config=recognition, interim_results=interim_results)


def chunks(data: bytes, chunk_bytes: int = 3200):
    return (data[offset : offset + chunk_bytes] for offset in range(0, len(data), chunk_bytes))


def check_riva_contract(responses, interim_results: bool) -> list:
    """Assert what a Riva client relies on; return the finals in order."""
    finals, last_processed_s, partial, stable = [], 0.0, "", True
    for response in responses:
        assert len(response.results) == 1
        result = response.results[0]
        assert len(result.alternatives) == 1
        assert result.audio_processed >= last_processed_s, "audio_processed never goes back"
        last_processed_s = result.audio_processed
        transcript = result.alternatives[0].transcript
        # Greedy interims (stability 1) only grow; beam-search interims (0.5) may revise words.
        stable = stable and (result.is_final or result.stability == 1.0)
        if stable:
            assert transcript.startswith(partial)
        if result.is_final:
            finals.append(result)
            partial, stable = "", True
        else:
            assert interim_results, "no partials unless asked"
            assert result.stability in (0.5, 1.0)
            partial = transcript
    return finals


def write_wav(path, audio: np.ndarray, rate_hz: int, channels: int) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(encode(np.repeat(audio, channels), "LINEAR16"))


# --- streams through the Riva client ---------------------------------------------------------------


@needs_espeak
def test_partials_then_final_with_word_offsets(asr):
    audio = np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0)])
    config = streaming_config(interim_results=True, enable_word_time_offsets=True)
    responses = list(asr.streaming_response_generator(chunks(encode(audio, "LINEAR16")), config))
    finals = check_riva_contract(responses, interim_results=True)
    assert len(finals) == 1 and len(responses) > 1, "partials, then one final"
    final = finals[0]
    words = final.alternatives[0].words
    assert [w.word for w in words] == final.alternatives[0].transcript.split()
    assert all(0 <= w.start_time < w.end_time for w in words), "int32 ms offsets"
    assert [w.start_time for w in words] == sorted(w.start_time for w in words)
    speech_end_s = 0.3 + len(speech(SENTENCE)) / 16000
    assert speech_end_s - 0.3 <= final.audio_processed <= speech_end_s + 1.0, "float seconds"


@needs_espeak
@pytest.mark.parametrize(("rate_hz", "channels", "file_specs"), [(8000, 2, False), (16000, 1, True)])
def test_raw_wav_file_with_encoding_unspecified(asr, tmp_path, rate_hz, channels, file_specs):
    """Riva's file clients send the WAV file's bytes, header included, with encoding 0 (and rate 0 unless
    they read it from the file)."""
    audio = np.concatenate(
        [
            silence(0.3, rate_hz),
            speech(SENTENCE, rate_hz=rate_hz),
            silence(1.5, rate_hz),
            speech(OTHER, rate_hz=rate_hz),
        ]
    )
    path = tmp_path / "speech.wav"
    write_wav(path, audio, rate_hz, channels)
    config = streaming_config(rate_hz=0, encoding=Encoding.ENCODING_UNSPECIFIED, interim_results=True)
    if file_specs:
        riva_client.add_audio_file_specs_to_config(config, path)
        assert config.config.sample_rate_hertz == rate_hz
    with riva_client.AudioChunkFileIterator(path, 1600) as audio_chunks:
        responses = list(asr.streaming_response_generator(audio_chunks, config))
    assert len(check_riva_contract(responses, interim_results=True)) == 2


@needs_espeak
@pytest.mark.parametrize("encoding", ["MULAW", "ALAW"])
def test_g711(asr, encoding):
    audio = np.concatenate([silence(0.3, 8000), speech(SENTENCE, rate_hz=8000), silence(1.0, 8000)])
    config = streaming_config(rate_hz=8000, encoding=getattr(Encoding, encoding))
    responses = list(asr.streaming_response_generator(chunks(encode(audio, encoding), 801), config))
    assert len(check_riva_contract(responses, interim_results=False)) == 1


@needs_espeak
def test_half_close_flushes_the_last_final(asr):
    data = encode(np.concatenate([silence(0.2), speech(SENTENCE)]), "LINEAR16")  # no trailing silence
    responses = list(asr.streaming_response_generator(chunks(data), streaming_config()))
    assert len(check_riva_contract(responses, interim_results=False)) == 1
    assert list(asr.streaming_response_generator(iter([]), streaming_config())) == []


@needs_espeak
def test_stop_history_sets_the_silence_that_ends_an_utterance(asr):
    audio = np.concatenate([silence(0.3), speech(SENTENCE), silence(1.0), speech(OTHER), silence(2.5)])
    config = streaming_config()
    config.config.endpointing_config.stop_history = 2000  # longer than the pause between the sentences
    responses = list(asr.streaming_response_generator(chunks(encode(audio, "LINEAR16")), config))
    assert len(check_riva_contract(responses, interim_results=False)) == 1


BAD_CONFIGS = [
    ({"language_code": "de-DE"}, "Unavailable model requested given these parameters: language_code=de-DE"),
    ({"model": "conformer-en-US-asr-streaming"}, "model=conformer-en-US-asr-streaming"),
    ({"encoding": Encoding.OGGOPUS}, "expected an Ogg page"),  # (zeros declared as Ogg Opus)
    ({"rate_hz": 96000}, "8000 to 48000"),
    ({"encoding": Encoding.ENCODING_UNSPECIFIED}, "no WAV header"),
    ({"profanity_filter": True}, "profanity_filter is not supported"),
    (
        {"diarization_config": rasr.SpeakerDiarizationConfig(enable_speaker_diarization=True)},
        "enable_speaker_diarization is not supported",
    ),
]


@pytest.mark.parametrize(("config", "match"), BAD_CONFIGS)
def test_bad_config_is_invalid_argument(asr, config, match):
    with pytest.raises(grpc.RpcError) as info:
        list(asr.streaming_response_generator(iter([bytes(3200)]), streaming_config(**config)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in info.value.details()


@needs_espeak
def test_separate_recognition_per_channel(asr, server):
    """Two channels, each its own session: finals tagged channel 1 and 2, each with its own words."""
    data = two_speakers(SENTENCE, OTHER)
    config = streaming_config(audio_channel_count=2, enable_separate_recognition_per_channel=True)
    finals = {1: [], 2: []}
    for response in asr.streaming_response_generator(chunks(data, 6402), config):
        for result in response.results:
            if result.is_final:
                finals[result.channel_tag].append(result.alternatives[0].transcript)
    assert closer_to(" ".join(finals[1]), [SENTENCE, OTHER]) == SENTENCE, finals
    assert closer_to(" ".join(finals[2]), [SENTENCE, OTHER]) == OTHER, finals
    assert active_sessions(server) == 0


def test_list_models(asr, server):
    response = asr.stub.GetRivaSpeechRecognitionConfig(rasr.RivaSpeechRecognitionConfigRequest())
    (model,) = response.model_config
    assert model.parameters["type"] == "online" and model.parameters["language_code"] == "en-US"
    named = rasr.RivaSpeechRecognitionConfigRequest(model_name=model.model_name)
    assert len(asr.stub.GetRivaSpeechRecognitionConfig(named).model_config) == 1
    other = rasr.RivaSpeechRecognitionConfigRequest(model_name="no-such-model")
    assert len(asr.stub.GetRivaSpeechRecognitionConfig(other).model_config) == 0


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        listed = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        assert SERVICE in {s.name for r in listed for s in r.list_services_response.service}


# --- offline Recognize through the Riva client ---------------------------------------------------------


def offline_config(rate_hz=16000, encoding=Encoding.LINEAR_PCM, **config):
    config.setdefault("language_code", "en-US")
    return riva_client.RecognitionConfig(encoding=encoding, sample_rate_hertz=rate_hz, **config)


def active_sessions(server) -> int:
    from cosystream.v1 import cosystream_pb2 as pb
    from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.address) as channel:
        return pb_grpc.CosyStreamStub(channel).GetServerInfo(pb.GetServerInfoRequest()).active_sessions


@needs_espeak
def test_offline_recognize_one_result_per_utterance(asr, server):
    audio = np.concatenate([silence(0.3), speech(SENTENCE), silence(1.5), speech(OTHER), silence(0.5)])
    config = offline_config(enable_word_time_offsets=True)
    response = asr.offline_recognize(encode(audio, "LINEAR16"), config)
    assert len(response.results) == 2, response
    processed = [result.audio_processed for result in response.results]
    assert 0 < processed[0] < processed[1] <= len(audio) / 16000 + 0.1, "float seconds, the utterance's end"
    for result in response.results:
        (alternative,) = result.alternatives
        assert [w.word for w in alternative.words] == alternative.transcript.split()
        assert all(0 <= w.start_time < w.end_time for w in alternative.words), "int32 ms offsets"
        assert list(alternative.language_code) == ["en-US"]
    streamed = list(asr.streaming_response_generator(chunks(encode(audio, "LINEAR16")), streaming_config()))
    finals = [r.results[0].alternatives[0].transcript for r in streamed if r.results[0].is_final]
    assert [r.alternatives[0].transcript for r in response.results] == finals, "the same words as a stream"
    assert active_sessions(server) == 0


@needs_espeak
def test_offline_recognize_a_wav_file_as_riva_s_file_client_sends_it(asr, tmp_path):
    """transcribe_file_offline.py sends the file's bytes, header included, with the file's rate and channels."""
    path = tmp_path / "speech.wav"
    write_wav(
        path, np.concatenate([silence(0.3, 8000), speech(SENTENCE, rate_hz=8000), silence(0.5, 8000)]), 8000, 2
    )
    config = offline_config(rate_hz=0)
    riva_client.add_audio_file_specs_to_config(config, path)
    response = asr.offline_recognize(path.read_bytes(), config)
    assert len(response.results) == 1 and response.results[0].alternatives[0].transcript, response


@needs_espeak
def test_offline_recognize_per_channel(asr, server):
    config = offline_config(audio_channel_count=2, enable_separate_recognition_per_channel=True)
    response = asr.offline_recognize(two_speakers(SENTENCE, OTHER), config)
    finals: dict[int, list[str]] = {}
    for result in response.results:
        finals.setdefault(result.channel_tag, []).append(result.alternatives[0].transcript)
    assert closer_to(" ".join(finals[1]), [SENTENCE, OTHER]) == SENTENCE, finals
    assert closer_to(" ".join(finals[2]), [SENTENCE, OTHER]) == OTHER, finals
    deadline = time.monotonic() + 10
    while active_sessions(server) and time.monotonic() < deadline:  # (the engine announces its count)
        time.sleep(0.05)
    assert active_sessions(server) == 0


@pytest.mark.parametrize(
    ("config", "content", "match"),
    [
        ({"language_code": "de-DE"}, bytes(3200), "type=offline"),
        ({"encoding": Encoding.FLAC, "rate_hz": 0}, b"fLaC" + bytes(300), "the audio content"),
        ({}, b"", "empty"),
        ({"encoding": Encoding.FLAC, "rate_hz": 0}, "FLAC-3601-s", "3601.0 s long"),  # by its header
    ],
)
def test_offline_recognize_refusals_are_invalid_argument(asr, server, config, content, match):
    if content == "FLAC-3601-s":
        buffer = io.BytesIO()
        soundfile.write(buffer, np.zeros(8000 * 3601, np.int16), 8000, format="FLAC")
        content = buffer.getvalue()
    with pytest.raises(grpc.RpcError) as info:
        asr.offline_recognize(content, offline_config(**config))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in info.value.details()
    assert active_sessions(server) == 0


# --- WAV headers and downmixing, no server ---------------------------------------------------------


def wav_header(tag: int, channels: int, rate_hz: int, bits: int, extra_chunks: bytes = b"", fmt_size: int = 16):
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate_hz, rate_hz * block, block, bits)
    if fmt_size > 16:  # WAVE_FORMAT_EXTENSIBLE: cbSize, valid bits, channel mask, sub-format GUID
        fmt += struct.pack("<HHIH14s", 22, bits, 0, 1 if tag == 0xFFFE else tag, b"\0" * 14)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + extra_chunks + b"data" + struct.pack("<I", 0)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_wav_header_parsing():
    header = wav_header(1, 2, 8000, 16, extra_chunks=b"LIST" + struct.pack("<I", 3) + b"abc\0")
    assert is_wav(header) and not is_wav(b"\0" * 64)
    wav, offset = parse_wav_header(header + b"\1\2")
    assert (wav.encoding, wav.sample_rate_hz, wav.channels, offset) == (
        AudioEncoding.LINEAR16,
        8000,
        2,
        len(header),
    )
    assert parse_wav_header(header[:30]) is None, "an incomplete header asks for more bytes"
    assert parse_wav_header(wav_header(7, 1, 8000, 8))[0].encoding == AudioEncoding.MULAW
    assert parse_wav_header(wav_header(6, 1, 8000, 8))[0].encoding == AudioEncoding.ALAW
    extensible = wav_header(0xFFFE, 1, 16000, 16, fmt_size=40)
    assert parse_wav_header(extensible)[0].encoding == AudioEncoding.LINEAR16
    with pytest.raises(ValueError, match="24-bit"):
        parse_wav_header(wav_header(1, 1, 16000, 24))


def test_downmix_g711_to_linear16():
    codes = np.array([[0x10, 0x90], [0x7F, 0xFF], [0x00, 0x33]], dtype=np.uint8)  # 3 stereo frames
    mono = np.frombuffer(Downmixer(AudioEncoding.MULAW, 2).push(codes.tobytes()), "<i2")
    expected = MULAW_TO_INT16[codes].astype(np.int32).sum(axis=1) // 2
    assert mono.tolist() == expected.tolist()


def test_adapters_are_off_without_their_wheels(monkeypatch):
    class Server:
        def add_generic_rpc_handlers(self, handlers):
            raise AssertionError("nothing may be registered")

    monkeypatch.setattr(compat, "_installed", lambda module: False)
    assert compat.add_compat_services(None, Server()) == []


def test_downmix_carries_split_frames():
    left = np.array([1000, -2000, 300], dtype="<i2")
    right = np.array([3000, 2000, -301], dtype="<i2")
    stereo = np.stack([left, right], axis=1).tobytes()
    mixer = Downmixer(AudioEncoding.LINEAR16, 2)
    mono = b"".join(mixer.push(stereo[i : i + 3]) for i in range(0, len(stereo), 3))
    assert np.frombuffer(mono, "<i2").tolist() == [2000, 0, -1]
