"""The gRPC servicer of ``cosystream.v1.Admin``: operator calls, served on the frontends' gRPC port.

``LoadModel`` has the engine load a model directory beside the models it serves and swap it in (a new
version of a served name, or a new name); ``UnloadModel`` stops serving one. When the server checks tokens,
each call needs a token with the ``admin`` option (``auth.py``); the interceptor has already refused a call
without a known token.

Without tokens the service is off unless ``serve --admin`` turns it on: a port open to anyone must not let
anyone replace the model it serves. Off, :class:`AdminOff` answers every call PERMISSION_DENIED, saying how
to turn it on, and touches nothing else (:func:`add_admin_service` picks which).
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from cosystream.engine import ipc
from cosystream.frontend.engine_client import ModelLoadError
from cosystream.model_files import PRECISIONS, RESERVED_NAMES
from cosystream.server.auth import current_token
from cosystream.server.servicer import CosyStreamServicer, model_message
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name

_CODES = {
    ipc.LOAD_FAILED: grpc.StatusCode.FAILED_PRECONDITION,
    ipc.UNDECODABLE: grpc.StatusCode.INVALID_ARGUMENT,
    ipc.BUSY: grpc.StatusCode.UNAVAILABLE,
}


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, servicer: CosyStreamServicer):
        self.servicer = servicer
        self.engine = servicer.engine

    async def _check_admin(self, context, what: str) -> None:
        token = current_token()
        if token is not None and not token.admin:
            log.info("refused %s for token %s: not an admin token", what, token.name)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"token {token.name!r} may not {what}: it needs the admin option in the tokens file",
            )

    async def LoadModel(self, request: pb.LoadModelRequest, context) -> pb.LoadModelResponse:
        await self._check_admin(context, "load models")
        name, path = request.name, request.path
        if name in RESERVED_NAMES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"name {name!r} cannot name a model: it asks for the default one (give the model's name)",
            )
        if not path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path is required: the model directory")
        if request.precision and request.precision not in PRECISIONS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"precision {request.precision!r}: one of {', '.join(PRECISIONS)} (or empty: as served)",
            )
        if not Path(path).is_dir():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"cannot load {path}: no such directory on the server"
            )
        path = str(Path(path).resolve())
        log.info("loading model %s from %s", name, path)
        try:
            result = await self.engine.load_model(name, path, request.precision)
        except ModelLoadError as err:
            log.warning("model %s from %s not loaded: %s", name, path, err)
            await context.abort(_CODES.get(err.failure, grpc.StatusCode.FAILED_PRECONDITION), str(err))
        is_default = self.servicer.info.models[0].id == result.model.id
        return pb.LoadModelResponse(
            model=model_message(result.model, is_default),
            load_seconds=result.load_s,
            install_seconds=result.install_s,
        )

    async def UnloadModel(self, request: pb.UnloadModelRequest, context) -> pb.UnloadModelResponse:
        await self._check_admin(context, "unload models")
        name = request.name
        info = self.servicer.info
        if name in RESERVED_NAMES or name == info.model_name:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{info.model_name!r} is the default model: it cannot be unloaded (load a new version instead)",
            )
        if info.model_index(name) is None:
            served = ", ".join(repr(m.name) for m in info.models)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no model {name!r} is served here (served: {served})")
        try:
            await self.engine.unload_model(name)
        except ModelLoadError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return pb.UnloadModelResponse()


ADMIN_OFF = (
    "the Admin service is off: start serve with --admin (anyone who reaches the port may then load models), "
    "or with --auth-tokens and call it with an admin token"
)


class AdminOff(pb_grpc.AdminServicer):
    """The Admin service of a server without tokens and without ``--admin``: every call refused."""

    async def LoadModel(self, request: pb.LoadModelRequest, context) -> pb.LoadModelResponse:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, ADMIN_OFF)

    async def UnloadModel(self, request: pb.UnloadModelRequest, context) -> pb.UnloadModelResponse:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, ADMIN_OFF)


def add_admin_service(servicer: CosyStreamServicer, server, enabled: bool, tokens: bool) -> tuple[str, ...]:
    """Register the Admin service on ``server``: the real one when ``enabled`` (``serve --admin``) or with
    ``tokens`` (then an admin token is needed), else :class:`AdminOff`. Returns the names reflection lists
    (none when off). Logs which, once per frontend."""
    if not (enabled or tokens):
        pb_grpc.add_AdminServicer_to_server(AdminOff(), server)
        log.info("admin service off (serve --admin, or --auth-tokens with an admin token, turns it on)")
        return ()
    pb_grpc.add_AdminServicer_to_server(AdminServicer(servicer), server)
    log.info(
        "admin service on: %s",
        "admin tokens only" if tokens else "open to anyone who reaches the port (--admin, no tokens)",
    )
    return (ADMIN_SERVICE_NAME,)
