"""``cosystream serve``: the engine and frontend processes under a supervisor, with the gRPC, HTTP and
metrics ports (its flags: ``serve_flags.py``; read into configs: ``serve_config.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import sys
import tempfile

from cosystream.app.commands.common import decoder_request, given
from cosystream.app.commands.serve_config import (
    adaptive_config,
    compile_budget,
    default_frontends,
    frontend_config,
    model_decoders,
    read_vocabularies,
    security_config,
    served_models,
)
from cosystream.app.commands.serve_flags import add_flags


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the server: the gRPC API, the HTTP APIs and captioning page, Prometheus metrics",
        parents=parents,
    )
    add_flags(parser)


def run(args: argparse.Namespace) -> int:
    if args.frontends is None:
        args.frontends = default_frontends()
    if args.frontends < 1:
        sys.exit("--frontends must be >= 1")
    try:
        args.models = served_models(args)
        args.vocabularies = read_vocabularies(args.vocabulary)
    except (OSError, ValueError) as err:
        sys.exit(f"cosystream serve: {err}")
    run_dir = tempfile.mkdtemp(prefix="cosystream-")
    try:
        return _serve(args, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # (the metrics folder too, whatever the exit)


def check_port_free(host: str, port: int) -> None:
    """Raise ``OSError`` if ``host:port`` is taken, also by another server whose frontends share their port
    through SO_REUSEPORT (a plain bind fails beside them, where the frontends' own binds would succeed)."""
    if port == 0:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's own bind: TIME_WAIT is fine
            probe.bind(address)
        return


def compile_only(configs: list) -> int:
    """``serve --compile-only``: build each CPU engine as ``serve`` would (so the cache keys match), compiling
    every shape missing from the cache, and say what the cache now holds."""
    from cosystream.engine.process import build_core

    for config in configs:
        core = build_core(config)
        if core.device.type != "cpu":
            print(f"engine {config.index or 0}: {core.device} steps through CUDA graphs, nothing to compile")
            continue
        for name, runner in zip(core.names, core.runners, strict=True):
            steps = runner.compiled_steps
            if steps is None:
                print(f"model {name}: runs eager (float32 models only, or no C++ compiler: see the log)")
                continue
            print(
                f"model {name}: {len(runner.compiled_keys)} shapes compiled ({steps.compiled} now, {steps.loaded} "
                f"from the cache, {steps.skipped} left eager) in {steps.cache_dir}"
            )
    return 0


def _serve(args: argparse.Namespace, run_dir: str) -> int:
    # Must be set before any process imports prometheus_client (cosystream.metrics).
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", os.path.join(run_dir, "metrics"))
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

    from cosystream.app.supervisor import RestartPolicy, ServeError, Supervisor
    from cosystream.audio.endpointing import EndpointingConfig
    from cosystream.engine.config import EngineConfig, EngineProcessConfig, resolve_devices
    from cosystream.runtime.settings import GraphMode

    try:
        devices = resolve_devices(args.device, args.engines)  # --device cuda without CUDA: said now (auto: later)
        if args.naive and len(devices) > 1:
            raise ValueError("--naive runs no engine process: --engines and device lists do not go with it")
        endpointing = EndpointingConfig(
            **given(silence_ms=args.silence_ms, max_utterance_ms=args.max_utterance_ms)
        )
        engine = EngineConfig(
            max_sessions=args.max_sessions,
            max_batch=args.max_batch,
            graph_mode=GraphMode.EAGER if args.no_cuda_graphs else GraphMode.GRAPHS,
            compile=not args.no_compile,
            background_compile=not (args.no_compile or args.no_background_compile),
            **compile_budget(args),
            **given(compile_cache_dir=args.compile_cache_dir),
            realtime_batch_window_s=args.batch_window_ms / 1000,
            deadline_s=args.deadline_ms / 1000,
            batch_max_duty=args.batch_duty,
            **given(admit_load=args.admit_load, overload_window_s=args.overload_window_s),
        )
        adaptive = adaptive_config(args)
        decoder = decoder_request(args)
        decoders = model_decoders(decoder, args.models)
        tls, auth_tokens = security_config(args)
        # The candidates per frame the decoders read (the most any reads: the others read fewer of them).
        engine = dataclasses.replace(engine, top_k=max(d.top_k for _, d in decoders))
        lms = {d.lm_path for _, d in decoders if d.kind == "beam"}
        if lms:
            from cosystream.decoding.lm import NgramLm

            for lm in sorted(lms):
                NgramLm.load(lm)  # fail here, with a message, rather than in every frontend
    except (OSError, EOFError, ValueError) as err:
        sys.exit(f"cosystream serve: {err}")
    process = EngineProcessConfig(
        address=os.path.join(run_dir, "engine.sock"),
        authkey=os.urandom(16),
        engine=engine,
        models=args.models,
        adaptive=adaptive,
        device=devices[0],
        log_level=args.log_level.upper(),
        log_format=args.log_format,
    )

    try:
        frontend = frontend_config(args, tls, auth_tokens, endpointing, decoder, decoders)
    except ValueError as err:  # a config's own check (a negative --realtime-burst-s, ...)
        sys.exit(f"cosystream serve: {err}")
    restarts = RestartPolicy(**given(max_failures=args.max_failures, window_s=args.restart_window_s))
    if restarts.max_failures < 1:
        sys.exit("cosystream serve: --max-failures must be >= 1")
    if len(devices) > 1:
        process = [
            dataclasses.replace(process, address=os.path.join(run_dir, f"engine-{i}.sock"), device=d, index=i)
            for i, d in enumerate(devices)
        ]
    if args.compile_only:
        return compile_only(process if isinstance(process, list) else [process])
    supervisor = Supervisor(
        process,
        frontend,
        args.frontends,
        args.metrics_port,
        naive=args.naive,
        restarts=restarts,
        metrics_host=args.metrics_host or frontend.host,
        gpu_gauges=not args.no_gpu_gauges,
    )
    try:
        check_port_free(frontend.host, frontend.port)
    except OSError as err:
        sys.exit(
            f"cosystream serve: cannot serve on port {frontend.port}: {err.strerror or err} (--port picks another)"
        )
    if frontend.http is not None:
        try:
            check_port_free(frontend.http.host, frontend.http.port)
        except OSError as err:
            sys.exit(
                f"cosystream serve: cannot serve HTTP on port {frontend.http.port}: {err.strerror or err} "
                "(--http-port picks another, 0 turns it off)"
            )
    try:
        supervisor.serve_metrics()
    except OSError as err:
        sys.exit(
            f"cosystream serve: cannot serve metrics on port {args.metrics_port}: {err.strerror or err} "
            f"(on {supervisor.metrics_host}; --metrics-port picks another, 0 turns metrics off)"
        )
    try:
        return supervisor.run()
    except ServeError as err:
        sys.exit(f"cosystream serve: {err}")
