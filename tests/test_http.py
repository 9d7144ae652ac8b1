"""The HTTP port: OpenAI's transcription API and Realtime transcription events, driven by the unmodified
``openai`` client and by a plain ``websockets`` client, against a real server on loopback."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import ssl
import time
import wave
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import openai
import pytest
import soundfile
import websockets
from openai import AsyncOpenAI, OpenAI

from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from cosystream.frontend.host import StreamOptions
from cosystream.server.frontend import FrontendConfig
from cosystream.server.http import HttpConfig
from cosystream.server.http.secrets import ClientSecrets
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from tests.servers import Served
from tests.speech import encode, needs_espeak, silence, speech

pytestmark = needs_espeak

SENTENCE = "the quick brown fox jumps over the lazy dog"
OTHER = "please call me back tomorrow morning"
TOKEN = "alice-0123456789abcdef0123"
REALTIME_ONLY = "rt-00112233445566778899aa"


class Reply:
    def __init__(self, status: int, text: str, headers=None):
        self.status_code, self.text, self.headers = status, text, headers or {}

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, ssl_context: ssl.SSLContext | None = None, **kwargs) -> Reply:
    """One plain HTTP request (aiohttp's client), for what the OpenAI SDK does not send."""

    async def go():
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, url, ssl=ssl_context or True, **kwargs) as response,
        ):
            return Reply(response.status, await response.text(), dict(response.headers))

    return asyncio.run(go())


def form(**fields) -> aiohttp.FormData:
    data = aiohttp.FormData()
    for name, value in fields.items():
        if isinstance(value, tuple):
            data.add_field(name, value[1], filename=value[0])
        else:
            data.add_field(name, value)
    return data


def heard(transcript: str, sentence: str = SENTENCE) -> bool:
    """Most of the sentence's words are in the transcript (the model is small; espeak is not a person)."""
    words = set(sentence.split())
    return len(words & set(transcript.split())) >= len(words) - 2


def two_sentences(rate_hz: int = 16000) -> np.ndarray:
    return np.concatenate(
        [
            silence(0.3, rate_hz),
            speech(SENTENCE, rate_hz=rate_hz),
            silence(1.0, rate_hz),
            speech(OTHER, rate_hz=rate_hz),
            silence(0.6, rate_hz),
        ]
    )


def wav_file(audio: np.ndarray, rate_hz: int, channels: int = 1) -> bytes:
    samples = np.frombuffer(encode(audio, "LINEAR16"), "<i2")
    if channels > 1:
        samples = np.repeat(samples, channels)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(samples.tobytes())
    return buffer.getvalue()


def encoded_file(audio: np.ndarray, rate_hz: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, rate_hz, format=fmt, subtype=subtype)
    return buffer.getvalue()


def local_http_server(
    tokens: Path | None = None, max_upload_bytes: int = 25 << 20, http_fields: dict | None = None, **frontend
) -> LocalServer:
    config = FrontendConfig(
        host="127.0.0.1",
        port=0,
        stream=StreamOptions(idle_timeout_s=5.0),
        auth_tokens=None if tokens is None else str(tokens),
        http=HttpConfig(host="127.0.0.1", port=0, max_upload_bytes=max_upload_bytes, **(http_fields or {})),
        **frontend,
    )
    return LocalServer(frontend_config=config, engine=EngineConfig(max_sessions=12, max_batch=12))


@pytest.fixture(scope="module")
def server():
    with local_http_server(max_upload_bytes=2 << 20) as srv:
        srv.http_url = f"http://127.0.0.1:{srv.frontend.http_port}"
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def active_sessions(server) -> int:
    with grpc.insecure_channel(server.address) as channel:
        return pb_grpc.CosyStreamStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=5).active_sessions


