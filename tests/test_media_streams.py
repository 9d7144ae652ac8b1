"""Telephony platforms' WebSockets on the HTTP port (``cosystream/server/http/media_streams.py``).

The clients here speak each platform's published schema, written from its documentation, not from our
code: Twilio Media Streams (https://www.twilio.com/docs/voice/media-streams/websocket-messages: the
``connected``/``start``/``media``/``dtmf``/``stop`` messages, string sequence numbers, base64 8 kHz
mu-law of 20 ms a message) and FreeSWITCH mod_audio_fork / jambonz ``listen`` (a JSON metadata text
message, then binary 16-bit little-endian PCM, stereo interleaved). Speech is espeak-ng's; the model may
be untrained, so the tests pin structure (finals per track, labels, order, the end), never the words.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import websockets

from tests.servers import WebhookServer
from tests.speech import encode, needs_espeak, silence, speech
from tests.test_http import TOKEN, local_http_server, wait_no_sessions

CALLER = "please call me back tomorrow morning"
AGENT = "the meeting moved to four o'clock"
ANSWER_S = 20.0


@pytest.fixture(scope="module")
def server() -> Iterator:
    with local_http_server() as srv:
        yield srv


def url(server, path: str, query: str = "") -> str:
    return f"ws://127.0.0.1:{server.frontend.http_port}/v1/media-streams/{path}{'?' + query if query else ''}"


def heard_as(messages: list[dict], track: str) -> str:
    """Which of the two sentences a track's finals are closer to (the labels are not swapped)."""
    text = " ".join(
        m["text"] for m in messages if m["event"] == "transcript" and m["track"] == track and m["is_final"]
    )
    words = set(text.lower().split())
    return CALLER if len(words & set(CALLER.split())) > len(words & set(AGENT.split())) else AGENT


def call_audio(text: str, rate_hz: int, lead_s: float) -> np.ndarray:
    return np.concatenate([silence(lead_s, rate_hz), speech(text, rate_hz=rate_hz), silence(1.2, rate_hz)])


class TwilioCall:
    """What Twilio sends for one ``<Start><Stream track="both_tracks">``, message by message."""

    def __init__(self, tracks: list[str], token: str | None = None):
        self.stream_sid = "MZ" + uuid.uuid4().hex
        self.call_sid = "CA" + uuid.uuid4().hex
        self.account_sid = "AC" + uuid.uuid4().hex
        self.tracks = tracks
        self.parameters = {"token": token} if token else {}
        self.sequence = 0

    def _message(self, event: str, **body) -> str:
        self.sequence += 1
        return json.dumps(
            {"event": event, "sequenceNumber": str(self.sequence), **body, "streamSid": self.stream_sid}
        )

    def connected(self) -> str:
        return json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})

    def start(self) -> str:
        start = {
            "accountSid": self.account_sid,
            "streamSid": self.stream_sid,
            "callSid": self.call_sid,
            "tracks": self.tracks,
            "customParameters": self.parameters,
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        }
        return self._message("start", start=start)

    def media(self, track: str, chunk: int, payload: bytes) -> str:
        media = {
            "track": track,
            "chunk": str(chunk),
            "timestamp": str(chunk * 20),
            "payload": base64.b64encode(payload).decode(),
        }
        return self._message("media", media=media)

    def dtmf(self, digit: str) -> str:
        return self._message("dtmf", dtmf={"track": "inbound_track", "digit": digit})

    def stop(self) -> str:
        return self._message("stop", stop={"accountSid": self.account_sid, "callSid": self.call_sid})


async def receive_all(ws, until_event: str = "stopped") -> list[dict]:
    messages = []
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), ANSWER_S))
        messages.append(message)
        if message["event"] in (until_event, "error"):
            return messages


