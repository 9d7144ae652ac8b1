"""Compressed audio in streams: OGG_OPUS, WEBM_OPUS and FLAC, decoded as the bytes arrive.

The decoders on their own (any chunking gives the same samples; FLAC bit-exact against libsndfile on
noise full of false frame syncs; chained Ogg streams; Matroska lacing; bad bytes refused with what was
wrong), then real streams on loopback: our API, the official Google and Riva clients, and WebM recorded by a
real headless Chromium's MediaRecorder from its fake microphone.
"""

from __future__ import annotations

import base64
import io
import shutil
import struct

import grpc
import numpy as np
import pytest
import soundfile

from cosystream.audio.codecs import AudioEncoding
from cosystream.audio.streams import MAX_PACKET_BYTES, AudioFormatError, _unlace, open_stream_audio
from cosystream.v1 import cosystream_pb2 as pb
from tests.servers import local_server
from tests.speech import closer_to, compress, encode, needs_espeak, silence, speech
from tests.test_server import OTHER, SENTENCE, check_event_contract, config, run_stream

av = pytest.importorskip("av", reason="needs PyAV (the codecs extra)")

CONTAINERS = {"ogg": AudioEncoding.OGG_OPUS, "webm": AudioEncoding.WEBM_OPUS, "flac": AudioEncoding.FLAC}