def wait_no_sessions(server, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (n := active_sessions(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert n == 0, f"{n} engine slots still held"


# --- POST /v1/audio/transcriptions ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_wav():
    return wav_file(two_sentences(), 16000)


def test_json_text_and_usage(client, two_wav):
    result = client.audio.transcriptions.create(model="whisper-1", file=("speech.wav", two_wav))
    assert heard(result.text) and heard(result.text, OTHER), result.text
    assert result.usage.type == "duration" and result.usage.seconds == math.ceil(len(two_sentences()) / 16000)
    text = client.audio.transcriptions.create(
        model="gpt-4o-transcribe", file=("speech.wav", two_wav), response_format="text"
    )
    assert text.strip() == result.text


def test_subtitles_have_one_cue_per_utterance(client, two_wav):
    srt = client.audio.transcriptions.create(model="whisper-1", file=("s.wav", two_wav), response_format="srt")
    blocks = [b.splitlines() for b in srt.strip().split("\n\n")]
    assert [b[0] for b in blocks] == ["1", "2"], srt
    start, end = blocks[0][1].split(" --> ")
    assert start.startswith("00:00:00,") and start < end < blocks[1][1].split(" --> ")[0], srt
    assert heard(blocks[0][2]) and heard(blocks[1][2], OTHER)
    vtt = client.audio.transcriptions.create(model="whisper-1", file=("s.wav", two_wav), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n") and vtt.count(" --> ") == 2 and "00:00:00." in vtt, vtt


def test_verbose_json_segments_and_words(client, two_wav):
    result = client.audio.transcriptions.create(
        model="whisper-1",
        file=("s.wav", two_wav),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert result.language == "english" and abs(result.duration - len(two_sentences()) / 16000) < 0.01
    assert len(result.segments) == 2
    first, second = result.segments
    assert 0.2 <= first.start < first.end <= second.start < second.end <= result.duration
    assert heard(first.text) and first.text.startswith(" ")
    assert [w.word for w in result.words] == result.text.split()
    assert all(a.start <= a.end <= b.start + 0.05 for a, b in zip(result.words, result.words[1:], strict=False))
    only_words = client.audio.transcriptions.create(
        model="whisper-1",
        file=("s.wav", two_wav),
        response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    assert only_words.words and not only_words.segments


def test_streamed_transcription_is_a_delta_per_utterance_then_the_text(client, two_wav):
    events = list(
        client.audio.transcriptions.create(model="gpt-4o-mini-transcribe", file=("s.wav", two_wav), stream=True)
    )
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    assert [e.type for e in events] == ["transcript.text.delta"] * len(deltas) + ["transcript.text.done"]
    assert len(deltas) == 2 and "".join(d.delta for d in deltas) == events[-1].text
    assert heard(events[-1].text) and heard(events[-1].text, OTHER)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda a: wav_file(a(8000), 8000), id="wav-8k"),
        pytest.param(lambda a: wav_file(a(44100), 44100, channels=2), id="wav-44k-stereo"),
        pytest.param(lambda a: wav_file(a(48000), 48000), id="wav-48k"),
        pytest.param(lambda a: encoded_file(a(16000), 16000, "WAV", "FLOAT"), id="wav-float"),
        pytest.param(lambda a: encoded_file(a(16000), 16000, "FLAC"), id="flac"),
        pytest.param(lambda a: encoded_file(a(22050), 22050, "OGG", "VORBIS"), id="ogg-vorbis"),
        pytest.param(lambda a: encoded_file(a(24000), 24000, "MP3"), id="mp3"),
    ],
)
def test_files_at_any_rate_and_in_compressed_formats(client, make):
    audio = make(
        lambda rate: np.concatenate([silence(0.3, rate), speech(SENTENCE, rate_hz=rate), silence(0.5, rate)])
    )
    result = client.audio.transcriptions.create(model="whisper-1", file=("speech", audio))
    assert heard(result.text), result.text


def test_errors_are_in_openais_shape_and_map_to_its_exceptions(client, server, two_wav):
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(model="whisper-1", file=("notes.txt", b"not audio at all " * 100))
    assert bad.value.code == "invalid_audio" and "notes.txt" in bad.value.message and "WAV" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(model="large-v9", file=("s.wav", two_wav))
    assert bad.value.code == "model_not_found" and "cosystream" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(model="whisper-1", file=("s.wav", two_wav), language="fr")
    assert bad.value.code == "unsupported_language"
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(model="whisper-1", file=("s.wav", two_wav), response_format="csv")
    assert bad.value.param == "response_format"
    big = wav_file(silence(70.0), 16000)  # 2.2 MB over the server's 2 MiB limit
    with pytest.raises(openai.APIStatusError) as large:
        client.audio.transcriptions.create(model="whisper-1", file=("long.wav", big))
    assert large.value.status_code == 413 and large.value.code == "file_too_large"
    # What the SDK does not send: a raw form without the file, a body that is not a form, a wrong path.
    response = http(
        "POST", f"{server.http_url}/v1/audio/transcriptions", data=form(model="whisper-1", x=("x", b"1"))
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    response = http("POST", f"{server.http_url}/v1/audio/transcriptions", json={"file": "x"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = http("GET", f"{server.http_url}/v1/nothing")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    wait_no_sessions(server)


def test_models_health_and_the_page(client, server):
    assert [m.id for m in client.models.list()] == [m.name for m in server.frontend.servicer.info.models]
    assert http("GET", f"{server.http_url}/health").json() == {"status": "SERVING"}
    page = http("GET", f"{server.http_url}/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    script = http("GET", f"{server.http_url}/static/captions.js")
    assert script.status_code == 200 and script.headers["Cache-Control"] == "no-cache"


def test_a_client_that_hangs_up_mid_file_frees_its_slot(server):
    # Long enough to be mid-file when the client hangs up (a quiet 2-core machine transcribes 6 sentences in
    # 0.29 s; 18 are 1.7 MB, under this server's 2 MB limit): the client hangs up once the server holds the
    # file's slot, and the answer must not have come yet.
    long = wav_file(np.concatenate([speech(SENTENCE)] * 18), 16000)

    async def hang_up():
        async with aiohttp.ClientSession() as session:
            request = asyncio.ensure_future(
                session.post(f"{server.http_url}/v1/audio/transcriptions", data=form(file=("s.wav", long)))
            )
            deadline = time.monotonic() + 10
            while not await asyncio.to_thread(active_sessions, server) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert not request.done(), "the transcription ended before the client hung up"
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(hang_up())
    wait_no_sessions(server)


# --- Realtime transcription over WebSocket --------------------------------------------------------------


def ws_url(server, query: str = "intent=transcription") -> str:
    return f"ws://127.0.0.1:{server.frontend.http_port}/v1/realtime?{query}"


def appends(pcm: bytes, chunk_bytes: int) -> list[str]:
    return [
        json.dumps(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + chunk_bytes]).decode()}
        )
        for i in range(0, len(pcm), chunk_bytes)
    ]


async def events_until(ws, last: str, count: int = 1, timeout_s: float = 20.0) -> list[dict]:
    events, seen = [], 0
    while seen < count:
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
        events.append(event)
        seen += event["type"] == last
    return events


def session_update(fmt: dict, turn_detection="server_vad", **extra) -> str:
    audio_input: dict = {"format": fmt}
    if turn_detection == "server_vad":
        audio_input["turn_detection"] = {"type": "server_vad", "silence_duration_ms": 400}
    elif turn_detection is None:
        audio_input["turn_detection"] = None
    return json.dumps(
        {"type": "session.update", "session": {"type": "transcription", "audio": {"input": audio_input}}, **extra}
    )


async def pcm_session(ws, rate_hz: int) -> dict:
    """Past ``session.created``: set PCM at ``rate_hz`` with server VAD; returns ``session.updated``."""
    await ws.recv()
    await ws.send(session_update({"type": "audio/pcm", "rate": rate_hz}))
    return json.loads(await ws.recv())


def check_items(events: list[dict]) -> list[dict]:
    """The Realtime contract per item: started, deltas that rebuild the text, stopped + committed, the last
    deltas (the final may differ from the last interim), completed."""
    completed = []
    text: dict[str, str] = {}
    order: dict[str, list[str]] = {}
    for event in events:
        kind, item = event["type"], event.get("item_id")
        if kind.startswith("input_audio_buffer.") or kind.startswith("conversation.item."):
            order.setdefault(item, []).append(kind.rsplit(".", 1)[-1])
        if kind.endswith(".delta"):
            text[item] = event["delta"] if event.get("replace") else text.get(item, "") + event["delta"]
            assert text[item] == event["transcript"]
        if kind.endswith(".completed"):
            assert event["transcript"] == text.get(item, ""), "the deltas rebuild the final text"
            completed.append(event)
    for kinds in order.values():
        assert kinds[0] == "speech_started" and kinds[-1] == "completed", kinds
        stopped = kinds.index("speech_stopped")
        assert kinds[stopped + 1] == "committed", kinds
        assert set(kinds[1:stopped] + kinds[stopped + 2 : -1]) <= {"delta"}, kinds
    return completed


def test_server_vad_items_over_a_plain_websocket(server):
    pcm = encode(two_sentences(16000), "LINEAR16")

    async def run():
        async with websockets.connect(ws_url(server)) as ws:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created" and created["session"]["type"] == "transcription"
            await ws.send(session_update({"type": "audio/pcm", "rate": 16000}))
            updated = json.loads(await ws.recv())
            assert updated["type"] == "session.updated"
            assert updated["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 400
            for message in appends(pcm, 320):  # 10 ms chunks
                await ws.send(message)
            return await events_until(ws, "conversation.item.input_audio_transcription.completed", 2)

    events = asyncio.run(run())
    completed = check_items(events)
    assert heard(completed[0]["transcript"]) and heard(completed[1]["transcript"], OTHER)
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    assert 200 <= started[0]["audio_start_ms"] <= 500 and started[1]["audio_start_ms"] > 3000
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert committed[1]["previous_item_id"] == committed[0]["item_id"]
    assert all(e["latency"]["receive_to_send_ms"] >= 0 for e in events if e["type"].endswith(".delta"))
    assert [w["word"] for w in completed[0]["words"]] == completed[0]["transcript"].split()
    wait_no_sessions(server)


def test_manual_turns_with_g711_and_the_older_dialect(server):
    """turn_detection null: a commit ends the buffer and its item spans both sentences; mu-law at 8 kHz;
    transcription_session.update answered as such."""
    pcm = encode(two_sentences(8000), "MULAW")

    async def run():
        async with websockets.connect(ws_url(server), additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
            assert json.loads(await ws.recv())["type"] == "transcription_session.created"
            update = {"input_audio_format": "g711_ulaw", "turn_detection": None}
            await ws.send(json.dumps({"type": "transcription_session.update", "session": update}))
            updated = json.loads(await ws.recv())
            assert updated["type"] == "transcription_session.updated"
            assert (
                updated["session"]["input_audio_format"] == "g711_ulaw"
                and updated["session"]["turn_detection"] is None
            )
            for message in appends(pcm, 800):
                await ws.send(message)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            return await events_until(ws, "conversation.item.input_audio_transcription.completed")

    events = asyncio.run(run())
    kinds = [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" not in kinds, "no turn detection: no speech events"
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    completed = events[-1]
    assert completed["item_id"] == committed["item_id"]
    assert heard(completed["transcript"]) and heard(completed["transcript"], OTHER)


def test_the_official_client_realtime_connection(server):
    pcm = encode(
        np.concatenate([silence(0.3, 24000), speech(SENTENCE, rate_hz=24000), silence(0.8, 24000)]), "LINEAR16"
    )

    async def run():
        client = AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="unused")
        seen = []
        async with client.realtime.connect(extra_query={"intent": "transcription"}) as connection:
            await connection.session.update(
                session={
                    "type": "transcription",
                    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
                }
            )
            for i in range(0, len(pcm), 9600):
                await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + 9600]).decode())
            async for event in connection:
                seen.append(event)
                if event.type == "conversation.item.input_audio_transcription.completed":
                    break
        return seen

    events = asyncio.run(run())
    assert events[0].type == "session.created" and events[1].type == "session.updated"
    assert "input_audio_buffer.speech_started" in [e.type for e in events]
    assert heard(events[-1].transcript), events[-1].transcript


def test_bad_events_get_error_events_and_the_session_goes_on(server):
    pcm = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(0.8)]), "LINEAR16")

    async def run():
        async with websockets.connect(ws_url(server)) as ws:
            await ws.recv()
            errors = []
            for bad in (
                "not json",
                json.dumps({"type": "response.create"}),
                json.dumps({"type": "input_audio_buffer.append", "audio": "***", "event_id": "mine"}),
                json.dumps({"type": "input_audio_buffer.append"}),
                json.dumps({"type": "input_audio_buffer.commit"}),
                session_update({"type": "audio/opus"}),
                session_update({"type": "audio/pcm", "rate": 4000}),
            ):
                await ws.send(bad)
                errors.append(json.loads(await ws.recv()))
            await ws.send(session_update({"type": "audio/pcm", "rate": 16000}))
            await ws.recv()
            for message in appends(pcm, 3200):
                await ws.send(message)
            done = await events_until(ws, "conversation.item.input_audio_transcription.completed")
            return errors, done

    errors, done = asyncio.run(run())
    assert [e["type"] for e in errors] == ["error"] * 7
    codes = [e["error"]["code"] for e in errors]
    assert codes[:5] == [
        "invalid_json",
        "invalid_event_type",
        "invalid_value",
        "missing_required_parameter",
        "input_audio_buffer_commit_empty",
    ]
    assert errors[2]["error"]["event_id"] == "mine" and all(e["error"]["message"] for e in errors)
    assert heard(done[-1]["transcript"])


