"""``cosystream serve``'s flags read into config objects: the models served, the decoders, security, the
frontends' settings. The readers raise ``ValueError`` (one line) for what cannot be served, before any
process starts (the ``parse_*`` flag types ``argparse.ArgumentTypeError``); a flag left out keeps its
config's default (:func:`given`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from cosystream.app.commands.common import given, log, second_pass_model


def default_frontends(cores: float | None = None) -> int:
    """The engine keeps one core busy; the frontends get the rest (at least one, at most eight).

    ``cores``: those this process may use (None: measured), its CPU affinity or, in a container, its cgroup
    CPU quota where that is less (``docker run --cpus 2``, a Kubernetes CPU limit), in whole cores (a part
    core starts no process of its own): the machine's count, which a container sees whole, would start a
    frontend per core of the node and oversubscribe the quota."""
    if cores is None:
        from cosystream.frontend.cpu import HostCpu, cgroup_quota

        cores = HostCpu(quota=cgroup_quota()).cores
    return max(1, min(8, math.floor(cores) - 1))


def parse_model_arg(value: str) -> tuple[str | None, str]:
    """``--model [NAME=]DIR`` -> (NAME or None, DIR); a DIR with "=" in it needs a NAME= before it."""
    name, sep, path = value.partition("=")
    if not sep or "/" in name:
        return None, value
    if not name:
        raise argparse.ArgumentTypeError(f"{value!r}: the name before '=' is empty")
    return name, path


def parse_precision_arg(value: str) -> tuple[str | None, str]:
    """``--precision [NAME=]DTYPE`` -> (NAME or None: every model, DTYPE)."""
    from cosystream.model_files import PRECISIONS

    name, sep, precision = value.rpartition("=")
    if sep and not name:
        raise argparse.ArgumentTypeError(f"{value!r}: the name before '=' is empty")
    if precision not in PRECISIONS:
        raise argparse.ArgumentTypeError(f"{value!r}: the precision is one of {', '.join(PRECISIONS)}")
    return (name if sep else None), precision


def parse_adaptive_arg(value: str) -> tuple[str, str]:
    """``--adaptive HEAVY=LIGHT`` -> (HEAVY, LIGHT)."""
    heavy, sep, light = value.partition("=")
    if not sep or not heavy or not light:
        raise argparse.ArgumentTypeError(f"{value!r}: give HEAVY=LIGHT, two served model names")
    return heavy, light


def parse_vocabulary_arg(value: str) -> tuple[str, str]:
    """``--vocabulary NAME=FILE`` -> (NAME, FILE)."""
    from cosystream.decoding.phrases import VOCABULARY_NAME

    name, sep, path = value.partition("=")
    if not sep or not path or not VOCABULARY_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give NAME=FILE, NAME of letters, digits, '_', '.' and '-' (at most 64)"
        )
    return name, path


def read_vocabularies(pairs: list[tuple[str, str]]) -> tuple:
    """The ``--vocabulary`` files, read and checked: ``((name, phrases), ...)`` (ValueError, one line, if not)."""
    from cosystream.decoding.phrases import PhraseError, read_vocabulary

    vocabularies: dict[str, tuple] = {}
    for name, path in pairs:
        if name in vocabularies:
            raise ValueError(f"--vocabulary {name}=...: given twice")
        try:
            vocabularies[name] = read_vocabulary(path)
        except PhraseError as err:
            raise ValueError(f"--vocabulary {name}={err}") from None
        log.info("vocabulary %s: %d phrases from %s", name, len(vocabularies[name]), path)
    return tuple(vocabularies.items())


def adaptive_config(args: argparse.Namespace):
    """``--adaptive`` and its marks, checked against the served models (ValueError, one line); None without."""
    from cosystream.engine.adaptive import AdaptiveConfig
    from cosystream.model_files import RESERVED_NAMES

    if not args.adaptive:
        if args.adaptive_high is not None or args.adaptive_low is not None:
            raise ValueError("--adaptive-high and --adaptive-low need --adaptive HEAVY=LIGHT")
        return None
    names = {source.name for source in args.models}
    default = args.models[0].name
    pairs = [tuple(default if n in RESERVED_NAMES else n for n in pair) for pair in args.adaptive]
    for heavy, light in pairs:
        for name in (heavy, light):
            if name not in names:
                raise ValueError(
                    f"--adaptive {heavy}={light}: no model {name!r} is served (served: {', '.join(sorted(names))})"
                )
    return AdaptiveConfig(tuple(pairs), **given(high=args.adaptive_high, low=args.adaptive_low))


def served_models(args: argparse.Namespace):
    """The ``--model`` flags as the served models, the first the default, at their ``--precision`` (ValueError,
    one line, if not)."""
    from cosystream.model_files import check_served_precision, embedded_model, model_sources

    entries = []
    for name, path in args.model:
        if path.startswith("embedded:"):
            path = embedded_model(path.removeprefix("embedded:"))  # (ValueError: no such embedded model)
        elif not os.path.isdir(path):
            raise ValueError(f"--model {path}: no such directory (a model directory: docs/MODELS.md)")
        entries.append((name, path))
    sources = model_sources(entries)
    given = dict(getattr(args, "precision", None) or [])
    unknown = sorted(name for name in given if name is not None and name not in {s.name for s in sources})
    if unknown:
        raise ValueError(f"--precision {unknown[0]}=...: no model of that name is served")
    device = getattr(args, "device", "auto").split(",")[0]  # (the kind is what counts: cuda:all, 0, ... are CUDA)
    resolved = []
    for source in sources:
        source = dataclasses.replace(source, precision=given.get(source.name, given.get(None, source.precision)))
        if device != "auto":  # (auto: the engine checks it, once it has picked its device)
            check_served_precision(source, "cuda" if device.isdigit() else device)
        resolved.append(source)
    return tuple(resolved)


def model_decoders(decoder, models) -> tuple:
    """``decoder`` resolved against each served model: ``((name, DecoderConfig), ...)``. A model it does not
    fit (a phoneme model without a language model, ...) is a ValueError naming the model."""
    resolved = []
    for model in models:
        try:
            resolved.append((model.name, decoder.resolve(model.path)))
        except ValueError as err:
            raise ValueError(f"model {model.name}: {err}" if len(models) > 1 else str(err)) from None
    return tuple(resolved)


def compile_budget(args: argparse.Namespace) -> dict:
    """The engine's compile budget from the flags: none given (use what is cached), or --compile's."""
    if args.compile_budget_s is not None and not (args.compile or args.compile_only):
        raise ValueError("--compile-budget-s goes with --compile")
    if args.compile_budget_s is not None and args.compile_budget_s < 0:
        raise ValueError("--compile-budget-s must be >= 0")
    if args.compile or args.compile_only:
        return {"compile_budget_s": args.compile_budget_s}  # None: every shape
    return {}


def security_config(args: argparse.Namespace):
    """The TLS config and tokens file the flags ask for, each checked now (``ValueError``, one line): a bad
    file is an error at start-up, not in every frontend."""
    from cosystream.server.auth import load_tokens
    from cosystream.server.tls import TlsConfig, load

    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca)
        load(tls)
    elif args.tls_client_ca:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    if args.auth_tokens:
        load_tokens(args.auth_tokens)
    return tls, args.auth_tokens


def frontend_config(args: argparse.Namespace, tls, auth_tokens, endpointing, decoder, decoders):
    """The frontends' config from the flags; ``ValueError`` from a config's own checks."""
    from cosystream.frontend.host import StreamOptions
    from cosystream.frontend.snapshot import read_key
    from cosystream.secondpass.worker import SecondPassConfig
    from cosystream.server.frontend import FrontendConfig
    from cosystream.server.http import MIB, HttpConfig

    return FrontendConfig(
        **given(
            host=args.host,
            port=args.port,
            drain_grace_s=args.drain_grace_s,
            keepalive_s=args.keepalive_s,
            keepalive_timeout_s=args.keepalive_timeout_s,
            min_client_ping_s=args.min_client_ping_s,
        ),
        tls=tls,
        auth_tokens=auth_tokens,
        admin=args.admin,
        http=None
        if not args.http_port
        else HttpConfig(
            **given(
                host=args.host,
                max_upload_bytes=None if args.max_upload_mb is None else int(args.max_upload_mb * MIB),
                idle_timeout_s=args.http_idle_timeout_s,
                allowed_origins=None if args.allowed_origins is None else tuple(args.allowed_origins.split(",")),
                allowed_hosts=None if args.allowed_hosts is None else tuple(args.allowed_hosts.split(",")),
                max_upload_audio_s=args.max_upload_audio_s,
                ws_idle_timeout_s=args.ws_idle_timeout_s,
                media_webhook=args.media_webhook,
            ),
            port=args.http_port,
        ),
        stream=StreamOptions(
            **given(idle_timeout_s=args.idle_timeout_s, realtime_burst_s=args.realtime_burst_s),
            **given(resume_window_s=args.resume_window_s),
            resume_key=read_key(args.resume_key_file) if args.resume_key_file else None,
            **given(admit_lag_s=None if args.admit_lag_ms is None else args.admit_lag_ms / 1000),
            **given(admit_late_s=None if args.admit_late_ms is None else args.admit_late_ms / 1000),
            **given(admit_cpu=args.admit_cpu),
            default_endpointing=endpointing,
            frontends=args.frontends,
            decoder=decoder,
            decoders=decoders,
            vocabularies=getattr(args, "vocabularies", ()),
            tracing=tracing_config(args),
            second_pass=None
            if (final_model := second_pass_model(args.final_model)) is None
            else SecondPassConfig(
                final_model,
                **given(
                    deadline_ms=args.final_deadline_ms,
                    max_batch=args.final_max_batch,
                    device=args.final_device,
                    early_ms=args.final_early_ms,
                    holds_next=args.final_holds_next,
                ),
            ),
        ),
    )


def tracing_config(args: argparse.Namespace):
    """``--otlp-endpoint`` and ``--trace-sample`` (None: tracing off); ValueError for bad values or a missing
    extra, said before any process starts."""
    from cosystream.frontend.tracing import TracingConfig, tracing_available

    if args.otlp_endpoint is None:
        if args.trace_sample is not None:
            raise ValueError("--trace-sample goes with --otlp-endpoint")
        return None
    config = TracingConfig(args.otlp_endpoint, **given(sample=args.trace_sample))
    if not tracing_available():
        raise ValueError("--otlp-endpoint needs the OpenTelemetry SDK: pip install 'cosystream[tracing]'")
    return config
