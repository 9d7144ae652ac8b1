"""What one client may hold on the HTTP port, over a real server on loopback: client secrets and WebSockets
per token, idle connections closed, secrets bound to their token's value, and a server without tokens that
answers only its own pages (Origin and Host checked) and issues no secrets."""

from __future__ import annotations

import asyncio
import base64
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from cosystream.app.local import LocalServer
from cosystream.engine.config import EngineConfig
from cosystream.frontend.host import StreamOptions
from cosystream.frontend.quota import NONCE_BYTES, QuotaExceeded, TokenSessions
from cosystream.server.frontend import FrontendConfig
from cosystream.server.http import HttpConfig
from cosystream.server.http.app import WEBSOCKETS_PER_SESSION
from cosystream.server.http.secrets import SECRETS_PER_SESSION

SMALL = "small-0123456789abcdef0123"  # max_sessions=2
ADMIN = "admin-0123456789abcdef0123"
ROTATED = "rotated-0123456789abcdef01"
ROTATED_NEW = "rotated-new-0123456789abcd"
IDLE_TIMEOUT_S = 2.0
WS_PATH = "/v1/realtime?intent=transcription"


def http_server(tokens: Path | None, **http_fields) -> LocalServer:
    config = FrontendConfig(
        host="127.0.0.1",
        port=0,
        stream=StreamOptions(idle_timeout_s=5.0),
        auth_tokens=None if tokens is None else str(tokens),
        http=HttpConfig(host="127.0.0.1", port=0, **http_fields),
    )
    return LocalServer(frontend_config=config, engine=EngineConfig(max_sessions=4, max_batch=4))


def token_lines(rotated: str = ROTATED) -> str:
    return f"small {SMALL} max_sessions=2\nadmin {ADMIN} admin\nrotated {rotated}\n"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("limits") / "tokens"
    tokens.write_text(token_lines())
    with http_server(tokens, idle_timeout_s=IDLE_TIMEOUT_S) as srv:
        srv.tokens_file = tokens
        srv.base = f"http://127.0.0.1:{srv.frontend.http_port}"
        yield srv


