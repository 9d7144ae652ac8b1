"""``cosystream serve``'s flags, a function per concern, in the order ``serve --help`` lists them.

A flag whose default is None takes its config's default, stated there once; where the config is cheap to
import (no torch, no grpc server), its help reads the number from it, and tests/test_help.py holds the rest
to their configs.
"""

from __future__ import annotations

import argparse
import dataclasses

from cosystream.app.commands.common import add_decoder_args
from cosystream.app.commands.serve_config import (
    default_frontends,
    parse_adaptive_arg,
    parse_model_arg,
    parse_precision_arg,
    parse_vocabulary_arg,
)
from cosystream.audio.endpointing import EndpointingConfig
from cosystream.engine.adaptive import ADAPTIVE_HIGH, ADAPTIVE_LOW
from cosystream.engine.headroom import ADMIT_LOAD, OVERLOAD_WINDOW_S
from cosystream.engine.scheduler import DEADLINE_S, MAX_SESSIONS, REALTIME_BATCH_WINDOW_S
from cosystream.frontend.tracing import TRACE_SAMPLE
from cosystream.secondpass.worker import SecondPassConfig
from cosystream.server.http import DEFAULT_HTTP_PORT, MIB, HttpConfig
from cosystream.v1.client import DEFAULT_PORT


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``serve``."""
    for section in (
        _listening,
        _engine,
        _tracing,
        _models,
        _steps,
        _streams,
        _second_pass,
        _lifecycle,
        _endpointing,
        _security,
        add_decoder_args,
    ):
        section(parser)


def _listening(parser: argparse.ArgumentParser) -> None:
    """Where it listens: the gRPC port, the HTTP port and its limits, /metrics."""
    http = HttpConfig()
    parser.add_argument("--host", default=None, help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, default=None, help=f"gRPC port (default: {DEFAULT_PORT})")
    parser.add_argument(
        "--metrics-port", type=int, default=9090, help="Prometheus /metrics on --metrics-host; 0 disables"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="HTTP port: OpenAI-shaped transcriptions and Realtime WebSocket, the captioning page at /; 0 disables",
    )
    parser.add_argument(
        "--max-upload-mb",
        type=float,
        default=None,
        help=f"largest file POST /v1/audio/transcriptions takes, MiB (default: {http.max_upload_bytes / MIB:g})",
    )
    parser.add_argument(
        "--http-idle-timeout-s",
        type=float,
        default=None,
        help="close an HTTP connection that sends no request for this long, before its first or kept alive "
        f"(default: {http.idle_timeout_s:g})",
    )
    parser.add_argument(
        "--allowed-origins",
        default=None,
        help="without --auth-tokens, browser pages of these origins (comma-separated, '*': any) may use the HTTP "
        "port besides its own (default: none)",
    )
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        help="without --auth-tokens, Host names the HTTP port answers besides localhost, this machine's name, "
        "--host and IP addresses (comma-separated, '*': any; default: none)",
    )
    parser.add_argument(
        "--max-upload-audio-s",
        type=float,
        default=None,
        help="longest audio POST /v1/audio/transcriptions takes, by the file's header, refused before decoding "
        f"(default: {http.max_upload_audio_s:g})",
    )
    parser.add_argument(
        "--ws-idle-timeout-s",
        type=float,
        default=None,
        help="a Realtime WebSocket that sends no event for this long gets an error event, then is closed "
        f"(default: {http.ws_idle_timeout_s:g})",
    )
    parser.add_argument(
        "--media-webhook",
        default=None,
        metavar="URL",
        help="also POST every message of the telephony WebSockets (/v1/media-streams/twilio, /audio-fork: "
        "transcripts, DTMF, the end) as JSON to this URL",
    )
    parser.add_argument(
        "--metrics-host",
        default=None,
        help="address for /metrics (default: the --host value, so a loopback server keeps its metrics local)",
    )
    parser.add_argument(
        "--no-gpu-gauges",
        action="store_true",
        help="leave the GPU gauges (cosystream_gpu_*, read through NVML at each scrape) out of /metrics; "
        "without this they are there wherever NVML sees a GPU, whatever --device says",
    )


def _engine(parser: argparse.ArgumentParser) -> None:
    """The engine processes: their device, slots and batches, and the admission of new sessions."""
    parser.add_argument(
        "--device",
        default="auto",
        help="auto | cpu | cuda | cuda:N, or one engine per GPU: cuda:all or a list, cuda:0,cuda:1",
    )
    parser.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engine processes on --device (each with its own slots: --max-sessions is per engine); new "
        "sessions go to the least-loaded one, and one that fails ends only its own sessions",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=MAX_SESSIONS,
        help="engine slots: the streams one engine serves at once (one more gets RESOURCE_EXHAUSTED); its state "
        "memory is allocated at start-up",
    )
    parser.add_argument("--max-batch", type=int, default=None, help="rows per model step (default: max-sessions)")
    parser.add_argument(
        "--admit-load",
        type=float,
        default=None,
        help="refuse a new REALTIME session (RESOURCE_EXHAUSTED with a retry delay) when one more would take the "
        f"engine's projected realtime load past this (its busy share; default {ADMIT_LOAD:g}; 0: off, only "
        "--max-sessions limits); BATCH sessions are slowed instead (docs/DEPLOY.md, 'Overload')",
    )
    parser.add_argument(
        "--admit-lag-ms",
        type=float,
        default=None,
        help="a frontend whose event loop runs this late (the median over 2 s) refuses new REALTIME sessions "
        "(RESOURCE_EXHAUSTED with a retry delay); GetServerInfo reports the lag either way (default 0: off)",
    )
    parser.add_argument(
        "--admit-late-ms",
        type=float,
        default=None,
        help="a frontend that reads its REALTIME streams' audio this far behind real time (the median over "
        "them) refuses new REALTIME sessions (RESOURCE_EXHAUSTED with a retry delay); GetServerInfo reports "
        "the lateness either way (default 0: off)",
    )
    parser.add_argument(
        "--admit-cpu",
        type=float,
        default=None,
        help="a frontend refuses new REALTIME sessions (RESOURCE_EXHAUSTED with a retry delay) when one more, "
        "priced at its measured CPU per realtime session, would take the CPUs it runs on past this share of "
        "their cores (every process's use over 2 s, BATCH's share left out; in a container with a CPU quota, "
        "the container's), and reads its BATCH streams no faster than real time while they are past it; "
        "GetServerInfo reports the CPU either way (default 0: off)",
    )
    parser.add_argument(
        "--overload-window-s",
        type=float,
        default=None,
        help="the load over --admit-load this long makes the engine overloaded (health service 'load' "
        f"NOT_SERVING), and under it this long, no longer (default {OVERLOAD_WINDOW_S:g})",
    )


def _tracing(parser: argparse.ArgumentParser) -> None:
    """Per-utterance traces."""
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send per-utterance traces (OpenTelemetry spans: receive, vad, queue, step, decode, send) over "
        "OTLP/HTTP to this URL, e.g. http://collector:4318/v1/traces (needs the tracing extra; default: off)",
    )
    parser.add_argument(
        "--trace-sample",
        type=float,
        default=None,
        help="the share of utterances traced with --otlp-endpoint (a client's sampled traceparent is always "
        f"followed; default {TRACE_SAMPLE:g})",
    )


def _models(parser: argparse.ArgumentParser) -> None:
    """The models served, their precision, named vocabularies and the fall-back under load."""
    parser.add_argument(
        "--model",
        action="append",
        type=parse_model_arg,
        default=[],
        metavar="[NAME=]DIR",
        help="a model directory to serve, named NAME (default: the name in its config.json); repeat it to "
        "serve several, the first being the default (default: the embedded English model). "
        "embedded:default and embedded:light are the models that come with cosystream",
    )
    parser.add_argument(
        "--precision",
        action="append",
        type=parse_precision_arg,
        default=[],
        metavar="[NAME=]DTYPE",
        help="serve model NAME (no NAME: every model) at DTYPE: float32 (the default), bfloat16, float16 (CUDA "
        "only) or int8 (CPU only, dynamic quantization); see docs/MODELS.md for what each costs in accuracy",
    )
    parser.add_argument(
        "--vocabulary",
        action="append",
        type=parse_vocabulary_arg,
        default=[],
        metavar="NAME=FILE",
        help="a named vocabulary: FILE's phrases (one per line, optionally a tab and its boost; up to 100000) "
        "boosted for the streams that ask for NAME (StreamingConfig.vocabulary), built once per model; "
        "repeatable (docs/MODELS.md, 'Phrase boosting')",
    )
    parser.add_argument(
        "--adaptive",
        action="append",
        type=parse_adaptive_arg,
        default=[],
        metavar="HEAVY=LIGHT",
        help="under load, run new utterances of sessions that asked for model HEAVY on model LIGHT (both "
        "served), and return them once the load has fallen (docs/MODELS.md)",
    )
    parser.add_argument(
        "--adaptive-high",
        type=float,
        default=None,
        help=f"the engine's projected load (busy share) at which --adaptive falls back to LIGHT (default: "
        f"{ADAPTIVE_HIGH})",
    )
    parser.add_argument(
        "--adaptive-low",
        type=float,
        default=None,
        help=f"the projected load at or below which --adaptive returns to HEAVY (default: {ADAPTIVE_LOW})",
    )


def _steps(parser: argparse.ArgumentParser) -> None:
    """The frontend processes, and how the engine runs and times its model steps."""
    parser.add_argument(
        "--frontends",
        type=int,
        default=None,
        help="frontend processes sharing the ports (gRPC, HTTP, decoding, VAD) (default: the cores this "
        f"process may use, or its container's CPU quota, less one, 1 to 8: {default_frontends()} here)",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the model eagerly on CUDA")
    compiling = parser.add_mutually_exclusive_group()
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
    parser.add_argument(
        "--no-background-compile",
        action="store_true",
        help="CPU: leave the shapes missing from the compile cache eager (by default a process of idle priority "
        "compiles them while serving, and each is swapped in once it is checked)",
    )
    parser.add_argument(
        "--compile-budget-s",
        type=float,
        default=None,
        help="with --compile: seconds to spend compiling at start-up (default: until every shape is compiled)",
    )
    parser.add_argument(
        "--compile-cache-dir",
        default=None,
        help="compiled steps (default: $COSYSTREAM_COMPILE_CACHE, else $XDG_CACHE_HOME/cosystream/compiled-steps)",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=REALTIME_BATCH_WINDOW_S * 1000,
        help="how long a realtime frame may wait to share a step",
    )
    parser.add_argument(
        "--deadline-ms",
        type=float,
        default=DEADLINE_S * 1000,
        help="a realtime frame waiting longer is a deadline miss",
    )
    parser.add_argument(
        "--batch-duty",
        type=float,
        default=None,
        help="most of the engine's time BATCH work may use, less the share its realtime load took lately, down to a 10%% floor (default: 0.5 on CPU, where frontends share the cores; 1 on CUDA)",
    )


def _streams(parser: argparse.ArgumentParser) -> None:
    """A stream's idle timeout, resumption and pacing."""
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=None,
        help="a stream with no request for this long gets the final for what was heard, then DEADLINE_EXCEEDED "
        "(default: 30)",
    )
    parser.add_argument(
        "--resume-window-s",
        type=float,
        default=None,
        help="how long a resumable session (StreamingConfig.resumable) whose connection dropped keeps its slot "
        "and state for its client to resume it (default: 30)",
    )
    parser.add_argument(
        "--resume-key-file",
        metavar="FILE",
        help="a key shared by the replicas (32 bytes or more): at a drain, each resumable session is handed over "
        "at its next utterance boundary as a signed snapshot another replica with the same key and model "
        "version goes on from (docs/RELIABILITY.md)",
    )
    parser.add_argument(
        "--realtime-burst-s",
        type=float,
        default=None,
        help="speech a REALTIME stream may send ahead of real time; past it its requests are read at real time "
        "(backpressure, nothing dropped; default: 2; inf: unpaced)",
    )


