"""The ``cosystream`` command: ``serve`` and ``transcribe``.

Command-line flags and environment variables are read here and nowhere else; everything below receives
frozen config objects.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import socket
import sys
import tempfile
import time

from cosystream import __version__
from cosystream.engine.adaptive import ADAPTIVE_HIGH, ADAPTIVE_LOW
from cosystream.engine.scheduler import DEADLINE_S, MAX_SESSIONS, REALTIME_BATCH_WINDOW_S
from cosystream.logs import LEVELS as LOG_LEVELS
from cosystream.logs import configure as configure_logs
from cosystream.v1.client import HelpFormatter, add_connection_args, connection_from_args

log = logging.getLogger("cosystream")


def default_frontends() -> int:
    """The engine keeps one core busy; the frontends get the rest (at least one, at most eight)."""
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def add_decoder_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding")
    group.add_argument(
        "--decoder",
        choices=["auto", "greedy", "beam"],
        default="auto",
        help="auto: beam search when the model ships a language model (lm.arpa.gz) or --lm is given; greedy: "
        "the best token per frame (letter models; the default model's phonemes need beam search)",
    )
    group.add_argument("--lm", default=None, help="a word n-gram language model, ARPA (.arpa or .arpa.gz)")
    # Kept free of numpy (BeamConfig) for a quick start-up; a test holds these numbers to BeamConfig's.
    group.add_argument("--beam-size", type=int, default=None, help="hypotheses kept per frame (default 64)")
    group.add_argument("--lm-weight", type=float, default=None, help="language model weight (default 0.8)")
    group.add_argument("--word-bonus", type=float, default=None, help="score added per word, nats (default -0.5)")


def decoder_config(args: argparse.Namespace):
    """The decoder the arguments ask for, resolved against the model (ValueError if it cannot be had)."""
    return decoder_request(args).resolve(args.model)


def decoder_request(args: argparse.Namespace):
    """The decoder the arguments ask for, before it is resolved against a model (ValueError for bad flags)."""
    from cosystream.decoding.beam import BeamConfig
    from cosystream.decoding.config import DecoderConfig

    overrides = {
        name: value
        for name, value in (("beam_size", args.beam_size), ("alpha", args.lm_weight), ("beta", args.word_bonus))
        if value is not None
    }
    beam = dataclasses.replace(BeamConfig(), **overrides)
    if beam.beam_size < 1:
        raise ValueError("--beam-size must be >= 1")
    return DecoderConfig(args.decoder, args.lm, beam)


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
    from cosystream.models.loading import PRECISIONS

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
    from cosystream.models.loading import RESERVED_NAMES

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
    from cosystream.models.loading import check_precision, embedded_model, model_sources

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
    device = getattr(args, "device", "auto").split(",")[0].replace("cuda:all", "cuda")  # (the kind is what counts)
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = []
    for source in sources:
        precision = given.get(source.name, given.get(None, source.precision))
        try:
            check_precision(precision, device)
        except ValueError as err:
            raise ValueError(f"--precision {precision} (model {source.name}): {err}") from None
        resolved.append(dataclasses.replace(source, precision=precision))
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


def given(**flags):
    """The flags that were given (not None), as config keyword arguments: the rest keep the config's default."""
    return {name: value for name, value in flags.items() if value is not None}


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


def add_log_args(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help="default: $COSYSTREAM_LOG_LEVEL, else INFO for serve and WARNING for transcribe and eval (their "
        "output is their results)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=default,
        help="default: $COSYSTREAM_LOG_FORMAT, else text",
    )


def log_settings(args: argparse.Namespace) -> tuple[str, str]:
    """The log level and format: the flags, else the environment, else the command's default."""
    level = (
        args.log_level
        or os.environ.get("COSYSTREAM_LOG_LEVEL")
        or ("INFO" if args.command == "serve" else "WARNING")
    )
    fmt = args.log_format or os.environ.get("COSYSTREAM_LOG_FORMAT") or "text"
    if level.upper() not in LOG_LEVELS:
        sys.exit(f"cosystream: COSYSTREAM_LOG_LEVEL={level}: use one of {', '.join(LOG_LEVELS)}")
    if fmt not in ("text", "json"):
        sys.exit(f"cosystream: COSYSTREAM_LOG_FORMAT={fmt}: use text or json")
    return level.upper(), fmt