def test_clear_drops_the_buffer_and_a_dropped_connection_frees_its_slot(server):
    speech_pcm = encode(np.concatenate([silence(0.3), speech(SENTENCE)]), "LINEAR16")

    async def run():
        async with websockets.connect(ws_url(server)) as ws:
            await pcm_session(ws, 16000)
            for message in appends(speech_pcm, 3200):
                await ws.send(message)
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            events = await events_until(ws, "input_audio_buffer.cleared", timeout_s=10)
        ws = await websockets.connect(ws_url(server))  # then speech, and gone without a close
        await ws.recv()
        for message in appends(speech_pcm, 3200):
            await ws.send(message)
        ws.transport.abort()
        return events

    events = asyncio.run(run())
    assert events[-1]["type"] == "input_audio_buffer.cleared"
    wait_no_sessions(server)


def test_websocket_sessions_beside_grpc_streams(server):
    """Several WebSocket sessions and native gRPC streams at once, each its own transcript."""
    audio16 = np.concatenate([silence(0.3), speech(OTHER), silence(0.8)])
    pcm = encode(audio16, "LINEAR16")

    async def websocket_session():
        async with websockets.connect(ws_url(server)) as ws:
            await pcm_session(ws, 16000)
            for message in appends(pcm, 320):
                await ws.send(message)
                await asyncio.sleep(0.004)
            events = await events_until(ws, "conversation.item.input_audio_transcription.completed")
            return events[-1]["transcript"]

    async def grpc_stream():
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.CosyStreamStub(channel)

            async def requests():
                yield pb.StreamingRecognizeRequest(
                    config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000)
                )
                for i in range(0, len(pcm), 320):
                    yield pb.StreamingRecognizeRequest(audio=pcm[i : i + 320])
                    await asyncio.sleep(0.004)

            finals = [
                r.transcript
                async for response in stub.StreamingRecognize(requests())
                for r in response.results
                if r.is_final
            ]
            return " ".join(finals)

    async def run():
        return await asyncio.gather(*(websocket_session() for _ in range(4)), *(grpc_stream() for _ in range(3)))

    transcripts = asyncio.run(run())
    assert all(heard(t, OTHER) for t in transcripts), transcripts
    wait_no_sessions(server)


