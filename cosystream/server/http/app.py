"""The HTTP port of a frontend (``serve --http-port``): aiohttp on the frontend's own asyncio loop, beside
grpc.aio, over the same servicer, so HTTP sessions share the engine, the scheduler, the endpointing, the
session limits and the token quotas with the gRPC ones.

Routes::

    GET  /                                      the captioning page (static/)
    GET  /health                                200 while the server is SERVING, else 503
    GET  /v1/models                             the served models, in OpenAI's list shape
    POST /v1/audio/transcriptions               a file, transcribed (transcriptions.py)
    GET  /v1/realtime?intent=transcription      the Realtime API's transcription events (realtime.py)
    POST /v1/realtime/transcription_sessions    a short-lived client secret for a browser (secrets.py)
    POST /v1/realtime/client_secrets            the same, in the newer API's shape

With tokens on, everything under /v1/ needs ``Authorization: Bearer TOKEN`` (401 in OpenAI's error shape
otherwise); the WebSocket also takes a client secret, in its subprotocols
(``openai-insecure-api-key.SECRET``) or as ``?client_secret=SECRET``. The page and /health need none. TLS
is the gRPC port's: the same files, reloaded when they change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from cosystream.server.auth import AuthError, Token, TokenStore
from cosystream.server.http import HttpConfig
from cosystream.server.http.errors import ApiError
from cosystream.server.http.realtime import RealtimeConnection
from cosystream.server.http.secrets import DEFAULT_TTL_S, MAX_TTL_S, MIN_TTL_S, ClientSecrets, SecretRefused
from cosystream.server.http.transcriptions import Transcriber
from cosystream.server.servicer import CosyStreamServicer
from cosystream.server.tls import ReloadingSSLContext, TlsConfig

log = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
SECRET_PROTOCOL = "openai-insecure-api-key."
MAX_EVENT_BYTES = 16 << 20  # one WebSocket message (OpenAI takes appends of up to 15 MiB)


PAGE_POLICY = "default-src 'self'; img-src 'self' data:; connect-src 'self' blob:; frame-ancestors 'none'"


async def _page_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The page and its files: revalidated on every load (an upgraded server never pairs a new page with an
    old script) and confined to this origin."""
    if request.path == "/" or request.path.startswith("/static/"):
        response.headers.setdefault("Cache-Control", "no-cache")
        response.headers.setdefault("Content-Security-Policy", PAGE_POLICY)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")


