"""``cosystream admin load|unload|status``: operator calls to a running server's Admin service."""

from __future__ import annotations

import argparse
import os
import sys
import time

from cosystream.v1.client import DEFAULT_SERVER, add_connection_args, connection_from_args


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    admin = commands.add_parser("admin", help="operator calls to a running server (models)", parents=parents)
    calls = admin.add_subparsers(dest="call", required=True)
    load = calls.add_parser(
        "load", help="load a model directory as NAME: a new version of a served model, or a new model"
    )
    load.add_argument(
        "name", metavar="NAME", help="the name sessions ask for (a served name: a new version of it)"
    )
    load.add_argument("directory", metavar="DIR", help="the model directory, as the server's host sees it")
    load.add_argument(
        "--precision",
        default="",
        help="serve it at float32, bfloat16, float16 (CUDA) or int8 (CPU) (default: the precision the name is "
        "served at; a new name: float32)",
    )
    unload = calls.add_parser("unload", help="stop serving the model NAME (live sessions finish on it)")
    unload.add_argument("name", metavar="NAME")
    status = calls.add_parser("status", help="the models served, the engines, the sessions open")
    for call in (load, unload, status):
        call.add_argument("--server", default=DEFAULT_SERVER, help="host:port of the server")
        call.add_argument(
            "--timeout", type=float, default=600.0, help="seconds to wait for the call (default: 600)"
        )
        add_connection_args(call)


def run(args: argparse.Namespace) -> int:
    """``cosystream admin load|unload|status``: one call; what it did printed, or the reason and 1."""
    import grpc

    from cosystream.v1 import cosystream_pb2 as pb
    from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
    from cosystream.v1.client import describe_error, server_address

    try:
        connection = connection_from_args(args)
        address = server_address(args.server)
        channel = connection.channel(address)
    except ValueError as err:
        sys.exit(f"cosystream admin: {err}")
    stub = pb_grpc.AdminStub(channel)
    try:
        if args.call == "load":
            # (A relative directory is the caller's: the server's working directory is another.)
            started = time.monotonic()
            reply = stub.LoadModel(
                pb.LoadModelRequest(
                    name=args.name, path=os.path.abspath(args.directory), precision=args.precision
                ),
                timeout=args.timeout,
            )
            model = reply.model
            print(
                f"{model.name} version {model.version}{' (the default model)' if model.is_default else ''} "
                f"serving: loaded and warmed in {reply.load_seconds:.2f} s, installed in "
                f"{reply.install_seconds * 1e3:.2f} ms (the call took {time.monotonic() - started:.1f} s, the "
                "decoders made ready included)"
            )
        elif args.call == "unload":
            stub.UnloadModel(pb.UnloadModelRequest(name=args.name), timeout=args.timeout)
            print(f"{args.name} unloaded: new sessions asking for it are refused; live ones finish on it")
        else:
            info = pb_grpc.CosyStreamStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=args.timeout)
            print(status_text(info))
    except grpc.RpcError as err:
        print(
            f"cosystream admin {args.call}: {describe_error(err.code(), err.details(), connection)}",
            file=sys.stderr,
        )
        return 1
    finally:
        channel.close()
    return 0


def status_text(info) -> str:
    """``admin status``: a ``ServerInfo`` as an operator reads it, a line per model and per engine."""
    lines = [
        f"cosystream {info.version}: {info.active_sessions} of {info.max_sessions} sessions open, "
        f"{info.frontends} frontend(s), {info.loaded_model_versions} model version(s) in memory"
    ]
    for model in info.models:
        lines.append(
            f"model {model.name}{' (default)' if model.is_default else ''}: version {model.version}, "
            f"{model.precision}, {model.vocabulary_kind}, {model.parameters / 1e6:.2f} M parameters"
        )
    for engine in info.engines:
        lines.append(
            f"engine {engine.index} ({engine.device}): {'serving' if engine.serving else 'restarting'}, "
            f"{engine.active_sessions} of {engine.max_sessions} sessions"
        )
    if not info.engines:
        lines.append(f"engine ({info.device}): serving")
    load = info.load
    lines.append(
        f"load: engine {load.engine_load:.2f} (admit {load.admit_load:g}), shed {load.degradation or 'none'}, "
        f"{load.realtime_sessions} realtime / {load.batch_sessions} batch sessions, {load.free_slots} slots free, "
        f"{load.queued_frames} frames queued{', OVERLOADED' if load.overloaded else ''}"
    )
    cpu = (
        f"{load.host_cpu_busy:.2f} of {load.host_cpu_cores:g} cores busy, {load.cpu_per_session:.3f} per call"
        if load.host_cpu_cores
        else "not sampled yet"
    )
    lines.append(
        f"this frontend: loop {load.frontend_lag_ms:.1f} ms late, realtime audio read {load.audio_late_ms:.0f} ms "
        f"late, host CPU {cpu} (admit {load.admit_cpu:g})"
    )
    return "\n".join(lines)
