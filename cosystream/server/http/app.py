"""The HTTP port of a frontend (``serve --http-port``): aiohttp on the frontend's own asyncio loop, beside
grpc.aio, over the same servicer, so HTTP sessions share the engine, the scheduler, the endpointing, the
session limits and the token quotas with the gRPC ones.

Routes::

    GET  /                                      the captioning page (static/)
    GET  /health                                200 while the server is SERVING, else 503
    GET  /v1/models                             the served models, in OpenAI's list shape
    POST /v1/audio/transcriptions               a file, transcribed (transcriptions.py)
    GET  /v1/realtime?intent=transcription      the Realtime API's transcription events (realtime.py);
                                                &resumable=true, &resume_token=...: realtime_resume.py
    POST /v1/realtime/transcription_sessions    a short-lived client secret for a browser (secrets.py)
    POST /v1/realtime/client_secrets            the same, in the newer API's shape
    GET  /v1/media-streams/twilio               Twilio Media Streams' WebSocket (media_streams.py)
    GET  /v1/media-streams/audio-fork           FreeSWITCH mod_audio_fork's / jambonz listen's WebSocket

With tokens on, everything under /v1/ needs ``Authorization: Bearer TOKEN`` (401 in OpenAI's error shape
otherwise); the WebSocket also takes a client secret, in its subprotocols
(``openai-insecure-api-key.SECRET``) or as ``?client_secret=SECRET``. The page and /health need none. A
token holds at most ``WEBSOCKETS_PER_SESSION`` x its ``max_sessions`` WebSockets open, on every frontend
together (429 before the upgrade beyond). Without tokens the port answers its own pages only: a request
whose ``Origin`` is another site's, or whose ``Host`` is a name the server does not go by (DNS rebinding),
gets 403 (``HttpConfig.allowed_origins``/``allowed_hosts`` add others), and there are no client secrets.
A connection that sends no request for ``HttpConfig.idle_timeout_s`` (before its first, or between
kept-alive ones) is closed. TLS is the gRPC port's: the same files, reloaded when they change.

With several frontends each also serves ``/v1/realtime`` on a socket of its own in the server's private run
folder, for the resumes of its sessions that land on a sibling (``realtime_resume.relay``): the sibling
authenticated the client and names its token in ``RELAYED_TOKEN_HEADER``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import logging
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from cosystream.frontend.quota import Held, OwnerLimit, QuotaExceeded
from cosystream.server.auth import UNAUTHENTICATED_HELP, AuthError, Token, TokenStore
from cosystream.server.forward import sibling_holding
from cosystream.server.http import HttpConfig
from cosystream.server.http.errors import ApiError
from cosystream.server.http.media_streams import MAX_MESSAGE_BYTES, AudioForkStream, MediaSocket, TwilioStream
from cosystream.server.http.realtime import RealtimeConnection
from cosystream.server.http.realtime_resume import (
    HeldConnections,
    ResumeRefused,
    ResumeRequest,
    http_socket,
    relay,
    wants_resume,
)
from cosystream.server.http.secrets import (
    DEFAULT_TTL_S,
    MAX_TTL_S,
    MIN_TTL_S,
    ClientSecrets,
    SecretRefused,
    outstanding_limit,
)
from cosystream.server.http.transcriptions import Transcriber
from cosystream.server.servicer import CosyStreamServicer
from cosystream.server.tls import ReloadingSSLContext, TlsConfig
from cosystream.v1.webhook import WebhookPoster

log = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
SECRET_PROTOCOL = "openai-insecure-api-key."
MAX_EVENT_BYTES = 16 << 20  # one WebSocket message (OpenAI takes appends of up to 15 MiB)
WEBSOCKETS_PER_SESSION = 2
"""Open WebSockets a token may hold per session of its ``max_sessions`` (a page reconnecting while its old
socket closes needs a second)..."""
WEBSOCKETS_PER_TOKEN = 256
"""... and a token without ``max_sessions``."""
HTTP_HELP = "send the header 'Authorization: Bearer TOKEN' with a token this server knows"
RELAYED_TOKEN_HEADER = "Cosystream-Token-Name"
"""A relayed resume's token (its name; absent: authentication is off), on a frontend's own socket only."""


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
        self.secrets = ClientSecrets(servicer.token_sessions, tokens) if tokens is not None else None
        self.origins = {o.strip().rstrip("/").lower() for o in config.allowed_origins}
        self.hosts = _served_names(config)
        self.ssl = ReloadingSSLContext(tls) if tls is not None else None
        self.serving = serving
        self.port = config.port
        self.connections: set[RealtimeConnection] = set()
        self.held = HeldConnections(servicer)
        self.media_sockets: set[MediaSocket] = set()
        self.webhook = WebhookPoster(config.media_webhook) if config.media_webhook else None
        self.transcriber = Transcriber(servicer, config.max_upload_bytes, config.max_upload_audio_s)
        self._runner: web.AppRunner | None = None
        self._relay_runner: web.AppRunner | None = None

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.config.max_upload_bytes + (1 << 20))
        app.router.add_get("/", self._page)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        app.router.add_get("/v1/realtime", self._realtime)
        app.router.add_post("/v1/realtime/transcription_sessions", self._transcription_session)
        app.router.add_post("/v1/realtime/client_secrets", self._client_secret)
        app.router.add_get("/v1/media-streams/twilio", self._twilio)
        app.router.add_get("/v1/media-streams/audio-fork", self._audio_fork)
        if STATIC.is_dir():
            app.router.add_static("/static/", STATIC)
        app.on_response_prepare.append(_page_headers)
        return app

    async def start(self) -> int:
        """Listen (SO_REUSEPORT: the frontends share the port); returns the bound port."""
        self._runner = web.AppRunner(
            self.application(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
            keepalive_timeout=self.config.idle_timeout_s,  # also closes a connection that never sends a request
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
        options = self.servicer.options
        if options.peers:  # (the resumes of this frontend's sessions that land on a sibling)
            relayed = web.Application()
            relayed.router.add_get("/v1/realtime", self._relayed_realtime)
            self._relay_runner = web.AppRunner(relayed, handler_cancellation=True, access_log=None)
            await self._relay_runner.setup()
            await web.UnixSite(self._relay_runner, http_socket(options.peers[options.frontend_index])).start()
        return self.port

    async def stop(self) -> None:
        """Close the WebSockets still open (1001 going away), then the port."""
        for connection in list(self.connections):
            connection.close(1001, "the server is shutting down")
        self.held.expire_all("the server stopped")
        for socket_ in list(self.media_sockets):
            await socket_.ws.close(code=1001, message=b"the server is shutting down")
        if self.webhook is not None:
            await self.webhook.stop()
        for runner in (self._relay_runner, self._runner):
            if runner is not None:
                await runner.cleanup()
        self._runner = self._relay_runner = None

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
            if self.tokens is None and request.path != "/health":
                self._check_site(request)
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
        return self._authenticate([("authorization", header)] if header is not None else [])

    def _authenticate(self, metadata: list[tuple[str, str]]) -> Token:
        try:
            return self.tokens.authenticate(metadata)
        except AuthError as err:  # its help names gRPC's headers; this port reads Authorization only
            raise ApiError(401, err.message.replace(UNAUTHENTICATED_HELP, HTTP_HELP), "invalid_api_key") from None

    def _check_site(self, request: web.Request) -> None:
        """Without tokens, only this server's own pages may drive it: raises :class:`ApiError` 403 for a
        ``Host`` that is not a name it goes by (a DNS-rebinding page) or an ``Origin`` of another site (a
        cross-site WebSocket or form). Requests with neither (curl, SDKs) pass."""
        host = request.headers.get("Host")
        if host is not None and "*" not in self.hosts and not _host_served(host, self.hosts):
            raise ApiError(
                403,
                f"Host {host!r} is not a name this server answers to without tokens (a DNS-rebinding guard): "
                "serve --allowed-hosts NAME[,NAME...] adds it, or turn tokens on (--auth-tokens)",
                "host_not_allowed",
            )
        origin = request.headers.get("Origin")
        if origin is None or "*" in self.origins:
            return
        origin = origin.strip().rstrip("/").lower()
        if origin != f"{request.scheme}://{host or ''}".lower() and origin not in self.origins:
            raise ApiError(
                403,
                f"Origin {origin!r} may not use this server without tokens (only its own pages may): serve "
                "--allowed-origins ORIGIN[,ORIGIN...] allows it, or turn tokens on (--auth-tokens)",
                "origin_not_allowed",
            )

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
        if token is None:
            raise ApiError(
                404,
                "client secrets exist only when the server has tokens (serve --auth-tokens): without them, "
                "open the WebSocket as is",
                "not_found",
            )
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
        try:
            return (*self.secrets.issue(token, seconds), body)
        except OwnerLimit:
            raise ApiError(
                429,
                f"token {token.name!r} already holds {outstanding_limit(token)} client secrets not yet used "
                "nor expired: open a connection with one, or wait for them to expire, before asking for more",
                "too_many_client_secrets",
            ) from None
        except QuotaExceeded:
            raise ApiError(
                429, "the server holds all the client secrets it can; retry in a minute", "too_many_client_secrets"
            ) from None

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
        if presented is None or self.tokens is None:
            return self._token(request), chosen
        if not presented.startswith("ek_"):  # a real token in a subprotocol (discouraged, but a token)
            return self._authenticate([("authorization", f"Bearer {presented}")]), chosen
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
        held = None
        try:
            held = self._hold_websocket(token)
            ws = web.WebSocketResponse(
                protocols=(protocol,) if protocol else (), max_msg_size=MAX_EVENT_BYTES, heartbeat=30.0
            )
            await ws.prepare(request)
            return await self._serve_websocket(ws, request, token, beta)
        finally:
            if held is not None:
                held.release()

    async def _relayed_realtime(self, request: web.Request) -> web.StreamResponse:
        """A resume of one of this frontend's sessions that a sibling authenticated and relays."""
        name = request.headers.get(RELAYED_TOKEN_HEADER)
        token = None
        if self.tokens is not None:
            token = next((t for t in self.tokens.tokens if t.name == name), None)
            if token is None:
                raise ApiError(401, "the relayed resume names no token this server knows", "invalid_api_key")
        ws = web.WebSocketResponse(max_msg_size=MAX_EVENT_BYTES, heartbeat=30.0)
        await ws.prepare(request)
        return await self._serve_websocket(ws, request, token, False)

    def _hold_websocket(self, token: Token | None) -> Held | None:
        """Count the WebSocket against its token (None: tokens off, nothing counted). Raises
        :class:`ApiError` 429 at the token's limit."""
        if token is None:
            return None
        per_session = None if token.max_sessions is None else WEBSOCKETS_PER_SESSION * token.max_sessions
        limit = per_session or WEBSOCKETS_PER_TOKEN
        try:
            return self.servicer.token_sessions.open_websocket(token.digest, limit)
        except OwnerLimit:
            quota = (
                ""
                if per_session is None
                else f" ({WEBSOCKETS_PER_SESSION} x its max_sessions={token.max_sessions})"
            )
            message = f"token {token.name!r} already holds {limit} WebSockets open{quota}: close one first"
        except QuotaExceeded:
            message = "the server holds all the WebSockets it can; retry in a minute"
        raise ApiError(429, message, "too_many_websockets")

    async def _serve_websocket(
        self, ws: web.WebSocketResponse, request: web.Request, token: Token | None, beta: bool
    ) -> web.WebSocketResponse:
        connection = None
        try:
            resume = ResumeRequest.of(request.query)
            if resume is not None:
                sibling = sibling_holding(resume.token, self.servicer.options)
                if sibling is not None:
                    self.servicer.metrics.forwarded()
                    headers = {} if token is None else {RELAYED_TOKEN_HEADER: token.name}
                    await relay(request, ws, http_socket(self.servicer.options.peers[sibling]), headers)
                    return ws
                connection = await self.held.take(resume, token)
        except ResumeRefused as refused:
            log.info("realtime resume refused: %s", refused.message)
            error = {"type": "invalid_request_error", "code": refused.code, "message": refused.message}
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_json({"type": "error", "event_id": f"event_{uuid.uuid4().hex[:20]}", "error": error})
                await ws.close(code=1008, message=refused.message[:120].encode())
            return ws
        if connection is None:
            held = self.held if wants_resume(request.query) else None
            connection = RealtimeConnection(self.servicer, ws, token, beta, self.config.ws_idle_timeout_s, held)
        self.connections.add(connection)
        self.servicer.metrics.websocket(opened=True)
        started = time.monotonic()
        try:
            await (connection.serve() if resume is None else connection.resume(ws))
        finally:
            if connection.ws in (ws, None):  # (not when a resume on another WebSocket has taken it over)
                self.connections.discard(connection)
            self.servicer.metrics.websocket(opened=False)
            log.info(
                "realtime session %s: its WebSocket closed after %.1f s%s",
                connection.session_id,
                time.monotonic() - started,
                ", the session held for a resume" if connection.detached else "",
            )
            with contextlib.suppress(Exception):
                await ws.close()
        return ws

    # The telephony platforms' WebSockets.
    async def _twilio(self, request: web.Request) -> web.StreamResponse:
        return await self._media_stream(request, TwilioStream)

    async def _audio_fork(self, request: web.Request) -> web.StreamResponse:
        return await self._media_stream(request, AudioForkStream)

    async def _media_stream(self, request: web.Request, kind: type[MediaSocket]) -> web.StreamResponse:
        if self.servicer.draining:
            raise ApiError(503, "the server is shutting down; retry on another one", "unavailable")
        token = self._media_token(request)
        held = None
        try:
            held = self._hold_websocket(token)
            ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=30.0)
            await ws.prepare(request)

            def authenticate(presented: str) -> Token:
                return self._authenticate([("authorization", f"Bearer {presented}")])

            media = kind(
                self.servicer, ws, token, authenticate, self.tokens is not None, dict(request.query), self.webhook
            )
            self.media_sockets.add(media)
            self.servicer.metrics.websocket(opened=True)
            try:
                await media.serve()
            finally:
                self.media_sockets.discard(media)
                self.servicer.metrics.websocket(opened=False)
            return ws
        finally:
            if held is not None:
                held.release()

    def _media_token(self, request: web.Request) -> Token | None:
        """The upgrade's token: ``Bearer TOKEN``, or ``Basic`` with the token as the password (jambonz's
        wsAuth); None when tokens are off or the upgrade has no Authorization (the first message must carry
        one then). Raises :class:`ApiError` 401 for a wrong one."""
        header = request.headers.get("Authorization")
        if self.tokens is None or header is None:
            return None
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic":
            try:
                value = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                raise ApiError(401, "an Authorization: Basic header that is not base64 user:password") from None
            header = f"Bearer {value}"
        return self._authenticate([("authorization", header)])


def _served_names(config: HttpConfig) -> frozenset[str]:
    """The host names the port answers to without tokens: loopback's, the machine's, the bound address,
    and those of ``allowed_hosts`` and ``allowed_origins`` (any IP address is answered too: a page cannot
    rebind one)."""
    names = {"localhost", socket.gethostname().lower(), config.host.lower()}
    names.update(h.strip().lower() for h in config.allowed_hosts)
    for origin in config.allowed_origins:
        host = origin.strip().rstrip("/").lower().partition("://")[2]
        if host:  # (not "*" or "null")
            names.add(host.rsplit(":", 1)[0] if not host.endswith("]") else host)
    return frozenset(names)


def _host_served(host: str, names: frozenset[str]) -> bool:
    """``host`` (a Host header: a name or address, maybe a port) is an IP address or one of ``names``."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        name = host[1 : host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in names or name.endswith(".localhost")