class HttpServer:
    def __init__(
        self,
        config: HttpConfig,
        servicer: CosyStreamServicer,
        tokens: TokenStore | None,
        tls: TlsConfig | None,
        serving: Callable[[], bool],
    ):
        self.config = config
        self.servicer = servicer
        self.tokens = tokens
        self.secrets = ClientSecrets(servicer.token_sessions, tokens)
        self.ssl = ReloadingSSLContext(tls) if tls is not None else None
        self.serving = serving
        self.port = config.port
        self.connections: set[RealtimeConnection] = set()
        self.transcriber = Transcriber(servicer, config.max_upload_bytes)
        self._runner: web.AppRunner | None = None

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.config.max_upload_bytes + (1 << 20))
        app.router.add_get("/", self._page)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        app.router.add_get("/v1/realtime", self._realtime)
        app.router.add_post("/v1/realtime/transcription_sessions", self._transcription_session)
        app.router.add_post("/v1/realtime/client_secrets", self._client_secret)
        if STATIC.is_dir():
            app.router.add_static("/static/", STATIC)
        app.on_response_prepare.append(_page_headers)
        return app

    async def start(self) -> int:
        """Listen (SO_REUSEPORT: the frontends share the port); returns the bound port."""
        self._runner = web.AppRunner(
            self.application(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.config.host,
            self.config.port,
            ssl_context=None if self.ssl is None else self.ssl.context,
            reuse_port=True,
        )
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("HTTP on %s:%d (%s)", self.config.host, self.port, "TLS" if self.ssl else "plaintext")
        return self.port

    async def stop(self) -> None:
        """Close the WebSockets still open (1001 going away), then the port."""
        for connection in list(self.connections):
            connection.close(1001, "the server is shutting down")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # Middleware: OpenAI's error shape for every error, expected or not.
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        response = await self._answer(request, handler)
        resource = request.match_info.route.resource
        self.servicer.metrics.http_request(
            resource.canonical if resource is not None else "unmatched", response.status
        )
        return response

    async def _answer(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return err.response()
        except web.HTTPException as err:
            if err.status < 400:
                raise
            headers = {k: v for k, v in err.headers.items() if k.lower() in ("allow", "retry-after")}
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(err.status)
            return ApiError(err.status, f"{err.reason}: {request.method} {request.path}", code).response(headers)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return ApiError(500, "the server failed to handle the request", "server_error").response()

    def _token(self, request: web.Request) -> Token | None:
        """The request's token (None: authentication is off). Raises :class:`ApiError` 401."""
        if self.tokens is None:
            return None
        header = request.headers.get("Authorization")
        try:
            return self.tokens.authenticate([("authorization", header)] if header is not None else [])
        except AuthError as err:
            raise ApiError(
                401,
                err.message.replace("the metadata header", "the header"),
                "invalid_api_key",
            ) from None

    async def _page(self, request: web.Request) -> web.StreamResponse:
        index = STATIC / "index.html"
        if not index.is_file():
            raise ApiError(404, "this build has no captioning page", "not_found")
        return web.FileResponse(index, headers={"Cache-Control": "no-cache"})

    async def _health(self, request: web.Request) -> web.Response:
        serving = self.serving()
        return web.json_response(
            {"status": "SERVING" if serving else "NOT_SERVING"}, status=200 if serving else 503
        )

    async def _models(self, request: web.Request) -> web.Response:
        self._token(request)
        models = [
            {"id": model.name, "object": "model", "created": 0, "owned_by": "cosystream", "version": model.version}
            for model in self.servicer.info.models
        ]
        return web.json_response({"object": "list", "data": models})

    async def _transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self.transcriber.handle(request, self._token(request))

    # Client secrets.
    async def _issue(self, request: web.Request) -> tuple[str, int, dict]:
        """A client secret for the request's token, for ``expires_after.seconds`` of its JSON body: the
        secret, its expiry (Unix seconds) and the body."""
        token = self._token(request)
        body = await self._json_body(request)
        after = body.get("expires_after") or {}
        seconds = after.get("seconds", DEFAULT_TTL_S) if isinstance(after, dict) else DEFAULT_TTL_S
        if not isinstance(seconds, int) or not MIN_TTL_S <= seconds <= MAX_TTL_S:
            raise ApiError(
                400,
                f"expires_after.seconds: use {MIN_TTL_S} to {MAX_TTL_S}",
                "invalid_value",
                "expires_after.seconds",
            )
        return (*self.secrets.issue(token, seconds), body)

    async def _json_body(self, request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the body is not JSON", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", "invalid_json")
        return body

    async def _transcription_session(self, request: web.Request) -> web.Response:
        """The older API's shape: a session object with ``client_secret: {value, expires_at}``."""
        secret, expires_at, _ = await self._issue(request)
        return web.json_response(
            {
                "id": f"sess_{secret[-20:]}",
                "object": "realtime.transcription_session",
                "client_secret": {"value": secret, "expires_at": expires_at},
                "input_audio_format": "pcm16",
                "turn_detection": {"type": "server_vad"},
            }
        )

    async def _client_secret(self, request: web.Request) -> web.Response:
        """The newer API's shape: ``{value, expires_at, session}``."""
        secret, expires_at, body = await self._issue(request)
        session = body.get("session") if isinstance(body.get("session"), dict) else {"type": "transcription"}
        return web.json_response({"value": secret, "expires_at": expires_at, "session": session})

    # The WebSocket.
    def _ws_token(self, request: web.Request) -> tuple[Token | None, str | None]:
        """The connection's token and the subprotocol to answer with. Raises :class:`ApiError` 401."""
        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        chosen = "realtime" if "realtime" in protocols else None
        presented = next((p[len(SECRET_PROTOCOL) :] for p in protocols if p.startswith(SECRET_PROTOCOL)), None)
        presented = presented or request.query.get("client_secret")
        if presented is None or (self.tokens is None and not presented.startswith("ek_")):
            return self._token(request), chosen
        if not presented.startswith("ek_"):  # a real token in a subprotocol (discouraged, but a token)
            try:
                return self.tokens.authenticate([("authorization", f"Bearer {presented}")]), chosen
            except AuthError as err:
                raise ApiError(401, err.message, "invalid_api_key") from None
        try:
            return self.secrets.spend(presented), chosen
        except SecretRefused as err:
            raise ApiError(401, str(err), "invalid_client_secret") from None

    async def _realtime(self, request: web.Request) -> web.StreamResponse:
        intent = request.query.get("intent", "transcription")
        if intent != "transcription":
            raise ApiError(
                400, f"intent={intent!r}: this server runs transcription sessions only", "invalid_value"
            )
        if self.servicer.draining:
            raise ApiError(503, "the server is shutting down; retry on another one", "unavailable")
        token, protocol = self._ws_token(request)
        beta = "realtime=v1" in request.headers.get(
            "OpenAI-Beta", ""
        ) or "openai-beta.realtime-v1" in request.headers.get("Sec-WebSocket-Protocol", "")
        ws = web.WebSocketResponse(
            protocols=(protocol,) if protocol else (), max_msg_size=MAX_EVENT_BYTES, heartbeat=30.0
        )
        await ws.prepare(request)
        connection = RealtimeConnection(self.servicer, ws, token, beta, self.config.ws_idle_timeout_s)
        self.connections.add(connection)
        self.servicer.metrics.websocket(opened=True)
        started = time.monotonic()
        try:
            await connection.serve()
        finally:
            self.connections.discard(connection)
            self.servicer.metrics.websocket(opened=False)
            log.info("realtime session %s closed after %.1f s", connection.session_id, time.monotonic() - started)
            with contextlib.suppress(Exception):
                await ws.close()
        return ws