@needs_espeak
def test_twilio_both_tracks_come_back_labelled_with_dtmf_and_the_end(server):
    caller = encode(call_audio(CALLER, 8000, 0.3), "MULAW")
    agent = encode(call_audio(AGENT, 8000, 1.0), "MULAW")
    call = TwilioCall(["inbound", "outbound"])

    async def run() -> list[dict]:
        async with websockets.connect(url(server, "twilio")) as ws:
            reader = asyncio.ensure_future(receive_all(ws))
            await ws.send(call.connected())
            await ws.send(call.start())
            for chunk, offset in enumerate(range(0, max(len(caller), len(agent)), 160), start=1):
                for track, audio in (("inbound", caller), ("outbound", agent)):
                    if offset < len(audio):
                        await ws.send(call.media(track, chunk, audio[offset : offset + 160]))
                if chunk == 40:
                    await ws.send(call.dtmf("7"))
                await asyncio.sleep(0.002)
            await ws.send(call.stop())
            messages = await reader
            await ws.wait_closed()
            assert ws.close_code == 1000
            return messages

    messages = asyncio.run(run())
    dtmf = {"event": "dtmf", "track": "inbound_track", "digit": "7", "streamSid": call.stream_sid}
    assert {**dtmf, "callSid": call.call_sid} in messages
    end = messages[-1]
    assert end["event"] == "stopped" and (end["streamSid"], end["callSid"]) == (call.stream_sid, call.call_sid)
    for track, audio in (("inbound", caller), ("outbound", agent)):
        finals = [m for m in messages if m["event"] == "transcript" and m["track"] == track and m["is_final"]]
        assert finals and any(f["text"] for f in finals), messages
        assert [f["utterance_index"] for f in finals] == list(range(len(finals)))
        assert all((f["streamSid"], f["callSid"]) == (call.stream_sid, call.call_sid) for f in finals)
        assert end["tracks"][track] == {"audio_ms": len(audio) // 8, "finals": len(finals)}
    assert (heard_as(messages, "inbound"), heard_as(messages, "outbound")) == (CALLER, AGENT)
    speech_start_ms = {"inbound": 300, "outbound": 1000}
    for track, start_ms in speech_start_ms.items():
        first = next(m for m in messages if m["event"] == "transcript" and m["track"] == track and m["text"])
        assert abs(first["start_ms"] - start_ms) < 600, first
    wait_no_sessions(server)


@needs_espeak
def test_telnyx_media_streaming_with_its_snake_case_fields(server):
    """Telnyx's media streaming: Twilio's events with ``stream_id``, ``sequence_number``, ``media_format``
    (here PCMA) and ``call_control_id``, and a start that lists no tracks."""
    caller = encode(call_audio(CALLER, 8000, 0.3), "ALAW")
    stream_id, control = str(uuid.uuid4()), "v3:" + uuid.uuid4().hex

    def message(event: str, sequence: int, **body) -> str:
        return json.dumps({"event": event, "sequence_number": str(sequence), **body, "stream_id": stream_id})

    async def run() -> list[dict]:
        async with websockets.connect(url(server, "twilio")) as ws:
            await ws.send(json.dumps({"event": "connected", "version": "1.0.0"}))
            media_format = {"encoding": "PCMA", "sample_rate": 8000, "channels": 1}
            await ws.send(message("start", 1, start={"call_control_id": control, "media_format": media_format}))
            for chunk, offset in enumerate(range(0, len(caller), 160), start=1):
                payload = base64.b64encode(caller[offset : offset + 160]).decode()
                media = {"track": "inbound", "chunk": str(chunk), "timestamp": str(chunk * 20), "payload": payload}
                await ws.send(message("media", chunk + 1, media=media))
            await ws.send(message("stop", 10_000, stop={"call_control_id": control}))
            return await receive_all(ws)

    messages = asyncio.run(run())
    assert messages[-1]["event"] == "stopped" and messages[-1]["tracks"]["inbound"]["finals"] >= 1, messages
    assert (messages[-1]["streamSid"], messages[-1]["callSid"]) == (stream_id, control)
    assert heard_as(messages, "inbound") == CALLER


@needs_espeak
@pytest.mark.parametrize("platform", ["jambonz", "mod_audio_fork", "vonage"])
def test_audio_fork_stereo_and_mono(server, platform):
    """jambonz ``listen`` (metadata with sampleRate and mixType: stereo at 16 kHz), mod_audio_fork with no
    metadata (the URL says 8000 Hz, mono) and Vonage's WebSocket connection (its first message's content
    type says L16 at 16 kHz, mono)."""
    stereo = platform == "jambonz"
    rate = 8000 if platform == "mod_audio_fork" else 16000
    caller = call_audio(CALLER, rate, 0.3)
    agent = call_audio(AGENT, rate, 1.0)
    n = max(len(caller), len(agent))
    caller, agent = np.pad(caller, (0, n - len(caller))), np.pad(agent, (0, n - len(agent)))
    if stereo:
        frames = np.frombuffer(encode(caller, "LINEAR16"), "<i2"), np.frombuffer(encode(agent, "LINEAR16"), "<i2")
        pcm = np.stack(frames, axis=1).astype("<i2").tobytes()
    else:
        pcm = encode(caller, "LINEAR16")
    frame = (2 if stereo else 1) * 2 * rate // 50  # 20 ms
    metadata = {
        "jambonz": {
            "callSid": "c-" + uuid.uuid4().hex,
            "from": "+15551230001",
            "to": "+15551230002",
            "sampleRate": rate,
            "mixType": "stereo",
        },
        "vonage": {
            "event": "websocket:connected",
            "content-type": f"audio/l16;rate={rate}",
            "caller": "15551230001",
        },
    }.get(platform)
    tracks = ["inbound", "outbound"] if stereo else ["inbound"]

    async def run() -> list[dict]:
        query = "sample_rate=8000" if platform == "mod_audio_fork" else ""
        async with websockets.connect(url(server, "audio-fork", query)) as ws:
            if metadata is not None:
                await ws.send(json.dumps(metadata))
            for offset in range(0, len(pcm), frame):
                await ws.send(pcm[offset : offset + frame])
                await asyncio.sleep(0.002)
            # The fork ends with the call (a close frame): wait for each track's final first.
            messages, finals = [], set()
            while finals != set(tracks):
                message = json.loads(await asyncio.wait_for(ws.recv(), ANSWER_S))
                messages.append(message)
                if message["event"] == "transcript" and message["is_final"] and message["text"]:
                    finals.add(message["track"])
            return messages

    messages = asyncio.run(run())
    assert {m["track"] for m in messages} == set(tracks)
    assert heard_as(messages, "inbound") == CALLER
    if stereo:
        assert heard_as(messages, "outbound") == AGENT
        assert all(m["callSid"] == metadata["callSid"] for m in messages)
    wait_no_sessions(server)


@pytest.mark.parametrize(
    "messages, close_code, error",
    [
        ([{"event": "media", "media": {"track": "inbound", "payload": "AAAA"}}], 1003, "before the start"),
        ([{"event": "hello"}], 1003, "unknown event 'hello'"),
        (["not json"], 1003, "not JSON"),
        (
            [
                {
                    "event": "start",
                    "start": {
                        "tracks": ["inbound"],
                        "mediaFormat": {"encoding": "audio/x-l16", "sampleRate": 16000},
                    },
                }
            ],
            1003,
            "audio/x-mulaw",
        ),
        (
            [
                {"event": "start", "start": {"tracks": ["inbound"]}},
                {"event": "media", "media": {"track": "inbound", "payload": "!!!"}},
            ],
            1003,
            "not base64",
        ),
    ],
)
def test_twilio_bad_messages_are_refused_with_a_reason(server, messages, close_code, error):
    async def run():
        async with websockets.connect(url(server, "twilio")) as ws:
            for message in messages:
                await ws.send(message if isinstance(message, str) else json.dumps(message))
            answer = json.loads(await asyncio.wait_for(ws.recv(), ANSWER_S))
            assert answer["event"] == "error" and error in answer["message"], answer
            assert answer["code"] == "INVALID_ARGUMENT"
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), ANSWER_S)
            assert ws.close_code == close_code

    asyncio.run(run())
    wait_no_sessions(server)