def test_a_drain_gives_websocket_sessions_their_final_then_closes_them():
    pcm = encode(np.concatenate([silence(0.3), speech(SENTENCE)]), "LINEAR16")
    with local_http_server(drain_grace_s=0.5) as srv:
        url = f"ws://127.0.0.1:{srv.frontend.http_port}/v1/realtime?intent=transcription"

        async def run():
            async with websockets.connect(url) as ws:
                await pcm_session(ws, 16000)
                for message in appends(pcm, 3200):
                    await ws.send(message)
                await asyncio.sleep(0.5)
                asyncio.run_coroutine_threadsafe(srv.frontend.drain(), srv.loop)
                events = []
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    while True:
                        events.append(json.loads(await asyncio.wait_for(ws.recv(), 15)))
                return events, closed.value

        events, closed = asyncio.run(run())
    completed = [e for e in events if e["type"].endswith(".completed")]
    assert completed and heard(completed[0]["transcript"]), events
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "unavailable"
    assert closed.rcvd.code == 1012


# --- Tokens and client secrets ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("http-tokens") / "tokens"
    tokens.write_text(f"alice {TOKEN}\nrt {REALTIME_ONLY} priorities=REALTIME\n")
    with local_http_server(tokens) as srv:
        srv.http_url = f"http://127.0.0.1:{srv.frontend.http_port}"
        yield srv