@pytest.fixture(scope="module")
def open_server():
    with http_server(None, allowed_origins=("https://app.example",), allowed_hosts=("speech.internal",)) as srv:
        srv.base = f"http://127.0.0.1:{srv.frontend.http_port}"
        yield srv


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def request(method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.request(method, url, **kwargs) as response:
        return response.status, await response.json(content_type=None)


def call(method: str, url: str, **kwargs) -> tuple[int, dict]:
    return asyncio.run(request(method, url, **kwargs))


async def issue(base: str, token: str) -> tuple[int, dict]:
    return await request("POST", f"{base}/v1/realtime/client_secrets", headers=bearer(token), json={})


async def websocket(session: aiohttp.ClientSession, base: str, **kwargs) -> aiohttp.ClientWebSocketResponse | int:
    """An open WebSocket past ``session.created``, or the status that refused the upgrade."""
    try:
        ws = await session.ws_connect(base.replace("http", "ws", 1) + WS_PATH, **kwargs)
    except aiohttp.WSServerHandshakeError as err:
        return err.status
    created = await ws.receive_json(timeout=30)
    assert created["type"] == "session.created", created
    return ws


# --- Client secrets ----------------------------------------------------------------------------------------


def test_one_token_cannot_use_up_the_client_secrets_of_others(secured):
    """A token holds at most SECRETS_PER_SESSION x max_sessions secrets unspent; beyond, 429 in OpenAI's
    shape. Another token is served all along, and a spent secret gives its place back."""
    limit = SECRETS_PER_SESSION * 2

    async def run():
        answers = [await issue(secured.base, SMALL) for _ in range(limit + 3)]
        admin = await issue(secured.base, ADMIN)
        async with aiohttp.ClientSession() as session:
            ws = await websocket(
                session, secured.base, protocols=[f"openai-insecure-api-key.{answers[0][1]['value']}"]
            )
            assert not isinstance(ws, int), ws
            await ws.close()
        again = await issue(secured.base, SMALL)
        return answers, admin, again

    answers, admin, again = asyncio.run(run())
    statuses = [status for status, _ in answers]
    assert statuses == [200] * limit + [429] * 3
    error = answers[-1][1]["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_client_secrets", error
    assert f"{limit} client secrets" in error["message"] and "'small'" in error["message"], error
    assert admin[0] == 200 and admin[1]["value"].startswith("ek_")
    assert again[0] == 200, "the spent secret's place is free again"


def test_spent_and_issued_secrets_never_fill_the_shared_table():
    """The shared table itself, with no server: one token issuing and spending far more secrets than the
    table holds is never refused, and a token at its limit leaves the others their room."""
    table = TokenSessions()
    now = time.time()
    alice, bob = b"a" * 32, b"b" * 32
    for n in range(5000):
        nonce = n.to_bytes(NONCE_BYTES, "big")
        table.issue_secret(nonce, alice, now + 600, now, limit=4)
        assert table.spend(nonce, now) == alice
        assert table.spend(nonce, now) is None, "each secret opens one connection"
    for n in range(4):
        table.issue_secret(b"x%d" % n, alice, now + 600, now, limit=4)
    with pytest.raises(QuotaExceeded):
        table.issue_secret(b"y", alice, now + 600, now, limit=4)
    table.issue_secret(b"z", bob, now + 600, now, limit=4)
    assert table.spend(b"z", now) == bob


def test_open_websockets_are_given_back_on_close_and_when_their_frontend_dies():
    table = TokenSessions(frontends=2)
    alice = b"a" * 32
    first, second = table.for_frontend(0), table.for_frontend(1)
    held = [first.open_websocket(alice, limit=2), second.open_websocket(alice, limit=2)]
    with pytest.raises(QuotaExceeded):
        first.open_websocket(alice, limit=2)
    held[1].release()
    held[1].release()  # (idempotent)
    held.append(second.open_websocket(alice, limit=2))
    table.reset_row(0)  # frontend 0 died with its WebSocket
    second.open_websocket(alice, limit=2)


def test_a_secret_dies_with_the_token_value_it_was_issued_for(secured):
    """The tokens file gives the name 'rotated' a new value: a secret issued with the old value is refused
    401, though the name is still there; one issued with the new value opens a WebSocket."""

    async def run():
        status, old = await issue(secured.base, ROTATED)
        assert status == 200
        secured.tokens_file.write_text(token_lines(ROTATED_NEW))
        assert secured.frontend.tokens.reload("the test rotated a token")
        try:
            status, new = await issue(secured.base, ROTATED_NEW)
            assert status == 200
            async with aiohttp.ClientSession() as session:
                refused = await websocket(
                    session, secured.base, protocols=[f"openai-insecure-api-key.{old['value']}"]
                )
                opened = await websocket(
                    session, secured.base, protocols=[f"openai-insecure-api-key.{new['value']}"]
                )
                assert not isinstance(opened, int), opened
                await opened.close()
            return refused
        finally:
            secured.tokens_file.write_text(token_lines())
            secured.frontend.tokens.reload("the test restored the tokens")

    assert asyncio.run(run()) == 401


# --- WebSockets and idle connections ----------------------------------------------------------------------


def test_websockets_are_counted_against_their_token(secured):
    """A max_sessions=2 token opens WEBSOCKETS_PER_SESSION x 2 WebSockets; the next is refused 429 before
    the upgrade; one closed makes room; another token is not affected."""
    limit = WEBSOCKETS_PER_SESSION * 2

    async def run():
        async with aiohttp.ClientSession() as session:
            held = [await websocket(session, secured.base, headers=bearer(SMALL)) for _ in range(limit + 2)]
            opened = [ws for ws in held if not isinstance(ws, int)]
            refused = [ws for ws in held if isinstance(ws, int)]
            admin = await websocket(session, secured.base, headers=bearer(ADMIN))
            await opened[0].close()
            await asyncio.sleep(0.2)  # the server's side of the close
            after = await websocket(session, secured.base, headers=bearer(SMALL))
            body = await request("GET", secured.base + WS_PATH, headers={**bearer(SMALL), **upgrade_headers()})
            for ws in [*opened[1:], admin, after]:
                if not isinstance(ws, int):
                    await ws.close()
            return len(opened), refused, admin, after, body

    opened, refused, admin, after, body = asyncio.run(run())
    assert opened == limit and refused == [429, 429]
    assert not isinstance(admin, int) and not isinstance(after, int)
    status, error = body
    assert status == 429 and error["error"]["type"] == "rate_limit_error", body
    assert "WebSockets" in error["error"]["message"] and "max_sessions=2" in error["error"]["message"], body


def upgrade_headers() -> dict:
    return {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }


def closed_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``timeout_s``), reading past any
    response."""
    sock.settimeout(timeout_s)
    started = time.monotonic()
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_connections_that_send_no_request_are_closed(secured):
    """A connection that sends nothing, one that stops halfway through its headers, and a keep-alive one
    idle after its answer are each closed after the idle timeout (generous bounds: a loaded box)."""
    port = secured.frontend.http_port
    silent = socket.create_connection(("127.0.0.1", port))
    partial = socket.create_connection(("127.0.0.1", port))
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    kept = socket.create_connection(("127.0.0.1", port))
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    for sock in (silent, partial, kept):
        with sock:
            took = closed_within(sock, IDLE_TIMEOUT_S + 20)
            assert took is not None, "the server left an idle connection open"


# --- Without tokens: own pages only, no secrets -------------------------------------------------------------


def test_without_tokens_websockets_answer_only_allowed_origins_and_hosts(open_server):
    port = open_server.frontend.http_port

    async def run():
        async with aiohttp.ClientSession() as session:
            results = {}
            for label, headers in {
                "no origin": {},
                "own origin": {"Origin": f"http://127.0.0.1:{port}"},
                "localhost": {"Origin": f"http://localhost:{port}", "Host": f"localhost:{port}"},
                "allowed origin": {"Origin": "https://app.example"},
                "allowed host": {"Host": f"speech.internal:{port}"},
                "foreign origin": {"Origin": "https://evil.example"},
                "null origin": {"Origin": "null"},
                "rebound host": {"Origin": f"http://evil.example:{port}", "Host": f"evil.example:{port}"},
                "rebound, no origin": {"Host": f"evil.example:{port}"},
            }.items():
                ws = await websocket(session, open_server.base, headers=headers)
                results[label] = ws if isinstance(ws, int) else 101
                if not isinstance(ws, int):
                    await ws.close()
            return results

    assert asyncio.run(run()) == {
        "no origin": 101,
        "own origin": 101,
        "localhost": 101,
        "allowed origin": 101,
        "allowed host": 101,
        "foreign origin": 403,
        "null origin": 403,
        "rebound host": 403,
        "rebound, no origin": 403,
    }
    status, body = call(
        "GET", open_server.base + WS_PATH, headers={"Origin": "https://evil.example", **upgrade_headers()}
    )
    assert status == 403 and body["error"]["type"] == "invalid_request_error", body
    assert "--allowed-origins" in body["error"]["message"], body
    status, body = call("GET", f"{open_server.base}/v1/models", headers={"Host": "evil.example"})
    assert status == 403 and "--allowed-hosts" in body["error"]["message"], body


def test_without_tokens_a_cross_site_upload_is_refused_and_secrets_are_not_issued(open_server):
    data = aiohttp.FormData()
    data.add_field("model", "whisper-1")
    data.add_field("file", b"RIFF", filename="a.wav")
    status, body = call(
        "POST",
        f"{open_server.base}/v1/audio/transcriptions",
        data=data,
        headers={"Origin": "https://evil.example"},
    )
    assert status == 403 and body["error"]["code"] == "origin_not_allowed", body
    status, body = call("POST", f"{open_server.base}/v1/realtime/client_secrets", json={})
    assert status == 404 and "--auth-tokens" in body["error"]["message"], body  # the page connects without one
    assert call("GET", f"{open_server.base}/v1/models")[0] == 200, "curl and SDKs send no Origin"


# --- Errors ---------------------------------------------------------------------------------------------------


def test_client_errors_are_invalid_request_errors_and_401_names_the_http_header(secured):
    status, body = call("GET", f"{secured.base}/v1/audio/transcriptions")
    assert status == 405 and body["error"]["type"] == "invalid_request_error", body
    status, body = call("GET", f"{secured.base}/v1/models")
    assert status == 401 and body["error"]["type"] == "invalid_request_error", body
    assert "Authorization: Bearer TOKEN" in body["error"]["message"], body
    assert "x-goog-api-key" not in body["error"]["message"], body
    status, body = call("GET", f"{secured.base}/v1/models", headers={"Authorization": "Basic abc"})
    assert status == 401 and "x-goog-api-key" not in body["error"]["message"], body


def test_a_websocket_over_its_tokens_max_sessions_closes_with_1013(secured):
    """As docs/HTTP.md says: a session its token has no quota left for is an error event, then close 1013
    (try again later), while the token's other sessions go on."""
    audio = base64.b64encode(b"\0\0" * 2400).decode()  # 100 ms at 24 kHz

    async def run():
        async with aiohttp.ClientSession() as session:
            sockets = [await websocket(session, secured.base, headers=bearer(SMALL)) for _ in range(3)]
            events = []
            for ws in sockets:
                await ws.send_json({"type": "input_audio_buffer.append", "audio": audio})
                await asyncio.sleep(0.3)  # (the first two hold their sessions before the third asks)
            third = sockets[2]
            while (message := await third.receive(timeout=30)).type == aiohttp.WSMsgType.TEXT:
                events.append(message.json())
            await asyncio.sleep(0.2)
            going_on = [not ws.closed for ws in sockets[:2]]
            for ws in sockets:
                await ws.close()
            return events, message.data if message.type == aiohttp.WSMsgType.CLOSE else message, going_on

    events, code, going_on = asyncio.run(run())
    errors = [event["error"] for event in events if event["type"] == "error"]
    assert errors and "max_sessions=2" in errors[-1]["message"], events
    assert code == 1013 and going_on == [True, True]