class _Parser(argparse.ArgumentParser):
    """Every command's parser (the subcommands' too: argparse makes them of the top parser's class) shows the
    flags' defaults in its help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cosystream", description="A real-time streaming speech engine.")
    parser.add_argument("--version", action="version", version=f"cosystream {__version__}")
    add_log_args(parser, default=None)
    # The same flags after the command name too (`cosystream transcribe FILE --log-level info`); given there,
    # they win over the ones before it.
    after_command = _Parser(add_help=False)
    add_log_args(after_command, default=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the server: the gRPC API, the HTTP APIs and captioning page, Prometheus metrics",
        parents=[after_command],
    )
    serve.add_argument("--host", default=None, help="address to listen on (default: every interface)")
    serve.add_argument("--port", type=int, default=None, help="gRPC port (default: 50051)")
    serve.add_argument(
        "--metrics-port", type=int, default=9090, help="Prometheus /metrics on --metrics-host; 0 disables"
    )
    serve.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="HTTP port: OpenAI-shaped transcriptions and Realtime WebSocket, the captioning page at /; 0 disables",
    )
    serve.add_argument(
        "--max-upload-mb",
        type=float,
        default=None,
        help="largest file POST /v1/audio/transcriptions takes (default: 25)",
    )
    serve.add_argument(
        "--http-idle-timeout-s",
        type=float,
        default=None,
        help="close an HTTP connection that sends no request for this long, before its first or kept alive "
        "(default: 30)",
    )
    serve.add_argument(
        "--allowed-origins",
        default=None,
        help="without --auth-tokens, browser pages of these origins (comma-separated, '*': any) may use the HTTP "
        "port besides its own (default: none)",
    )
    serve.add_argument(
        "--allowed-hosts",
        default=None,
        help="without --auth-tokens, Host names the HTTP port answers besides localhost, this machine's name, "
        "--host and IP addresses (comma-separated, '*': any; default: none)",
    )
    serve.add_argument(
        "--max-upload-audio-s",
        type=float,
        default=None,
        help="longest audio POST /v1/audio/transcriptions takes, by the file's header, refused before decoding "
        "(default: 3600)",
    )
    serve.add_argument(
        "--ws-idle-timeout-s",
        type=float,
        default=None,
        help="a Realtime WebSocket that sends no event for this long gets an error event, then is closed (default: 60)",
    )
    serve.add_argument(
        "--media-webhook",
        default=None,
        metavar="URL",
        help="also POST every message of the telephony WebSockets (/v1/media-streams/twilio, /audio-fork: "
        "transcripts, DTMF, the end) as JSON to this URL",
    )
    serve.add_argument(
        "--metrics-host",
        default=None,
        help="address for /metrics (default: the --host value, so a loopback server keeps its metrics local)",
    )
    serve.add_argument(
        "--no-gpu-gauges",
        action="store_true",
        help="leave the GPU gauges (cosystream_gpu_*, read through NVML at each scrape) out of /metrics; "
        "without this they are there wherever NVML sees a GPU, whatever --device says",
    )
    serve.add_argument(
        "--device",
        default="auto",
        help="auto | cpu | cuda | cuda:N, or one engine per GPU: cuda:all or a list, cuda:0,cuda:1",
    )
    serve.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engine processes on --device (each with its own slots: --max-sessions is per engine); new "
        "sessions go to the least-loaded one, and one that fails ends only its own sessions",
    )
    serve.add_argument(
        "--max-sessions",
        type=int,
        default=MAX_SESSIONS,
        help="engine slots: the streams one engine serves at once (one more gets RESOURCE_EXHAUSTED); its state "
        "memory is allocated at start-up",
    )
    serve.add_argument("--max-batch", type=int, default=None, help="rows per model step (default: max-sessions)")
    serve.add_argument(
        "--admit-load",
        type=float,
        default=None,
        help="refuse a new REALTIME session (RESOURCE_EXHAUSTED with a retry delay) when one more would take the "
        "engine's projected realtime load past this (its busy share; default 0.9; 0: off, only "
        "--max-sessions limits); BATCH sessions are slowed instead (docs/DEPLOY.md, 'Overload')",
    )
    serve.add_argument(
        "--admit-lag-ms",
        type=float,
        default=None,
        help="a frontend whose event loop runs this late (the median over 2 s) refuses new REALTIME sessions "
        "(RESOURCE_EXHAUSTED with a retry delay); GetServerInfo reports the lag either way (default 0: off)",
    )
    serve.add_argument(
        "--overload-window-s",
        type=float,
        default=None,
        help="the load over --admit-load this long makes the engine overloaded (health service 'load' "
        "NOT_SERVING), and under it this long, no longer (default 5)",
    )
    serve.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send per-utterance traces (OpenTelemetry spans: receive, vad, queue, step, decode, send) over "
        "OTLP/HTTP to this URL, e.g. http://collector:4318/v1/traces (needs the tracing extra; default: off)",
    )
    serve.add_argument(
        "--trace-sample",
        type=float,
        default=None,
        help="the share of utterances traced with --otlp-endpoint (a client's sampled traceparent is always "
        "followed; default 0.01)",
    )
    serve.add_argument(
        "--model",
        action="append",
        type=parse_model_arg,
        default=[],
        metavar="[NAME=]DIR",
        help="a model directory to serve, named NAME (default: the name in its config.json); repeat it to "
        "serve several, the first being the default (default: the embedded English model). "
        "embedded:default and embedded:light are the models that come with cosystream",
    )
    serve.add_argument(
        "--precision",
        action="append",
        type=parse_precision_arg,
        default=[],
        metavar="[NAME=]DTYPE",
        help="serve model NAME (no NAME: every model) at DTYPE: float32 (the default), bfloat16, float16 (CUDA "
        "only) or int8 (CPU only, dynamic quantization); see docs/MODELS.md for what each costs in accuracy",
    )
    serve.add_argument(
        "--vocabulary",
        action="append",
        type=parse_vocabulary_arg,
        default=[],
        metavar="NAME=FILE",
        help="a named vocabulary: FILE's phrases (one per line, optionally a tab and its boost; up to 100000) "
        "boosted for the streams that ask for NAME (StreamingConfig.vocabulary), built once per model; "
        "repeatable (docs/MODELS.md, 'Phrase boosting')",
    )
    serve.add_argument(
        "--adaptive",
        action="append",
        type=parse_adaptive_arg,
        default=[],
        metavar="HEAVY=LIGHT",
        help="under load, run new utterances of sessions that asked for model HEAVY on model LIGHT (both "
        "served), and return them once the load has fallen (docs/MODELS.md)",
    )
    serve.add_argument(
        "--adaptive-high",
        type=float,
        default=None,
        help=f"the engine's projected load (busy share) at which --adaptive falls back to LIGHT (default: "
        f"{ADAPTIVE_HIGH})",
    )
    serve.add_argument(
        "--adaptive-low",
        type=float,
        default=None,
        help=f"the projected load at or below which --adaptive returns to HEAVY (default: {ADAPTIVE_LOW})",
    )
    serve.add_argument(
        "--frontends",
        type=int,
        default=None,
        help="frontend processes sharing the ports (gRPC, HTTP, decoding, VAD) (default: the cores less one, "
        f"1 to 8: {default_frontends()} here)",
    )
    serve.add_argument("--no-cuda-graphs", action="store_true", help="run the model eagerly on CUDA")
    compiling = serve.add_mutually_exclusive_group()
    compiling.add_argument(
        "--compile",
        action="store_true",
        help="CPU: compile the model step's shapes not yet in the cache before serving (10-20 s each, once per "
        "machine; without it only cached ones run compiled, the rest eager)",
    )
    compiling.add_argument(
        "--no-compile", action="store_true", help="CPU: run the model step eagerly, not even from the cache"
    )
    compiling.add_argument(
        "--compile-only",
        action="store_true",
        help="compile every shape --compile would into the cache, then exit (for an image or an init step)",
    )
    serve.add_argument(
        "--compile-budget-s",
        type=float,
        default=None,
        help="with --compile: seconds to spend compiling at start-up (default: until every shape is compiled)",
    )
    serve.add_argument(
        "--compile-cache-dir",
        default=None,
        help="compiled steps (default: $COSYSTREAM_COMPILE_CACHE, else $XDG_CACHE_HOME/cosystream/compiled-steps)",
    )
    serve.add_argument(
        "--batch-window-ms",
        type=float,
        default=REALTIME_BATCH_WINDOW_S * 1000,
        help="how long a realtime frame may wait to share a step",
    )
    serve.add_argument(
        "--deadline-ms",
        type=float,
        default=DEADLINE_S * 1000,
        help="a realtime frame waiting longer is a deadline miss",
    )
    serve.add_argument(
        "--batch-duty",
        type=float,
        default=None,
        help="most of the engine's time BATCH work may use (default: 0.5 on CPU, where frontends share the cores; 1 on CUDA)",
    )
    # Flags whose default is None take their config's default, stated there once.
    serve.add_argument(
        "--idle-timeout-s",
        type=float,
        default=None,
        help="a stream with no request for this long gets the final for what was heard, then DEADLINE_EXCEEDED "
        "(default: 30)",
    )
    serve.add_argument(
        "--resume-window-s",
        type=float,
        default=None,
        help="how long a resumable session (StreamingConfig.resumable) whose connection dropped keeps its slot "
        "and state for its client to resume it (default: 30)",
    )
    serve.add_argument(
        "--resume-key-file",
        metavar="FILE",
        help="a key shared by the replicas (32 bytes or more): at a drain, each resumable session is handed over "
        "at its next utterance boundary as a signed snapshot another replica with the same key and model "
        "version goes on from (docs/RELIABILITY.md)",
    )
    serve.add_argument(
        "--realtime-burst-s",
        type=float,
        default=None,
        help="speech a REALTIME stream may send ahead of real time; past it its requests are read at real time "
        "(backpressure, nothing dropped; default: 2; inf: unpaced)",
    )
    serve.add_argument(
        "--final-model",
        default=None,
        help="finals from a second pass that re-reads each utterance (interims stay the streaming model's): "
        "embedded:whisper-tiny-en (the whisper extra, which make serve installs), a CTranslate2 Whisper "
        "directory, or off (default: embedded:whisper-tiny-en when the whisper extra is installed, else off)",
    )
    serve.add_argument(
        "--final-deadline-ms",
        type=int,
        default=None,
        help="an utterance's final waits at most this long for the second pass, then the streaming text is sent "
        "(default: 3000)",
    )
    serve.add_argument(
        "--final-max-batch",
        type=int,
        default=None,
        help="utterances of similar length that end together are read by the second pass in one call, up to "
        "this many (default: 8)",
    )
    serve.add_argument(
        "--final-device",
        choices=("auto", "cpu", "cuda"),
        default=None,
        help="where the second pass runs; auto: a CUDA device when CTranslate2 finds one and loads there "
        "(default: auto)",
    )
    serve.add_argument(
        "--drain-grace-s",
        type=float,
        default=None,
        help="on SIGTERM, open streams are served this long before they are cut (their final, then "
        "UNAVAILABLE); the default 20 s, with up to 6 s more to stop, fits Kubernetes' default 30 s grace period",
    )
    serve.add_argument(
        "--keepalive-s",
        type=float,
        default=None,
        help="HTTP/2 keepalive: ping every client connection this often (default: 30)",
    )
    serve.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=None,
        help="close a connection whose peer does not answer a ping within this (its streams end, their slots are "
        "freed) (default: 10)",
    )
    serve.add_argument(
        "--min-client-ping-s",
        type=float,
        default=None,
        help="the shortest interval a client may ping at; more often gets GOAWAY too_many_pings (default: 10)",
    )
    serve.add_argument(
        "--max-failures",
        type=int,
        default=None,
        help="the engine or a frontend dying this many times within --restart-window-s ends serve (exit 1) "
        "(default: 5)",
    )
    serve.add_argument(
        "--restart-window-s",
        type=float,
        default=None,
        help="the window --max-failures counts in; a process is restarted with backoff (default: 60)",
    )
    serve.add_argument(
        "--silence-ms",
        type=int,
        default=None,
        help="the pause that ends an utterance, for streams that do not set endpointing.silence_ms (default: 500)",
    )
    serve.add_argument(
        "--max-utterance-ms",
        type=int,
        default=None,
        help="an utterance this long is ended (its final sent) and the next begins, for streams that do not "
        "set endpointing.max_utterance_ms (default: 15000)",
    )
    serve.add_argument(
        "--naive",
        action="store_true",
        help="baseline for benchmarks: one process, a model call per chunk, no batching",
    )
    security = serve.add_argument_group("security (docs/SECURITY.md)")
    security.add_argument(
        "--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (re-read on change)"
    )
    security.add_argument("--tls-key", metavar="PEM", help="the certificate's private key (unencrypted PEM)")
    security.add_argument(
        "--tls-client-ca", metavar="PEM", help="require client certificates signed by these CAs (mTLS)"
    )
    security.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="require a token on every call but health: lines of 'NAME TOKEN|sha256:HEX [max_sessions=N] "
        "[priorities=REALTIME,BATCH] [admin]'; re-read on SIGHUP and on change",
    )
    security.add_argument(
        "--admin",
        action="store_true",
        help="without --auth-tokens: serve the Admin service (model loads) to anyone who reaches the port "
        "(default: off; with --auth-tokens it is on, for admin tokens only)",
    )
    add_decoder_args(serve)

    transcribe = commands.add_parser(
        "transcribe", help="transcribe an audio file (WAV, FLAC, OGG or MP3)", parents=[after_command]
    )
    transcribe.add_argument("file")
    transcribe.add_argument("--server", default=None, help="host:port of a running server (default: in-process)")
    transcribe.add_argument("--realtime", action="store_true", help="pace the audio at real time (REALTIME)")
    transcribe.add_argument("--interim", action="store_true", help="print interim results too")
    transcribe.add_argument("--words", action="store_true", help="print word time offsets")
    transcribe.add_argument(
        "--final-model",
        default=None,
        help="in-process: finals from this second pass, as serve --final-model (default: embedded:whisper-tiny-en "
        "when the whisper extra is installed, else off)",
    )
    add_connection_args(transcribe)

    admin = commands.add_parser(
        "admin", help="operator calls to a running server (models)", parents=[after_command]
    )
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
        call.add_argument(
            "--server", default="localhost", help="host:port of the server (default: localhost:50051)"
        )
        call.add_argument(
            "--timeout", type=float, default=600.0, help="seconds to wait for the call (default: 600)"
        )
        add_connection_args(call)

    evaluate = commands.add_parser(
        "eval", help="WER, CER and real-time factor on a test set", parents=[after_command]
    )
    evaluate.add_argument("test_set", help="a directory of NAME.wav + NAME.txt, or a JSONL manifest")
    evaluate.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    evaluate.add_argument("--telephone", action="store_true", help="through an 8 kHz mu-law round trip first")
    evaluate.add_argument(
        "--tilt",
        type=float,
        default=0.0,
        metavar="DB",
        help="through a spectral tilt of DB dB per octave around 1 kHz first (a bright or muffled microphone)",
    )
    evaluate.add_argument("--json", default=None, help="write the scores and every hypothesis here")
    evaluate.add_argument("--show", type=int, default=5, help="print this many reference/hypothesis pairs")
    evaluate.add_argument(
        "--precision",
        default="float32",
        choices=("float32", "bfloat16", "int8"),
        help="run the model at this precision on the CPU (see serve --precision)",
    )
    evaluate.add_argument(
        "--final-model",
        default=None,
        help="finals from this second pass too, as serve --final-model (embedded:whisper-tiny-en or a "
        "CTranslate2 Whisper directory): WER/CER of the finals beside the streaming model's alone; off (the "
        "default): the streaming model's alone",
    )
    add_decoder_args(evaluate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_level, args.log_format = log_settings(args)
    configure_logs(args.log_level, args.log_format)
    if args.command == "serve":
        return serve(args)
    if args.command == "admin":
        return admin_command(args)
    if args.command == "eval":
        from cosystream.app.evaluate import eval_command

        try:
            decoder = decoder_config(args)
        except (OSError, EOFError, ValueError) as err:
            sys.exit(f"cosystream eval: {err}")
        return eval_command(
            args.model,
            args.test_set,
            decoder,
            args.telephone,
            args.tilt,
            args.json,
            args.show,
            args.precision,
            None if args.final_model == "off" else args.final_model,
        )
    from cosystream.app.transcribe import transcribe_command

    try:
        connection = connection_from_args(args)
    except ValueError as err:
        sys.exit(f"cosystream transcribe: {err}")
    flags = (args.tls, args.ca_cert, args.client_cert, args.client_key, args.token)
    if args.server is None and any(flag for flag in flags):  # ($COSYSTREAM_TOKEN alone is fine in-process)
        sys.exit("cosystream transcribe: --tls, --ca-cert, --client-cert, --client-key and --token need --server")
    if args.server is not None and args.final_model is not None:
        sys.exit("cosystream transcribe: --final-model is for the in-process server: a server has its own")
    try:
        final_model = None if args.server is not None else second_pass_model(args.final_model)
    except ValueError as err:
        sys.exit(f"cosystream transcribe: {err}")
    return transcribe_command(
        args.file, args.server, args.realtime, args.interim, args.words, connection, final_model
    )


def admin_command(args: argparse.Namespace) -> int:
    """``cosystream admin load|unload``: one Admin call; what it did printed, or the reason and 1."""
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
    return "\n".join(lines)


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


def serve(args: argparse.Namespace) -> int:
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


def frontend_config(args: argparse.Namespace, tls, auth_tokens, endpointing, decoder, decoders):
    """The frontends' config from the flags; ``ValueError`` from a config's own checks."""
    from cosystream.frontend.host import StreamOptions
    from cosystream.frontend.snapshot import read_key
    from cosystream.secondpass.worker import SecondPassConfig
    from cosystream.server.frontend import FrontendConfig
    from cosystream.server.http import HttpConfig

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
                max_upload_bytes=None if args.max_upload_mb is None else int(args.max_upload_mb * 1e6),
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
                    deadline_ms=args.final_deadline_ms, max_batch=args.final_max_batch, device=args.final_device
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


def second_pass_model(flag: str | None) -> str | None:
    """``--final-model`` -> the second pass's model, or None for none: ``off``; not given, the packaged Whisper
    when the whisper extra is installed (said in the log either way)."""
    from cosystream.secondpass.whisper import EMBEDDED_WHISPER, packaged_model_installed

    if flag is not None:
        return None if flag == "off" else flag
    if packaged_model_installed():
        return EMBEDDED_WHISPER
    log.info(
        "second pass off: finals come from the streaming model (pip install 'cosystream[whisper]' turns it on)"
    )
    return None


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
    from cosystream.engine.core import EngineConfig
    from cosystream.engine.process import EngineProcessConfig, resolve_devices
    from cosystream.runtime.runner import GraphMode

    try:
        devices = resolve_devices(args.device, args.engines)  # --device cuda without CUDA: said now
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


if __name__ == "__main__":
    sys.exit(main())