def test_tokens_guard_the_api_but_not_the_page_or_health(secured):
    wav = wav_file(np.concatenate([silence(0.3), speech(SENTENCE), silence(0.5)]), 16000)
    with OpenAI(base_url=f"{secured.http_url}/v1", api_key="wrong-token-0123456789", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.audio.transcriptions.create(model="whisper-1", file=("s.wav", wav))
        assert refused.value.code == "invalid_api_key" and "not known" in refused.value.message
    with OpenAI(base_url=f"{secured.http_url}/v1", api_key=TOKEN, max_retries=0) as client:
        assert heard(client.audio.transcriptions.create(model="whisper-1", file=("s.wav", wav)).text)
    with OpenAI(base_url=f"{secured.http_url}/v1", api_key=REALTIME_ONLY, max_retries=0) as client:
        with pytest.raises(openai.PermissionDeniedError) as denied:  # files run at BATCH priority
            client.audio.transcriptions.create(model="whisper-1", file=("s.wav", wav))
        assert "BATCH" in denied.value.message
    assert http("GET", f"{secured.http_url}/health").status_code == 200
    assert http("GET", f"{secured.http_url}/").status_code == 200
    assert http("POST", f"{secured.http_url}/v1/realtime/client_secrets", json={}).status_code == 401


def test_a_client_secret_in_another_encoding_than_issued_is_refused(secured):
    """The secret's last character carries 4 spare bits: 16 characters decode to the same bytes there. Only
    the encoding the server issued opens a session (and is spent by it)."""
    import base64
    import string

    from cosystream.server.http.secrets import SecretRefused

    secrets = ClientSecrets(secured.frontend.servicer.token_sessions, secured.frontend.tokens)
    secret, _ = secrets.issue(secured.frontend.tokens.tokens[0])

    def decoded(value: str) -> bytes:
        encoded = value[len("ek_") :]
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))

    alphabet = string.ascii_letters + string.digits + "-_"
    twins = [secret[:-1] + c for c in alphabet if c != secret[-1] and decoded(secret[:-1] + c) == decoded(secret)]
    assert len(twins) == 15
    for twin in twins:
        with pytest.raises(SecretRefused, match="not one this server issued"):
            secrets.spend(twin)
    assert secrets.spend(secret) is secured.frontend.tokens.tokens[0]


