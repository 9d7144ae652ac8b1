"""A resumable Realtime WebSocket (``?resumable=true``) survives its connection: cut mid-utterance by a real
TCP proxy on loopback (RST), it resumes with its token and the transcript is the one of an uncut connection,
each event once; a held connection is freed after its window; bad resumes get an ``error`` and a close. Real
server, real WebSockets (the ``websockets`` library), espeak-ng speech."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from urllib.parse import urlencode

import numpy as np
import pytest
import websockets
from prometheus_client import REGISTRY

from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from cosystream.frontend.host import StreamOptions
from cosystream.server.frontend import FrontendConfig
from cosystream.server.http import HttpConfig
from tests.servers import CuttingProxy, Served
from tests.speech import encode, needs_espeak, silence, speech
from tests.test_http import active_sessions, appends, check_items, session_update, wait_no_sessions

pytestmark = needs_espeak

SENTENCES = ["the quick brown fox jumps over the lazy dog", "she sells sea shells by the sea shore"]
WINDOW_S = 3.0
COMPLETED = "conversation.item.input_audio_transcription.completed"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    config = FrontendConfig(
        host="127.0.0.1",
        port=0,
        stream=StreamOptions(idle_timeout_s=10.0, resume_window_s=WINDOW_S),
        http=HttpConfig(host="127.0.0.1", port=0),
    )
    with LocalServer(frontend_config=config, engine=EngineConfig(max_sessions=4, max_batch=4)) as srv:
        yield srv


@pytest.fixture
def proxy(server) -> Iterator[CuttingProxy]:
    proxy = CuttingProxy(server.frontend.http_port)
    yield proxy
    proxy.close()


def client_events() -> list[str]:
    """A session update, two sentences in 100 ms appends, trailing silence, then a commit."""
    parts = [silence(0.3)]
    for sentence in SENTENCES:
        parts += [speech(sentence), silence(1.0)]
    pcm = encode(np.concatenate([*parts, silence(0.5)]), "LINEAR16")
    update = session_update({"type": "audio/pcm", "rate": 16000})
    return [update, *appends(pcm, 3200), json.dumps({"type": "input_audio_buffer.commit"})]


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


class ResumingClient:
    """A client of ``port`` that keeps its events from the last ``client_events`` the server said it took,
    and on a dropped connection resumes with its token, that offset and the last event it received. The
    proxy cuts the connection once the client has sent each of ``cut_at`` events."""

    def __init__(self, port: int, events: list[str], cut_at: list[int], proxy: CuttingProxy | None):
        self.port, self.sent, self.cuts, self.proxy = port, events, list(cut_at), proxy
        self.received: list[dict] = []
        self.token = ""
        self.taken = 0  # the server's last word on the client events it took
        self.resumed: list[dict] = []

    def url(self) -> str:
        query = {"intent": "transcription"}
        if self.token:
            query |= {
                "resume_token": self.token,
                "resume_offset_events": str(self.taken),
                "resume_after_event": self.received[-1]["event_id"],
            }
        else:
            query["resumable"] = "true"
        return f"ws://127.0.0.1:{self.port}/v1/realtime?{urlencode(query)}"

    def _take(self, event: dict) -> None:
        self.received.append(event)
        if event["type"] == "cosystream.session.resumable":
            self.token = event["resume_token"]
        elif event["type"] in ("cosystream.session.received", "cosystream.session.resumed"):
            self.taken = event["client_events"]
            if event["type"] == "cosystream.session.resumed":
                self.resumed.append(event)

    async def _read(self, ws) -> bool:
        """Events to the end (True: every sentence's ``completed``, then a second with none) or to a dropped
        connection (False)."""
        try:
            while len(completed(self.received)) < len(SENTENCES):
                self._take(json.loads(await ws.recv()))
            with contextlib.suppress(TimeoutError):  # (and nothing after it: no event sent twice)
                while True:
                    self._take(json.loads(await asyncio.wait_for(ws.recv(), 1.0)))
            return True
        except websockets.ConnectionClosed:
            return False

    async def run(self, connections: int = 10) -> list[dict]:
        for _ in range(connections):
            async with websockets.connect(self.url(), max_size=None) as ws:
                reader = asyncio.ensure_future(self._read(ws))
                for _ in range(500):  # (the first connection: its token comes second)
                    if self.token:
                        break
                    await asyncio.sleep(0.01)
                try:
                    for index in range(self.taken, len(self.sent)):
                        if self.cuts and index >= self.cuts[0]:
                            self.cuts.pop(0)
                            self.proxy.cut()  # mid-utterance: the connection resets under the session
                            break
                        await ws.send(self.sent[index])
                        await asyncio.sleep(0.04)  # (100 ms of audio every 40 ms: ahead of real time)
                except websockets.ConnectionClosed:
                    pass
                if await asyncio.wait_for(reader, 60):
                    return self.received
        raise AssertionError(f"not done after {connections} connections: {self.received[-3:]}")


def completed(events: list[dict]) -> list[str]:
    return [event["transcript"] for event in events if event["type"] == COMPLETED]


def test_a_connection_cut_twice_mid_utterance_resumes_with_the_same_transcript_exactly_once(server, proxy):
    events = client_events()
    resumed_before = metric("cosystream_sessions_resumed_total")
    whole = asyncio.run(ResumingClient(server.frontend.http_port, events, [], None).run())
    cut_at = [25, 75]  # (in the first sentence, and in the second)
    client = ResumingClient(proxy.port, events, cut_at, proxy)
    resumed = asyncio.run(client.run())
    assert len(completed(whole)) == len(SENTENCES), completed(whole)
    assert completed(resumed) == completed(whole)
    ids = [event["event_id"] for event in resumed]
    assert len(set(ids)) == len(ids), "no event sent twice"
    assert len(client.resumed) == 2 and all(r["resume_token"] == client.token for r in client.resumed)
    items = check_items(resumed)  # every item: started, deltas, stopped, committed, completed, each once
    assert len({item["item_id"] for item in items}) == len(items) == len(SENTENCES)
    assert metric("cosystream_sessions_resumed_total") == resumed_before + 2
    wait_no_sessions(server)


async def _first_events(url: str, count: int, then=None) -> list[dict]:
    async with websockets.connect(url) as ws:
        received = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(count)]
        if then is not None:
            await then(ws)
        return received


async def _refused(url: str) -> tuple[dict, int]:
    async with websockets.connect(url) as ws:
        event = json.loads(await asyncio.wait_for(ws.recv(), 10))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
        return event, closed.value.rcvd.code


def resume_url(port: int, token: str, offset: int | str = 0, after: str = "x") -> str:
    query = {"intent": "transcription", "resume_token": token, "resume_offset_events": offset}
    return f"ws://127.0.0.1:{port}/v1/realtime?{urlencode(query | {'resume_after_event': after})}"


def test_a_held_connection_is_freed_after_its_window_and_bad_resumes_are_refused(server, proxy):
    pcm = encode(np.concatenate([silence(0.3), speech(SENTENCES[0])]), "LINEAR16")
    port = server.frontend.http_port
    expired_before = metric("cosystream_sessions_expired_total")

    async def speak_then_drop():
        async with websockets.connect(
            f"ws://127.0.0.1:{proxy.port}/v1/realtime?intent=transcription&resumable=1"
        ) as ws:
            created, resumable = [json.loads(await ws.recv()) for _ in range(2)]
            await ws.send(session_update({"type": "audio/pcm", "rate": 16000}))
            for message in appends(pcm, 3200)[:15]:
                await ws.send(message)
            await asyncio.sleep(0.5)
            proxy.cut()  # mid-utterance
            return created, resumable

    created, resumable = asyncio.run(speak_then_drop())
    assert created["type"] == "session.created" and resumable["type"] == "cosystream.session.resumable"
    assert resumable["resume_window_s"] == WINDOW_S
    token = resumable["resume_token"]
    time.sleep(0.5)
    assert active_sessions(server) == 1, "held: its slot kept for the window"
    # Refusals leave it held: an offset past what the server took, an event it never sent, bad parameters.
    past, code = asyncio.run(_refused(resume_url(port, token, 10_000, resumable["event_id"])))
    assert past["error"]["code"] == "resume_refused" and "past" in past["error"]["message"] and code == 1008
    unknown_event, _ = asyncio.run(_refused(resume_url(port, token, 0, "event_never")))
    assert unknown_event["error"]["code"] == "resume_refused", unknown_event
    bad, _ = asyncio.run(_refused(resume_url(port, token, "-1")))
    assert bad["error"]["code"] == "invalid_value" and "resume_offset_events" in bad["error"]["message"]
    wrong, _ = asyncio.run(_refused(resume_url(port, "no-such-token")))
    assert wrong["error"]["code"] == "resume_not_found", wrong
    assert active_sessions(server) == 1
    wait_no_sessions(server, WINDOW_S + 5)  # freed after the window
    assert metric("cosystream_sessions_expired_total") == expired_before + 1
    gone, code = asyncio.run(_refused(resume_url(port, token, 0, resumable["event_id"])))
    assert gone["error"]["code"] == "resume_not_found" and code == 1008


def test_a_clean_close_ends_a_resumable_session_and_a_live_connection_is_taken_over(server):
    pcm = encode(np.concatenate([silence(0.3), speech(SENTENCES[0])]), "LINEAR16")
    port = server.frontend.http_port
    url = f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription&resumable=true"

    async def speak(ws):
        await ws.send(session_update({"type": "audio/pcm", "rate": 16000}))
        for message in appends(pcm, 3200)[:10]:
            await ws.send(message)
        await asyncio.sleep(0.5)

    _, resumable = asyncio.run(_first_events(url, 2, speak))  # then a close frame
    wait_no_sessions(server, 2.0)  # not held: well before the window
    gone, _ = asyncio.run(_refused(resume_url(port, resumable["resume_token"], 0, resumable["event_id"])))
    assert gone["error"]["code"] == "resume_not_found"

    async def take_over():
        """A resume while the old WebSocket still holds the session (the server has not seen it drop): the
        old one is let go, the new one goes on."""
        old = await websockets.connect(url)
        _, resumable = [json.loads(await old.recv()) for _ in range(2)]
        await speak(old)
        new_url = resume_url(port, resumable["resume_token"], 0, resumable["event_id"])
        async with websockets.connect(new_url) as new:
            first = json.loads(await asyncio.wait_for(new.recv(), 10))
            while first["type"] != "cosystream.session.resumed":
                first = json.loads(await asyncio.wait_for(new.recv(), 10))
            await old.close()  # (its close no longer reaches the session: taken)
            await new.send(json.dumps({"type": "input_audio_buffer.commit"}))
            return first, await _until(new, COMPLETED)

    resumed, after = asyncio.run(take_over())
    assert resumed["client_events"] == 11, resumed  # the update and the ten appends, skipped as sent again
    assert after[-1]["type"] == COMPLETED
    wait_no_sessions(server)


async def _until(ws, kind: str) -> list[dict]:
    events = []
    while not events or events[-1]["type"] != kind:
        events.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
    return events


def test_a_resume_that_lands_on_another_frontend_is_relayed_to_the_one_holding_the_session():
    """``serve --frontends 3``: each reconnection reaches any frontend; cut six times, the connection resumes
    every time, some through a frontend that does not hold it, with the transcript of an uncut one."""
    events = client_events()
    with Served("--frontends", "3", "--max-sessions", "8") as served:
        served.wait(lambda: served.health() == 1, 60, "every frontend listening")
        whole = asyncio.run(ResumingClient(served.http_port, events, [], None).run())
        proxy = CuttingProxy(served.http_port)
        try:
            client = ResumingClient(proxy.port, events, [8 + 12 * i for i in range(6)], proxy)
            resumed = asyncio.run(client.run())
        finally:
            proxy.close()
        assert len(client.resumed) == 6
        assert completed(resumed) == completed(whole) and len(completed(whole)) == len(SENTENCES)
        ids = [event["event_id"] for event in resumed]
        assert len(set(ids)) == len(ids), "no event sent twice"
        assert client.token.split(".")[0] in {"0", "1", "2"}, "the token names its frontend"
        # (each resume lands on the holder with 1/3 odds: all six doing so, 1 in 729)
        assert served.metric("cosystream_resumes_forwarded_total") >= 1
        served.wait(lambda: served.info().active_sessions == 0, 10, "the session freed")


def test_a_resume_must_come_from_the_token_that_opened_the_session(tmp_path):
    """With tokens on, another token's resume finds nothing (as an unknown token: it learns nothing of the
    session), and the owner's resume takes it back."""
    alice, bob = "alice-0123456789abcdef0123", "bob-0123456789abcdef012345"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {alice}\nbob {bob}\n")
    config = FrontendConfig(
        host="127.0.0.1",
        port=0,
        stream=StreamOptions(idle_timeout_s=10.0, resume_window_s=WINDOW_S),
        auth_tokens=str(tokens),
        http=HttpConfig(host="127.0.0.1", port=0),
    )
    with LocalServer(frontend_config=config, engine=EngineConfig(max_sessions=2, max_batch=2)) as srv:
        port = srv.frontend.http_port

        def headers(token: str) -> dict:
            return {"Authorization": f"Bearer {token}"}

        async def run():
            url = f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription&resumable=true"
            ws = await websockets.connect(url, additional_headers=headers(alice))
            _, resumable = [json.loads(await ws.recv()) for _ in range(2)]
            ws.transport.abort()  # dropped: held
            await asyncio.sleep(0.3)
            again = resume_url(port, resumable["resume_token"], 0, resumable["event_id"])
            async with websockets.connect(again, additional_headers=headers(bob)) as other:
                refused = json.loads(await asyncio.wait_for(other.recv(), 10))
            async with websockets.connect(again, additional_headers=headers(alice)) as owner:
                resumed = json.loads(await asyncio.wait_for(owner.recv(), 10))
            return refused, resumed

        refused, resumed = asyncio.run(run())
    assert refused["type"] == "error" and refused["error"]["code"] == "resume_not_found", refused
    assert resumed["type"] == "cosystream.session.resumed" and resumed["client_events"] == 0, resumed