def test_audio_fork_refuses_a_rate_it_cannot_take(server):
    async def run():
        async with websockets.connect(url(server, "audio-fork")) as ws:
            await ws.send(json.dumps({"sampleRate": 44100}))
            answer = json.loads(await asyncio.wait_for(ws.recv(), ANSWER_S))
            assert answer["event"] == "error" and "8000 or 16000" in answer["message"]
            await ws.wait_closed()
            assert ws.close_code == 1003

    asyncio.run(run())


@needs_espeak
def test_tokens_from_twilio_parameters_or_basic_auth(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN}\n")
    caller = encode(call_audio(CALLER, 8000, 0.3), "MULAW")
    with local_http_server(tokens) as secured:

        async def twilio(token: str | None) -> list[dict]:
            call = TwilioCall(["inbound"], token)
            async with websockets.connect(url(secured, "twilio")) as ws:
                await ws.send(call.connected())
                await ws.send(call.start())
                for chunk, offset in enumerate(range(0, len(caller), 160), start=1):
                    await ws.send(call.media("inbound", chunk, caller[offset : offset + 160]))
                await ws.send(call.stop())
                messages = await receive_all(ws)
                await ws.wait_closed()
                return [*messages, {"close": ws.close_code}]

        refused = asyncio.run(twilio(None))
        assert refused[0]["event"] == "error" and refused[0]["code"] == "UNAUTHENTICATED"
        assert refused[-1] == {"close": 1008}
        wrong = asyncio.run(twilio("wrong-token-0123456789"))
        assert wrong[-1] == {"close": 1008}
        answered = asyncio.run(twilio(TOKEN))
        assert answered[-2]["event"] == "stopped" and answered[-2]["tracks"]["inbound"]["finals"] >= 1
        assert answered[-1] == {"close": 1000}

        async def fork(header: str) -> int | None:
            async with websockets.connect(
                url(secured, "audio-fork"), additional_headers={"Authorization": header}
            ) as ws:
                await ws.send(json.dumps({"sampleRate": 8000}))
                await ws.send(bytes(320))
                await ws.close()
                return ws.close_code

        basic = "Basic " + base64.b64encode(f"jambonz:{TOKEN}".encode()).decode()
        assert asyncio.run(fork(basic)) == 1000
        with pytest.raises(websockets.InvalidStatus) as refused_upgrade:
            asyncio.run(fork("Basic " + base64.b64encode(b"jambonz:wrong-token-0123456789").decode()))
        assert refused_upgrade.value.response.status_code == 401