def test_client_secrets_open_one_websocket_each_and_expire(secured):
    url = f"ws://127.0.0.1:{secured.frontend.http_port}/v1/realtime?intent=transcription"
    with OpenAI(base_url=f"{secured.http_url}/v1", api_key=TOKEN, max_retries=0) as client:
        secret = client.realtime.client_secrets.create(session={"type": "transcription"})
    assert secret.value.startswith("ek_") and secret.expires_at > time.time()
    older = http(
        "POST",
        f"{secured.http_url}/v1/realtime/transcription_sessions",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={},
    ).json()["client_secret"]["value"]
    token = secured.frontend.tokens.tokens[0]
    expired, _ = ClientSecrets(secured.frontend.servicer.token_sessions, secured.frontend.tokens).issue(
        token, ttl_s=-1
    )
    # Forged: one character of the MAC changed. (Not the last one alone: its spare bits decode to the same
    # bytes for some changes; the server refuses those too, as another encoding than the one it issued.)
    middle = len(older) - 6
    forged = older[:middle] + ("A" if older[middle] != "A" else "B") + older[middle + 1 :]

    async def opens(**kwargs) -> bool:
        try:
            async with websockets.connect(url, **kwargs) as ws:
                return json.loads(await ws.recv())["type"] == "session.created"
        except websockets.InvalidStatus as err:
            assert err.response.status_code == 401
            return False

    async def run():
        protocols = ["realtime", f"openai-insecure-api-key.{secret.value}"]
        return [
            await opens(subprotocols=protocols),
            await opens(subprotocols=protocols),  # spent
            await opens(additional_headers={}, subprotocols=["realtime"]),  # nothing presented
            await opens(),
            await opens(subprotocols=[f"openai-insecure-api-key.{expired}"]),
            await opens(subprotocols=[f"openai-insecure-api-key.{forged}"]),
            await opens(
                additional_headers={"Authorization": f"Bearer {TOKEN}"}
            ),  # a real token: a server's way in
        ]

    assert asyncio.run(run()) == [True, False, False, False, False, False, True]

    async def by_query():
        async with websockets.connect(f"{url}&client_secret={older}") as ws:
            return json.loads(await ws.recv())["type"]

    assert asyncio.run(by_query()) == "session.created"


