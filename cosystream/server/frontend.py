"""A frontend: one grpc.aio server (the port shared with its siblings via SO_REUSEPORT), connected to the
engine process, with gRPC health and reflection.

Health is SERVING only while the engine is connected and every frontend of the server listens (the engine
counts them: connections made before the others exist would all stay on the first), and NOT_SERVING at
once when the engine is lost (until it is back and warm) or a drain begins.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cosystream.metrics import FrontendMetrics
from cosystream.server.compat import add_compat_services
from cosystream.server.engine_client import Engine, EngineClient
from cosystream.server.servicer import CosyStreamServicer, StreamOptions
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import DEFAULT_PORT

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CosyStream"].full_name


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    max_message_bytes: int = (
        10 << 20
    )  # a larger request is refused with RESOURCE_EXHAUSTED (Google sends <= 10 MB)
    drain_grace_s: float = 20.0  # (serve --drain-grace-s)
    stream: StreamOptions = field(default_factory=StreamOptions)


class Frontend:
    def __init__(self, config: FrontendConfig, engine_address: str, authkey: bytes, engine: Engine | None = None):
        self.config = config
        self.engine = engine if engine is not None else EngineClient(engine_address, authkey)
        self.server: grpc.aio.Server | None = None
        self.servicer: CosyStreamServicer | None = None
        self.health = health.aio.HealthServicer()
        self.port = config.port
        self.draining = False
        self._services: tuple[str, ...] = ("",)
        self._serving: bool | None = None  # as last set on the health servicer
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
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._apply_health())

    async def _apply_health(self) -> None:
        while (serving := self.serving) != self._serving:
            self._serving = serving
            status = (
                health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in self._services:
                await self.health.set(name, status)
            log.info("health: %s", "SERVING" if serving else "NOT_SERVING")
            if serving:
                self._serving_event.set()
            else:
                self._serving_event.clear()

    async def wait_serving(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._serving_event.wait(), timeout_s)

    async def start(self) -> int:
        """Connect to the engine (waits for it to be warm), then serve; returns the bound port."""
        self.engine.on_change = self._health_changed
        await self.engine.connect()
        self.servicer = CosyStreamServicer(self.engine, self.config.stream, FrontendMetrics())
        options = [
            ("grpc.so_reuseport", 1),
            # Flow control: a client that sends faster than its session is read gets pushed back after
            # ~8 s of 16 kHz audio per stream (BDP probing would grow the window to megabytes).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", 256 << 10),
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.max_send_message_length", 16 << 20),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ]
        self.server = grpc.aio.server(options=options)
        pb_grpc.add_CosyStreamServicer_to_server(self.servicer, self.server)
        compat_services = add_compat_services(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                *compat_services,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        self._services = ("", SERVICE_NAME, *compat_services)
        await self.server.start()
        self._health_changed()  # NOT_SERVING until the engine counts every frontend listening
        self.engine.mark_listening()
        log.info("serving on %s:%d", self.config.host, self.port)
        return self.port

    async def drain(self) -> None:
        """Stop taking sessions, give every open one its final, then stop (within the grace period)."""
        log.info("draining: %d open sessions", self.servicer.active_streams if self.servicer else 0)
        self.draining = True
        await self.health.enter_graceful_shutdown()  # NOT_SERVING; the port stays open through the grace
        if self.servicer is not None:
            await self.servicer.drain(self.config.drain_grace_s)
        await self.stop(grace_s=1.0)

    async def stop(self, grace_s: float | None = None) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
        self.engine.close_connection()

    async def wait(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()
