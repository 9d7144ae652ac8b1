"""Realtime transcription over WebSocket: every client event the protocol acknowledges gets its
acknowledgement or an ``error``, bad audio is named, and an idle connection is closed. Real server on
loopback (an idle timeout short enough to test), real WebSockets, espeak-ng speech."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator

import numpy as np
import pytest
import websockets

from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from cosystream.frontend.host import StreamOptions
from cosystream.server.frontend import FrontendConfig
from cosystream.server.http import HttpConfig
from tests.speech import encode, needs_espeak, silence, speech
from tests.test_http import appends, events_until, pcm_session, wait_no_sessions, ws_url

pytestmark = needs_espeak

SENTENCE = "the quick brown fox jumps over the lazy dog"
WS_IDLE_TIMEOUT_S = 2.0
ANSWER_S = 10.0  # generous: the box may be loaded


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    config = FrontendConfig(
        host="127.0.0.1",
        port=0,
        stream=StreamOptions(idle_timeout_s=5.0),
        http=HttpConfig(host="127.0.0.1", port=0, ws_idle_timeout_s=WS_IDLE_TIMEOUT_S),
    )
    with LocalServer(frontend_config=config, engine=EngineConfig(max_sessions=4, max_batch=4)) as srv:
        yield srv


async def send_pcm(ws, pcm: bytes) -> None:
    for message in appends(pcm, 3200):  # 100 ms an append
        await ws.send(message)


async def answer(ws, timeout_s: float = ANSWER_S) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


@pytest.mark.parametrize("trailing_s", [1.0, 3.0])
def test_a_commit_after_the_server_committed_the_speech_is_answered(server, trailing_s):
    """Speech, silence, its ``completed``; then a commit: nothing is left to commit, so an error says so
    (before the fix: no answer at all). A commit mid-speech gets ``committed`` and the item's final."""
    pcm = encode(np.concatenate([silence(0.3), speech(SENTENCE), silence(trailing_s)]), "LINEAR16")
    mid = encode(np.concatenate([silence(0.3), speech(SENTENCE)]), "LINEAR16")

    async def run():
        async with websockets.connect(ws_url(server)) as ws:
            await pcm_session(ws, 16000)
            await send_pcm(ws, pcm)
            await events_until(ws, "conversation.item.input_audio_transcription.completed")
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "late"}))
            late = await answer(ws)
            await send_pcm(ws, mid)  # the connection goes on: a commit in the middle of speech
            await events_until(ws, "input_audio_buffer.speech_started")
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            after = await events_until(ws, "conversation.item.input_audio_transcription.completed")
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))  # and again: empty
            again = await answer(ws)
            return late, after, again

    late, after, again = asyncio.run(run())
    assert late["type"] == "error" and late["error"]["code"] == "input_audio_buffer_commit_empty", late
    assert late["error"]["event_id"] == "late"
    kinds = [e["type"] for e in after]
    assert "input_audio_buffer.committed" in kinds, kinds
    deltas = [e for e in after if e["type"].endswith(".delta")]
    assert deltas and all(0 < e["stability"] <= 1 for e in deltas), deltas  # for the clients' display rule
    committed = next(e for e in after if e["type"] == "input_audio_buffer.committed")
    assert committed["item_id"] == after[-1]["item_id"]
    assert again["type"] == "error" and again["error"]["code"] == "input_audio_buffer_commit_empty", again
    wait_no_sessions(server)


def test_an_odd_length_pcm16_append_is_an_error(server):
    """16-bit PCM is two bytes a sample: three bytes cannot be audio. G.711 (a byte a sample) may be odd."""

    async def run():
        async with websockets.connect(ws_url(server)) as ws:
            await pcm_session(ws, 16000)
            odd = base64.b64encode(b"\0\0\0").decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": odd, "event_id": "odd"}))
            refused = await answer(ws)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            nothing = await answer(ws)  # the odd append was not buffered
            await ws.send(
                json.dumps(
                    {"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}}
                )
            )
            await answer(ws)
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": odd}))
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            cleared = await answer(ws)
            return refused, nothing, cleared

    refused, nothing, cleared = asyncio.run(run())
    assert refused["type"] == "error", refused
    error = refused["error"]
    assert error["code"] == "invalid_value" and error["param"] == "audio" and error["event_id"] == "odd"
    assert "odd" in error["message"] and "2 bytes" in error["message"], error
    assert nothing["error"]["code"] == "input_audio_buffer_commit_empty", nothing
    assert cleared["type"] == "input_audio_buffer.cleared", cleared  # a mu-law byte is a sample


def test_an_idle_websocket_is_told_why_then_closed(server):
    async def run():
        async with websockets.connect(ws_url(server)) as ws:
            await pcm_session(ws, 16000)
            await send_pcm(ws, encode(silence(0.5), "LINEAR16"))
            loop = asyncio.get_running_loop()
            quiet_from = loop.time()
            seen = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    seen.append(json.loads(await asyncio.wait_for(ws.recv(), WS_IDLE_TIMEOUT_S + ANSWER_S)))
            return seen, ws.close_code, ws.close_reason, loop.time() - quiet_from

    seen, code, reason, waited_s = asyncio.run(run())
    errors = [e for e in seen if e["type"] == "error"]
    assert errors and errors[-1]["error"]["code"] == "idle_timeout", seen
    assert f"{WS_IDLE_TIMEOUT_S:g} s" in errors[-1]["error"]["message"], errors
    assert code == 1000 and "idle" in reason, (code, reason)
    assert waited_s >= WS_IDLE_TIMEOUT_S * 0.9
    wait_no_sessions(server)


def test_a_client_that_keeps_sending_is_not_idle(server):
    """Events spaced under the timeout keep the connection open past it."""

    async def run():
        async with websockets.connect(ws_url(server)) as ws:
            await pcm_session(ws, 16000)
            chunk = appends(encode(silence(0.1), "LINEAR16"), 3200)[0]
            for _ in range(int(WS_IDLE_TIMEOUT_S * 2 / 0.5)):
                await ws.send(chunk)
                await asyncio.sleep(0.5)
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            return await events_until(ws, "input_audio_buffer.cleared", timeout_s=ANSWER_S)

    events = asyncio.run(run())
    assert events[-1]["type"] == "input_audio_buffer.cleared"
    assert not [e for e in events if e["type"] == "error"], events