def test_client_secrets_work_on_every_frontend_and_only_once_across_them(tmp_path):
    """Two frontend processes share the HTTP port: a secret issued by one opens a connection on either,
    and once spent on one is refused by both."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN}\n")
    with Served("--frontends", "2", "--auth-tokens", str(tokens)) as served:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if http("GET", f"{served.http_url}/health").status_code == 200:
                    break
            except aiohttp.ClientError:
                pass
            time.sleep(0.2)
        url = f"ws://127.0.0.1:{served.http_port}/v1/realtime?intent=transcription"
        secrets = [
            http(
                "POST",
                f"{served.http_url}/v1/realtime/client_secrets",
                headers={"Authorization": f"Bearer {TOKEN}"},
                json={},
            ).json()["value"]
            for _ in range(12)
        ]

        async def opens(secret: str) -> bool:
            try:
                async with websockets.connect(url, subprotocols=[f"openai-insecure-api-key.{secret}"]) as ws:
                    await ws.recv()
                    return True
            except websockets.InvalidStatus:
                return False

        async def run():
            first = [await opens(s) for s in secrets]
            again = [await opens(s) for s in secrets]
            return first, again

        first, again = asyncio.run(run())  # (the kernel spreads 12 connections over both frontends)
    assert all(first) and not any(again)


def test_https_with_the_grpc_ports_certificate_reloaded_when_renewed(tmp_path):
    security = pytest.importorskip("tests.test_security", reason="needs cryptography (the dev extra)")
    pki = security.Pki(tmp_path)
    from cosystream.server.tls import TlsConfig

    wav = wav_file(np.concatenate([silence(0.3), speech(SENTENCE), silence(0.5)]), 16000)
    cert, key = tmp_path / "live.pem", tmp_path / "live.key"
    cert.write_bytes(pki.read("server.pem"))
    key.write_bytes(pki.read("server.key"))
    with local_http_server(tls=TlsConfig(str(cert), str(key))) as srv:
        health = f"https://localhost:{srv.frontend.http_port}/health"
        trusted = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki.path("ca.pem")))
        with OpenAI(
            base_url=f"https://localhost:{srv.frontend.http_port}/v1", api_key="x", http_client=trusted
        ) as c:
            assert heard(c.audio.transcriptions.create(model="whisper-1", file=("s.wav", wav)).text)
        renewed = ssl.create_default_context(cafile=pki.path("ca2.pem"))
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            http("GET", health, ssl_context=renewed)
        security.replace(key, pki.read("server2.key"))  # a renewal: the key first, then the certificate
        security.replace(cert, pki.read("server2.pem"))
        assert http("GET", health, ssl_context=renewed).status_code == 200, "a new connection, the new certificate"
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            http("GET", health, ssl_context=ssl.create_default_context(cafile=pki.path("ca.pem")))


def test_http_requests_and_websockets_are_counted(server, client, two_wav):
    from prometheus_client import REGISTRY

    def count(route: str, status: int) -> float:
        labels = {"route": route, "status": str(status)}
        return REGISTRY.get_sample_value("cosystream_http_requests_total", labels) or 0.0

    before_ok = count("/v1/audio/transcriptions", 200)
    before_bad = count("/v1/audio/transcriptions", 400)
    before_unmatched = count("unmatched", 404)
    client.audio.transcriptions.create(model="whisper-1", file=("s.wav", two_wav))
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="whisper-1", file=("s.txt", b"text, not audio " * 50))
    http("GET", f"{server.http_url}/no/such/page/{time.time()}")  # (one label for every unknown path)

    async def hold_one():
        async with websockets.connect(ws_url(server)) as ws:
            await ws.recv()
            return REGISTRY.get_sample_value("cosystream_websocket_sessions")

    assert asyncio.run(hold_one()) == 1
    assert count("/v1/audio/transcriptions", 200) == before_ok + 1
    assert count("/v1/audio/transcriptions", 400) == before_bad + 1
    assert count("unmatched", 404) == before_unmatched + 1
    deadline = time.monotonic() + 5
    while REGISTRY.get_sample_value("cosystream_websocket_sessions") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert REGISTRY.get_sample_value("cosystream_websocket_sessions") == 0


def test_a_format_change_mid_session_applies_to_the_audio_after_it(server):
    """A session.update while audio is buffered ends that buffer (no error for its silence) and the audio
    after it is read in the new format."""
    quiet16 = encode(silence(0.5, 16000), "LINEAR16")
    speech8 = encode(
        np.concatenate([silence(0.3, 8000), speech(OTHER, rate_hz=8000), silence(0.8, 8000)]), "LINEAR16"
    )

    async def run():
        async with websockets.connect(ws_url(server)) as ws:
            await pcm_session(ws, 16000)
            for message in appends(quiet16, 3200):
                await ws.send(message)
            await ws.send(session_update({"type": "audio/pcm", "rate": 8000}))
            for message in appends(speech8, 1600):
                await ws.send(message)
            return await events_until(ws, "conversation.item.input_audio_transcription.completed")

    events = asyncio.run(run())
    assert not [e for e in events if e["type"] == "error"], events
    assert (
        events[0]["type"] == "session.updated" and events[0]["session"]["audio"]["input"]["format"]["rate"] == 8000
    )
    assert heard(events[-1]["transcript"], OTHER), events[-1]["transcript"]
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    assert 700 <= started["audio_start_ms"] <= 1000, "times count from the start of the connection's audio"