def _second_pass(parser: argparse.ArgumentParser) -> None:
    """The second pass that re-reads each utterance for its final."""
    defaults = {field.name: field.default for field in dataclasses.fields(SecondPassConfig)}  # (model: none)
    parser.add_argument(
        "--final-model",
        default=None,
        help="finals from a second pass that re-reads each utterance (interims stay the streaming model's): "
        "embedded:whisper-tiny-en (the whisper extra, which make serve installs), embedded:whisper-base (the "
        "whisper-base extra: twice the CPU, fewer errors on wideband speech), a CTranslate2 Whisper directory, "
        "or off (default: embedded:whisper-tiny-en when the whisper extra is installed, else off)",
    )
    parser.add_argument(
        "--final-deadline-ms",
        type=int,
        default=None,
        help="an utterance's final waits at most this long for the second pass, then the streaming text is sent "
        f"(default: {defaults['deadline_ms']})",
    )
    parser.add_argument(
        "--final-max-batch",
        type=int,
        default=None,
        help="utterances of similar length that end together are read by the second pass in one call, up to "
        f"this many (default: {defaults['max_batch']})",
    )
    parser.add_argument(
        "--final-early-ms",
        type=int,
        default=None,
        help="an utterance whose speech is followed by this much silence is read while the endpoint's silence "
        "runs, when the second pass has nothing else to do, so that its final is ready at the endpoint; more "
        "speech drops the read (0: read only at the end; default: "
        f"{defaults['early_ms']})",
    )
    parser.add_argument(
        "--final-holds-next",
        action="store_true",
        default=None,
        help="on a REALTIME stream, a final waiting for the second pass holds back the next utterance's interims, "
        "up to its deadline (default: it is sent with the streaming text as soon as the next utterance has an "
        "interim to show, so interims never wait for the second pass; BATCH streams' finals always wait)",
    )
    parser.add_argument(
        "--final-device",
        choices=("auto", "cpu", "cuda"),
        default=None,
        help="where the second pass runs; auto: a CUDA device when CTranslate2 finds one and loads there "
        f"(default: {defaults['device']})",
    )


