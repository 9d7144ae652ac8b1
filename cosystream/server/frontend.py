"""A frontend: one grpc.aio server (the port shared with its siblings via SO_REUSEPORT), connected to the
engine process, with gRPC health and reflection.

With ``tls`` every service of the port is behind TLS (mTLS with a client CA), the certificate reloaded
when its files change (``tls.py``); with ``auth_tokens`` every call but gRPC health needs a token
(``auth.py``), the file reloaded on :meth:`Frontend.reload_tokens` (SIGHUP) and when it changes.

Health is SERVING only while the engine is connected and every frontend of the server listens (the engine
counts them: connections made before the others exist would all stay on the first), and NOT_SERVING at
once when the engine is lost (until it is back and warm) or a drain begins.

With ``http`` the frontend also serves its HTTP port (``http/``) on the same loop and servicer.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cosystream.frontend.engine_client import Engine, EngineClient
from cosystream.frontend.engine_pool import EnginePool
from cosystream.frontend.host import StreamOptions
from cosystream.frontend.quota import TokenSessions
from cosystream.frontend.tracing import UtteranceTracer, start_tracing
from cosystream.metrics import FrontendMetrics, SecondPassMetrics
from cosystream.secondpass.worker import SecondPass
from cosystream.server.admin import add_admin_service
from cosystream.server.auth import AuthInterceptor, TokenStore
from cosystream.server.compat import add_compat_services
from cosystream.server.http import HttpConfig
from cosystream.server.servicer import CosyStreamServicer, thinning
from cosystream.server.tls import ReloadingCredentials, TlsConfig
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import DEFAULT_PORT

log = logging.getLogger(__name__)

LOAD_SERVICE = "load"
"""The gRPC health service name that says whether the server keeps up: NOT_SERVING while not serving, or
while its engine is overloaded (every engine, with several; ``engine/headroom.py``), so a load balancer
or a probe can send new sessions elsewhere. The server's own names ("" and the services) stay SERVING then:
its live sessions are served."""
_STATUS = {True: health_pb2.HealthCheckResponse.SERVING, False: health_pb2.HealthCheckResponse.NOT_SERVING}

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CosyStream"].full_name
STREAMING_RECOGNIZE = f"/{SERVICE_NAME}/StreamingRecognize"


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    max_message_bytes: int = (
        10 << 20
    )  # a larger request is refused with RESOURCE_EXHAUSTED (Google sends <= 10 MB)
    drain_grace_s: float = 20.0  # (serve --drain-grace-s)
    stream: StreamOptions = field(default_factory=StreamOptions)
    tls: TlsConfig | None = None  # None: plaintext (serve --tls-cert, --tls-key, --tls-client-ca)
    auth_tokens: str | None = None  # a tokens file; None: no authentication (serve --auth-tokens)
    http: HttpConfig | None = None  # the HTTP port (OpenAI-shaped APIs, the page); None: off (serve --http-port)
    admin: bool = False  # the Admin service without tokens (serve --admin); with tokens it is on, for admin tokens
    # HTTP/2 keepalive (serve --keepalive-s, --keepalive-timeout-s, --min-client-ping-s): the server pings every
    # connection this often and closes one whose peer does not answer in time (a vanished phone or laptop
    # frees its slot in seconds, not at the stream's idle timeout); clients may ping this often at most
    # (more often: GOAWAY too_many_pings after 2 strikes), with or without a stream.
    keepalive_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    min_client_ping_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("keepalive_s", "keepalive_timeout_s", "min_client_ping_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, not {getattr(self, name)}")


class Frontend:
    def __init__(
        self,
        config: FrontendConfig,
        engine_address: str | list[str],
        authkey: bytes,
        engine: Engine | None = None,
        token_sessions: TokenSessions | None = None,
    ):
        """Raises ``TokenFileError`` / ``TlsError`` (one-line messages) for files that cannot be used.
        ``engine_address``: the engine's socket, or a list of several engines' (an ``EnginePool``);
        ``token_sessions``: the per-token session counts this frontend shares with its siblings."""
        self.config = config
        self.tokens = TokenStore(config.auth_tokens) if config.auth_tokens else None
        self.credentials = ReloadingCredentials(config.tls) if config.tls else None
        self.token_sessions = token_sessions
        self._watch_tokens: asyncio.Task | None = None
        if engine is None:
            addresses = [engine_address] if isinstance(engine_address, str) else list(engine_address)
            engine = EngineClient(addresses[0], authkey) if len(addresses) == 1 else EnginePool(addresses, authkey)
        self.engine = engine
        self.server: grpc.aio.Server | None = None
        self.servicer: CosyStreamServicer | None = None
        self.second_pass: SecondPass | None = None  # its worker process, with config.stream.second_pass
        self.tracer: UtteranceTracer | None = None  # with config.stream.tracing
        self.http = None  # the HttpServer, when config.http is set
        self.health = health.aio.HealthServicer()
        self.port = config.port
        self.draining = False
        self._services: tuple[str, ...] = ("",)
        self._serving: bool | None = None  # as last set on the health servicer
        self._keeping_up: bool | None = None  # as last set for LOAD_SERVICE
        self._health_task: asyncio.Task | None = None
        self._serving_event = asyncio.Event()

    @property
    def serving(self) -> bool:
        """What health says: engine connected, every frontend listening, not draining."""
        return (
            not self.draining
            and self.server is not None
            and self.engine.connected
            and self.engine.listening_frontends >= self.config.stream.frontends
        )

    def _health_changed(self) -> None:
        if self.servicer is not None:
            self.servicer.thin_interims_now(thinning(self.engine.loads()))
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._apply_health())

    @property
    def keeping_up(self) -> bool:
        """What the ``load`` health service says: serving, and the engine (one of them, with several) not
        overloaded (``engine/headroom.py``)."""
        loads = [load for load in self.engine.loads() if load is not None]
        return self.serving and not (loads and all(load.overloaded for load in loads))

    async def _apply_health(self) -> None:
        while (serving := self.serving) != self._serving or self.keeping_up != self._keeping_up:
            if serving != self._serving:
                self._serving = serving
                status = _STATUS[serving]
                for name in self._services:
                    await self.health.set(name, status)
                log.info("health: %s", "SERVING" if serving else "NOT_SERVING")
                if serving:
                    self._serving_event.set()
                else:
                    self._serving_event.clear()
            if (keeping_up := self.keeping_up) != self._keeping_up:
                self._keeping_up = keeping_up
                await self.health.set(LOAD_SERVICE, _STATUS[keeping_up])
                if self._serving:  # (a server not serving says so above; this is about load)
                    log.info("health of %r: %s", LOAD_SERVICE, "SERVING" if keeping_up else "NOT_SERVING")

    async def wait_serving(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._serving_event.wait(), timeout_s)

    async def start(self) -> int:
        """Connect to the engine (waits for it to be warm), then serve; returns the bound port."""
        self.engine.on_change = self._health_changed
        await self.engine.connect()
        if self.config.stream.second_pass is not None:
            self.second_pass = SecondPass(self.config.stream.second_pass, SecondPassMetrics())
            await self.second_pass.start()  # raises ModelError: the model cannot be used
        tracing = self.config.stream.tracing
        self.tracer = None if tracing is None else start_tracing(tracing)  # (ImportError: the extra is missing)
        self.servicer = CosyStreamServicer(
            self.engine, self.config.stream, FrontendMetrics(), self.token_sessions, self.second_pass, self.tracer
        )
        self.servicer.cpu.start()  # (the host's CPU reported from the start, sessions or not)
        options = [
            ("grpc.so_reuseport", 1),
            # Flow control: a client that sends faster than its session is read gets pushed back after
            # ~8 s of 16 kHz audio per stream (BDP probing would grow the window to megabytes).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", 256 << 10),
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.max_send_message_length", 16 << 20),
            ("grpc.keepalive_time_ms", int(self.config.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.config.keepalive_timeout_s * 1000)),
            # (the ping's timeout in the gRPC core that grpcio 1.85 ships: keepalive_timeout_ms alone closes nothing)
            ("grpc.http2.ping_timeout_ms", int(self.config.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet stream (the default stops at 2)
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.config.min_client_ping_s * 1000)),
            ("grpc.http2.max_ping_strikes", 2),
        ]
        self.server = grpc.aio.server(options=options, interceptors=self._interceptors())
        pb_grpc.add_CosyStreamServicer_to_server(self.servicer, self.server)
        admin_services = add_admin_service(self.servicer, self.server, self.config.admin, self.tokens is not None)
        compat_services = add_compat_services(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                *admin_services,
                *compat_services,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        address = f"{self.config.host}:{self.config.port}"
        if self.credentials is not None:
            self.port = self.server.add_secure_port(address, self.credentials.server_credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        # Its own socket, with several frontends: resumes of its sessions that landed on a sibling come through it.
        own = self.config.stream.peers[self.config.stream.frontend_index] if self.config.stream.peers else None
        if own is not None and self.server.add_insecure_port(own) == 0:
            raise OSError(f"cannot bind {own}")
        self._services = ("", SERVICE_NAME, *compat_services)
        await self.server.start()
        if self.config.http is not None:
            from cosystream.server.http.app import HttpServer

            self.http = HttpServer(
                self.config.http, self.servicer, self.tokens, self.config.tls, lambda: self.serving
            )
            await self.http.start()
        if self.tokens is not None:
            self._watch_tokens = asyncio.get_running_loop().create_task(self.tokens.watch())
        self._health_changed()  # NOT_SERVING until the engine counts every frontend listening
        self.engine.mark_listening()
        log.info(
            "serving on %s:%d (%s, %s)",
            self.config.host,
            self.port,
            "plaintext" if self.config.tls is None else "mTLS" if self.config.tls.client_ca_path else "TLS",
            "no authentication" if self.tokens is None else f"{len(self.tokens.tokens)} token(s)",
        )
        return self.port

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if self.tokens is None:
            return []

        def refusal_response(method: str, code: grpc.StatusCode, message: str):
            if method != STREAMING_RECOGNIZE:
                return None
            # As the servicer's own refusals: the status also as a last response (cosystream.v1.client.StreamStatus).
            return pb.StreamingRecognizeResponse(error=pb.StreamError(code=code.value[0], message=message))

        def on_refused(method: str, code: grpc.StatusCode) -> None:
            if method.endswith("/StreamingRecognize") and self.servicer is not None:
                self.servicer.metrics.rejected("unauthenticated")

        return [AuthInterceptor(self.tokens, refusal_response=refusal_response, on_refused=on_refused)]

    def reload_tokens(self) -> None:
        """Read the tokens file again (SIGHUP); a bad file keeps the tokens in use. Open streams go on."""
        if self.tokens is not None:
            self.tokens.reload()

    async def drain(self) -> None:
        """Stop taking sessions, give every open one its final, then stop (within the grace period)."""
        log.info("draining: %d open sessions", self.servicer.active_streams if self.servicer else 0)
        self.draining = True
        await self.health.enter_graceful_shutdown()  # NOT_SERVING; the port stays open through the grace
        if self.servicer is not None:
            await self.servicer.drain(self.config.drain_grace_s)
        await self.stop(grace_s=1.0)

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace_s: float | None = None) -> None:
        if self._watch_tokens is not None:
            self._watch_tokens.cancel()
        if self.http is not None:
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.second_pass is not None:
            self.second_pass.close()
        if self.servicer is not None:
            self.servicer.lag.stop()
            self.servicer.cpu.stop()
            await self.servicer.peers.close()
        if self.tracer is not None:
            self.tracer.shutdown()  # (the spans batched so far are sent)
        self.engine.close_connection()

    async def wait(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()