def decode(encoding: AudioEncoding, data: bytes, chunk: int, rate_hz: int = 0) -> np.ndarray:
    decoder = open_stream_audio(encoding, rate_hz)
    parts = [decoder.decode(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    return np.concatenate([*parts, decoder.flush()])


def sentence_audio(rate_hz: int = 16000) -> np.ndarray:
    return np.concatenate([silence(0.4, rate_hz), speech(SENTENCE, rate_hz=rate_hz), silence(1.0, rate_hz)])


# --- the decoders ----------------------------------------------------------------------------------


@needs_espeak
@pytest.mark.parametrize("container", ["ogg", "webm", "flac"])
@pytest.mark.parametrize("channels", [1, 2])
def test_any_chunking_decodes_the_same_samples(container, channels):
    audio = sentence_audio()
    data = compress(audio, 16000, container, channels)
    whole = decode(CONTAINERS[container], data, len(data))
    for chunk in (1, 13, 320, 4001):
        assert np.array_equal(decode(CONTAINERS[container], data, chunk), whole), chunk
    # The same audio: FLAC to the last bit of 16-bit PCM; Opus (lossy) closely, and time-aligned.
    if container == "flac":
        assert len(whole) == len(audio)
        assert np.abs(whole - audio).max() <= 1 / 32768
    else:
        assert abs(len(whole) - len(audio)) <= 16 * 15  # the last packet's padding (WebM keeps it)
        n = min(len(whole), len(audio))
        assert np.corrcoef(whole[:n], audio[:n])[0, 1] > 0.95


@pytest.mark.parametrize("seed", [1, 2])
def test_flac_is_bit_exact_on_noise_full_of_false_frame_syncs(seed):
    """White noise does not compress: FLAC frames of it hold many 0xFFF8 patterns that are not headers."""
    noise = np.random.default_rng(seed).uniform(-0.9, 0.9, 16000 * 20).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, noise, 16000, format="FLAC", subtype="PCM_16")
    data = out.getvalue()
    frames = -(-len(noise) // 4096)
    assert data.count(b"\xff\xf8") + data.count(b"\xff\xf9") > frames + 5
    reference, _ = soundfile.read(io.BytesIO(data), dtype="float32")
    for chunk in (997, len(data)):  # (16 kHz: no resampling, the decoded samples as they are)
        assert np.array_equal(decode(AudioEncoding.FLAC, data, chunk), reference)


@needs_espeak
def test_chained_ogg_streams_play_one_after_the_other():
    one, two = speech(SENTENCE), speech(OTHER)
    data = compress(one, 16000, "ogg") + compress(two, 16000, "ogg")
    decoded = decode(AudioEncoding.OGG_OPUS, data, 500)
    assert abs(len(decoded) - len(one) - len(two)) <= 2


def test_matroska_lacing():
    frames = [b"a" * 300, b"bb" * 7, b"c" * 255, b"d"]
    xiph = bytes([len(frames) - 1]) + b"\xff\x2d" + bytes([14]) + b"\xff\x00" + b"".join(frames)
    assert _unlace(xiph, 0, 1, "x") == frames
    # EBML: the first size as a vint (300 = 0x412C), then signed differences (-286, +241) as vints.
    ebml = bytes([len(frames) - 1]) + b"\x41\x2c" + b"\x5e\xe1" + b"\x60\xf0" + b"".join(frames)
    assert _unlace(ebml, 0, 3, "x") == frames
    assert _unlace(bytes([2]) + b"xyzxyzxyz", 0, 2, "x") == [b"xyz"] * 3
    with pytest.raises(AudioFormatError, match="overrun"):
        _unlace(bytes([1]) + b"\xff\xff\x05ab", 0, 1, "x")


@pytest.mark.parametrize(
    ("encoding", "data", "match"),
    [
        (AudioEncoding.OGG_OPUS, b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(40), "expected an Ogg page"),
        (AudioEncoding.WEBM_OPUS, b"OggS" + bytes(60), "expected a WebM"),
        (AudioEncoding.FLAC, b"OggS" + bytes(60), "Ogg FLAC is not supported"),
        (AudioEncoding.FLAC, b"fLaC\x84\x00\x00\x02ab", "not STREAMINFO"),
    ],
)
def test_bytes_that_are_not_the_declared_format(encoding, data, match):
    with pytest.raises(AudioFormatError, match=match):
        decode(encoding, data, 7)


def test_an_ogg_stream_that_is_not_opus():
    page = (
        b"OggS\x00\x02" + bytes(8) + struct.pack("<II", 1, 0) + bytes(4) + b"\x01\x1e" + b"\x01vorbis" + bytes(23)
    )
    with pytest.raises(AudioFormatError, match="does not begin with an Opus header"):
        decode(AudioEncoding.OGG_OPUS, page + page.replace(b"\x02", b"\x00", 1), 1000)


def test_a_packet_that_never_ends_is_refused_at_the_bound():
    """Ogg pages whose every segment is 255 bytes continue one packet for ever: refused, not buffered."""
    head = b"OpusHead\x01\x01\x38\x01\x80\xbb\x00\x00\x00\x00\x00"
    first = b"OggS\x00\x02" + bytes(8) + struct.pack("<II", 7, 0) + bytes(4) + bytes([1, len(head)]) + head
    endless = (
        b"OggS\x00\x01"
        + bytes(8)
        + struct.pack("<II", 7, 1)
        + bytes(4)
        + b"\xff"
        + b"\xff" * 255
        + bytes(255 * 255)
    )
    decoder = open_stream_audio(AudioEncoding.OGG_OPUS, 0)
    decoder.decode(first)
    with pytest.raises(AudioFormatError, match=f"over {MAX_PACKET_BYTES}"):
        for _ in range(MAX_PACKET_BYTES // len(endless) + 2):
            decoder.decode(endless)


# --- streams on loopback ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with local_server(max_sessions=4) as srv:
        yield srv


@needs_espeak
@pytest.mark.parametrize("container", ["ogg", "webm", "flac"])
@pytest.mark.parametrize("rate_hz", [16000, 48000])
def test_a_compressed_stream_is_recognized(stub, container, rate_hz):
    data = compress(sentence_audio(rate_hz), rate_hz, container)
    declared = 0 if container == "flac" and rate_hz == 48000 else rate_hz
    responses = run_stream(stub, config(declared, CONTAINERS[container]), data, chunk_bytes=400)
    finals = check_event_contract(responses)
    assert len(finals) == 1
    assert closer_to(finals[0].transcript, [SENTENCE, OTHER]) == SENTENCE
    assert 300 <= finals[0].start_ms <= 700


@pytest.mark.parametrize(
    ("encoding", "rate_hz", "match"),
    [
        (pb.OGG_OPUS, 44100, "not an Opus rate"),
        (pb.WEBM_OPUS, 7000, "not an Opus rate"),
        (pb.FLAC, 96000, "48000"),
    ],
)
def test_rates_a_compressed_stream_cannot_declare(stub, encoding, rate_hz, match):
    with pytest.raises(grpc.RpcError) as err:
        run_stream(stub, config(rate_hz, encoding), b"")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.value.details()


@needs_espeak
def test_a_flac_rate_that_does_not_match_its_header(stub):
    data = compress(sentence_audio(), 16000, "flac")
    with pytest.raises(grpc.RpcError) as err:
        run_stream(stub, config(8000, pb.FLAC), data)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not match the stream's header (16000 Hz)" in err.value.details()


@needs_espeak
def test_garbage_after_good_audio_gets_its_final_then_invalid_argument(stub):
    """What decoded is transcribed (its final first), then the stream ends INVALID_ARGUMENT, saying why."""
    data = compress(sentence_audio(), 16000, "ogg") + b"RIFF" + bytes(2000)
    call = stub.StreamingRecognize(iter([config(16000, pb.OGG_OPUS), pb.StreamingRecognizeRequest(audio=data)]))
    responses = []
    with pytest.raises(grpc.RpcError) as err:
        for response in call:
            responses.append(response)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected an Ogg page ('OggS')" in err.value.details()
    finals = [r for response in responses for r in response.results if r.is_final]
    assert len(finals) == 1 and closer_to(finals[0].transcript, [SENTENCE, OTHER]) == SENTENCE
    # The server goes on.
    ok = run_stream(stub, config(), encode(sentence_audio(), "LINEAR16"))
    assert len(check_event_contract(ok)) == 1


def test_server_info_lists_the_compressed_encodings(stub):
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert set(info.encodings) == {pb.LINEAR16, pb.MULAW, pb.ALAW, pb.OGG_OPUS, pb.FLAC, pb.WEBM_OPUS}


# --- the official clients --------------------------------------------------------------------------


@needs_espeak
@pytest.mark.parametrize(("container", "encoding"), [("ogg", "OGG_OPUS"), ("webm", "WEBM_OPUS"), ("flac", "FLAC")])
def test_google_streaming_recognize(server, container, encoding):
    speech_v1 = pytest.importorskip("google.cloud.speech_v1")
    from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport

    data = compress(sentence_audio(48000), 48000, container, channels=2)
    with grpc.insecure_channel(server.address) as channel:
        client = speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=channel))
        streaming = speech_v1.StreamingRecognitionConfig(
            config=speech_v1.RecognitionConfig(
                encoding=getattr(speech_v1.RecognitionConfig.AudioEncoding, encoding),
                sample_rate_hertz=48000,
                audio_channel_count=2,
                language_code="en-US",
            )
        )
        requests = (
            speech_v1.StreamingRecognizeRequest(audio_content=data[i : i + 1000])
            for i in range(0, len(data), 1000)
        )
        responses = list(client.streaming_recognize(streaming, requests, timeout=60))
    finals = [r for response in responses for r in response.results if r.is_final]
    assert len(finals) == 1
    assert closer_to(finals[0].alternatives[0].transcript, [SENTENCE, OTHER]) == SENTENCE


@needs_espeak
@pytest.mark.parametrize(("container", "encoding"), [("ogg", "OGGOPUS"), ("flac", "FLAC")])
def test_riva_streaming_recognize(server, container, encoding):
    riva = pytest.importorskip("riva.client")

    data = compress(sentence_audio(), 16000, container)
    auth = riva.Auth(uri=server.address)
    service = riva.ASRService(auth)
    streaming = riva.StreamingRecognitionConfig(
        config=riva.RecognitionConfig(
            encoding=getattr(riva.AudioEncoding, encoding), sample_rate_hertz=16000, language_code="en-US"
        ),
        interim_results=False,
    )
    chunks = (data[i : i + 1000] for i in range(0, len(data), 1000))
    responses = list(service.streaming_response_generator(chunks, streaming))
    finals = [r for response in responses for r in response.results if r.is_final]
    assert len(finals) == 1
    assert closer_to(finals[0].alternatives[0].transcript, [SENTENCE, OTHER]) == SENTENCE


# --- a real browser's recording --------------------------------------------------------------------

RECORD = """
const done = arguments[arguments.length - 1];
navigator.mediaDevices.getUserMedia({audio: true}).then((stream) => {
  const recorder = new MediaRecorder(stream, {mimeType: 'audio/webm;codecs=opus'});
  const parts = [];
  recorder.ondataavailable = (event) => parts.push(event.data);
  recorder.onstop = async () => {
    const bytes = new Uint8Array(await new Blob(parts).arrayBuffer());
    let text = '';
    for (let i = 0; i < bytes.length; i += 8192) text += String.fromCharCode(...bytes.subarray(i, i + 8192));
    done({parts: parts.length, data: btoa(text)});
  };
  recorder.start(100);  // a blob every 100 ms, as a live uploader sends them
  setTimeout(() => { recorder.stop(); stream.getTracks().forEach((t) => t.stop()); }, arguments[0]);
}).catch((err) => done({error: String(err)}));
"""


@needs_espeak
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium and chromedriver")
def test_webm_recorded_by_a_browser(stub, tmp_path):
    """Chromium's MediaRecorder writes WebM as it records (a Segment and Clusters of unknown size,
    SimpleBlocks of 20 ms Opus packets); its blobs, sent as they come, are recognized."""
    from tests.test_browser import CHROMEDRIVER, chromium, http_server

    if CHROMEDRIVER is None:
        pytest.skip("needs chromedriver")
    rate_hz = 48000
    wav = tmp_path / "speech.wav"
    soundfile.write(wav, sentence_audio(rate_hz), rate_hz, subtype="PCM_16")
    with (
        http_server() as page_server,
        chromium(
            "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={wav}%noloop",
        ) as driver,
    ):
        driver.set_script_timeout(30)
        driver.get(page_server.http_url)  # (a secure context: getUserMedia is allowed)
        recorded = driver.execute_async_script(RECORD, 4500)
    assert "error" not in recorded, recorded
    data = base64.b64decode(recorded["data"])
    assert recorded["parts"] > 10 and data.startswith(b"\x1a\x45\xdf\xa3")
    responses = run_stream(stub, config(48000, pb.WEBM_OPUS), data, chunk_bytes=1600)
    finals = check_event_contract(responses)
    assert len(finals) == 1
    assert closer_to(finals[0].transcript, [SENTENCE, OTHER]) == SENTENCE


@needs_espeak
def test_google_separate_channels_of_a_compressed_stream_are_refused(server):
    speech_v1 = pytest.importorskip("google.cloud.speech_v1")
    from google.api_core import exceptions
    from google.cloud.speech_v1.services.speech.transports import SpeechGrpcTransport

    data = compress(sentence_audio(), 16000, "ogg", channels=2)
    with grpc.insecure_channel(server.address) as channel:
        client = speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=channel))
        streaming = speech_v1.StreamingRecognitionConfig(
            config=speech_v1.RecognitionConfig(
                encoding=speech_v1.RecognitionConfig.AudioEncoding.OGG_OPUS,
                sample_rate_hertz=16000,
                audio_channel_count=2,
                enable_separate_recognition_per_channel=True,
                language_code="en-US",
            )
        )
        requests = iter([speech_v1.StreamingRecognizeRequest(audio_content=data)])
        with pytest.raises(exceptions.InvalidArgument, match="OGG_OPUS stream is recognized downmixed"):
            list(client.streaming_recognize(streaming, requests, timeout=60))