def _lifecycle(parser: argparse.ArgumentParser) -> None:
    """The drain at SIGTERM, HTTP/2 keepalive, and the restarts of failed processes."""
    parser.add_argument(
        "--drain-grace-s",
        type=float,
        default=None,
        help="on SIGTERM, open streams are served this long before they are cut (their final, then "
        "UNAVAILABLE); the default 20 s, with up to 6 s more to stop, fits Kubernetes' default 30 s grace period",
    )
    parser.add_argument(
        "--keepalive-s",
        type=float,
        default=None,
        help="HTTP/2 keepalive: ping every client connection this often (default: 30)",
    )
    parser.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=None,
        help="close a connection whose peer does not answer a ping within this (its streams end, their slots are "
        "freed) (default: 10)",
    )
    parser.add_argument(
        "--min-client-ping-s",
        type=float,
        default=None,
        help="the shortest interval a client may ping at; more often gets GOAWAY too_many_pings (default: 10)",
    )
    parser.add_argument(
        "--max-failures",
        type=int,
        default=None,
        help="the engine or a frontend dying this many times within --restart-window-s ends serve (exit 1) "
        "(default: 5)",
    )
    parser.add_argument(
        "--restart-window-s",
        type=float,
        default=None,
        help="the window --max-failures counts in; a process is restarted with backoff (default: 60)",
    )


def _endpointing(parser: argparse.ArgumentParser) -> None:
    """Where utterances end, and the benchmarks' unbatched baseline."""
    endpointing = EndpointingConfig()
    parser.add_argument(
        "--silence-ms",
        type=int,
        default=None,
        help="the pause that ends an utterance, for streams that do not set endpointing.silence_ms "
        f"(default: {endpointing.silence_ms})",
    )
    parser.add_argument(
        "--max-utterance-ms",
        type=int,
        default=None,
        help="an utterance this long is ended (its final sent) and the next begins, for streams that do not "
        f"set endpointing.max_utterance_ms (default: {endpointing.max_utterance_ms})",
    )
    parser.add_argument(
        "--naive",
        action="store_true",
        help="baseline for benchmarks: one process, a model call per chunk, no batching",
    )


def _security(parser: argparse.ArgumentParser) -> None:
    """TLS, tokens and the Admin service (docs/SECURITY.md)."""
    security = parser.add_argument_group("security (docs/SECURITY.md)")
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
