"""What an uploaded file may cost before the server has checked it: ``POST /v1/audio/transcriptions`` reads
the header first (rate, length), admits the session (the token's quota) before decoding, and decodes a block
at a time; ``cosystream transcribe`` decodes with the same code. Against a real server on loopback."""

from __future__ import annotations

import io
import resource
import subprocess
import sys
import threading
import time
import wave

import grpc
import numpy as np
import pytest
import soundfile

from cosystream.audio.files import AudioTooLong, UndecodableAudio, open_audio
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.speech import needs_espeak, silence, speech
from tests.test_http import SENTENCE, encoded_file, form, heard, http, local_http_server, wav_file

pytestmark = needs_espeak

ONE = "one-00112233445566778899aabb"  # max_sessions=1
MAX_AUDIO_S = 30.0


def wav_claiming(rate_hz: int, samples: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(np.zeros(samples, np.int16).tobytes())
    return buffer.getvalue()


def damaged_flac() -> bytes:
    """A FLAC file whose header is sound and whose frames are not: decoding it fails part-way."""
    tone = (np.sin(np.arange(16000 * 5) * 0.05) * 0.3).astype(np.float32)
    data = bytearray(encoded_file(tone, 16000, "FLAC"))
    data[len(data) // 3 : len(data) // 3 + 2000] = b"\xff" * 2000
    return bytes(data)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"one {ONE} max_sessions=1\n")
    with local_http_server(tokens=tokens) as srv:
        srv.http_url = f"http://127.0.0.1:{srv.frontend.http_port}"
        yield srv


def wait_no_sessions(server, timeout_s: float = 10.0) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CosyStreamStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=(("authorization", f"Bearer {ONE}"),))
            if not info.active_sessions or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert info.active_sessions == 0, f"{info.active_sessions} engine slots still held"


def upload(server, data: bytes, name: str = "f.wav", token: str = ONE):
    return http(
        "POST",
        f"{server.http_url}/v1/audio/transcriptions",
        data=form(file=(name, data)),
        headers={"Authorization": f"Bearer {token}"},
    )


def test_a_rate_outside_8_to_48_khz_is_refused_at_once_with_memory_flat(server):
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.monotonic()
    reply = upload(server, wav_claiming(1, 20_000))  # 40 KB that claims 5.5 h once resampled to 16 kHz
    elapsed_s = time.monotonic() - started
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "invalid_audio", reply.text
    assert "1 Hz" in error["message"] and "8000 to 48000 Hz" in error["message"]
    assert elapsed_s < 5, f"the refusal took {elapsed_s:.1f} s"
    grown_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak_mb
    assert grown_mb < 100, f"the frontend's peak memory grew {grown_mb:.0f} MB"
    reply = upload(server, wav_file(speech(SENTENCE, rate_hz=48000), 96000))
    assert reply.status_code == 400 and "96000 Hz" in reply.json()["error"]["message"]
    wait_no_sessions(server)


def test_a_file_longer_than_the_limit_is_refused_by_its_header(tmp_path):
    long = encoded_file(silence(MAX_AUDIO_S + 5, 8000), 8000, "FLAC")  # small on the wire, long in audio
    with pytest.raises(AudioTooLong, match=r"35\.0 s long"):
        open_audio(long, max_duration_s=MAX_AUDIO_S)
    with local_http_server(http_fields={"max_upload_audio_s": MAX_AUDIO_S}) as srv:
        url = f"http://127.0.0.1:{srv.frontend.http_port}/v1/audio/transcriptions"
        reply = http("POST", url, data=form(file=("long.flac", long)))
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "audio_too_long" and "30 s" in reply.json()["error"]["message"]
        fits = encoded_file(np.concatenate([silence(0.3), speech(SENTENCE), silence(0.5)]), 16000, "FLAC")
        reply = http("POST", url, data=form(file=("short.flac", fits)))
        assert reply.status_code == 200 and heard(reply.json()["text"]), reply.text


def test_the_quota_is_checked_before_the_file_is_decoded(server):
    """The damaged FLAC gets 400 when it is decoded; with the token's one session held it gets 429: the
    refusal came before any decoding."""
    assert upload(server, damaged_flac(), "d.flac").json()["error"]["message"].startswith("file: the FLAC audio")
    stop = threading.Event()

    def held():
        yield pb.StreamingRecognizeRequest(config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000))
        while not stop.wait(0.05):
            yield pb.StreamingRecognizeRequest(audio=b"\0" * 320)

    with grpc.insecure_channel(server.address) as channel:
        call = pb_grpc.CosyStreamStub(channel).StreamingRecognize(
            held(), metadata=(("authorization", f"Bearer {ONE}"),), timeout=60
        )
        next(iter(call.initial_metadata()), None)  # the session is accepted: the quota is taken
        try:
            reply = upload(server, damaged_flac(), "d.flac")
            assert reply.status_code == 429, reply.text
            assert "max_sessions=1" in reply.json()["error"]["message"]
        finally:
            stop.set()
            list(call)
    wait_no_sessions(server)


def test_a_file_without_audio_is_one_rule_and_messages_show_no_internals(server):
    for name, data in (("empty.wav", b""), ("header-only.wav", wav_claiming(16000, 0))):
        reply = upload(server, data, name)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_audio", (name, reply.text)
    reply = upload(server, b"these are my notes, not audio\n" * 40, "notes.wav")
    message = reply.json()["error"]["message"]
    assert reply.status_code == 400 and "Format not recognised" in message, message
    assert "object at 0x" not in message and "<_io" not in message
    with pytest.raises(UndecodableAudio) as damaged:
        open_audio(damaged_flac()).read()
    assert "\n" not in str(damaged.value) and "object at" not in str(damaged.value)


@pytest.mark.parametrize("fmt", ["MP3", "FLAC"])
def test_transcribe_takes_what_the_http_api_takes(server, tmp_path, fmt):
    path = tmp_path / f"speech.{fmt.lower()}"
    audio = np.concatenate([silence(0.3, 24000), speech(SENTENCE, rate_hz=24000), silence(0.5, 24000)])
    soundfile.write(path, audio, 24000, format=fmt)
    done = subprocess.run(
        [sys.executable, "-m", "cosystream", "transcribe", str(path), "--server", server.address, "--token", ONE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert heard(done.stdout), done.stdout
    bad = tmp_path / "notes.mp3"
    bad.write_text("not audio\n" * 50)
    done = subprocess.run(
        [sys.executable, "-m", "cosystream", "transcribe", str(bad), "--server", server.address, "--token", ONE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "notes.mp3" in done.stderr and "Format not recognised" in done.stderr