@needs_espeak
def test_media_webhook_gets_what_a_socket_asking_for_no_results_is_not_sent():
    """``serve --media-webhook``: a ``<Connect><Stream>`` socket asks for ``results=none`` (Twilio must not
    be sent what it does not know); its transcripts, DTMF and end go to the webhook."""
    hook = WebhookServer()
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    caller = encode(call_audio(CALLER, 8000, 0.3), "MULAW")
    call = TwilioCall(["inbound"])
    try:
        with local_http_server(http_fields={"media_webhook": hook.url}) as hooked:

            async def run() -> list:
                async with websockets.connect(url(hooked, "twilio", "results=none")) as ws:
                    for message in (call.connected(), call.start()):
                        await ws.send(message)
                    for chunk, offset in enumerate(range(0, len(caller), 160), start=1):
                        await ws.send(call.media("inbound", chunk, caller[offset : offset + 160]))
                        if chunk == 10:
                            await ws.send(call.dtmf("#"))
                    await ws.send(call.stop())
                    received = [message async for message in ws]
                    return [*received, ws.close_code]

            assert asyncio.run(run()) == [1000]
            deadline = time.monotonic() + 10
            while not [m for m in hook.received if m["event"] == "stopped"]:
                assert time.monotonic() < deadline, hook.received
                time.sleep(0.05)
    finally:
        hook.shutdown()
    events = [m["event"] for m in hook.received]
    assert events[-1] == "stopped" and "dtmf" in events and "transcript" in events, hook.received
    assert all(m["callSid"] == call.call_sid for m in hook.received)
    finals = [m for m in hook.received if m["event"] == "transcript" and m["is_final"]]
    assert hook.received[-1]["tracks"]["inbound"]["finals"] == len(finals) >= 1
