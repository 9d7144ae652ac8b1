"""Helpers for clients of the wire API (hand-written; the rest of ``cosystream.v1`` is generated).

``server_address``: ``host`` -> ``host:50051``. ``Connection``: plaintext or TLS, a client certificate, a
token, as one object that makes the channel; ``add_connection_args`` / ``connection_from_args``: the same
flags in every client (``--tls``, ``--ca-cert``, ``--token`` or ``COSYSTREAM_TOKEN``, ...);
``describe_error``: a failed call as one line that says what to do about TLS and token refusals.
``HelpFormatter``: every command's ``--help`` shows each flag's default.
``read_wav``: the WAV files a client may stream (PCM, float, mu-law, A-law), with errors that say what is
accepted. ``encode_mulaw``: samples as G.711 mu-law. ``StreamStatus``: the status a stream really ended with.

grpcio's asyncio client can replace the server's status with INTERNAL "Internal error from Core" when the
server ends a stream while the client is still writing (grpc/grpc#36066): a refusal (RESOURCE_EXHAUSTED), a
drain (UNAVAILABLE) or a bad request (INVALID_ARGUMENT) would then read as a crash. The server also sends
the status as its last response (``StreamingRecognizeResponse.error``); :class:`StreamStatus` keeps it and
puts it back.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from google.rpc import error_details_pb2, status_pb2

from cosystream.v1 import cosystream_pb2 as pb

_CODES = {code.value[0]: code for code in grpc.StatusCode}

DEFAULT_PORT = 50051
"""``cosystream serve``'s port; gRPC itself would take 443 for a name without one."""
DEFAULT_SERVER = f"localhost:{DEFAULT_PORT}"
"""The server a client calls when it is given none: ``cosystream serve`` on this machine."""


def server_address(text: str, default_port: int = DEFAULT_PORT) -> str:
    """``host[:port]``, ``[v6]:port`` or a gRPC target (``unix:...``, ``dns:...``) with the port defaulted."""
    if text.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return text
    if text.startswith("["):
        return text if "]:" in text else f"{text}:{default_port}"
    host, colon, port = text.rpartition(":")
    if colon and port.isdigit() and ":" not in host:
        return text
    if text.count(":") > 1:  # a bare IPv6 address
        return f"[{text}]:{default_port}"
    return f"{text}:{default_port}"


TOKEN_ENV = "COSYSTREAM_TOKEN"
"""Where clients read a token when ``--token`` is not given (a flag shows in ``ps``; the environment does
not)."""


@dataclass(frozen=True, slots=True)
class Connection:
    """How a client reaches a server. ``tls``: verify the server with the system's roots, or with
    ``ca_cert`` (PEM bytes; implies TLS); ``client_cert`` + ``client_key``: present a certificate (servers
    with ``--tls-client-ca``); ``token``: sent as ``authorization: Bearer TOKEN`` on every call.

    A token goes only over TLS, or in clear to this host (gRPC's local credentials check that the peer is
    loopback): :meth:`channel` raises ``ValueError`` for a token to another host without TLS.
    """

    tls: bool = False
    ca_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    @property
    def secure(self) -> bool:
        return self.tls or self.ca_cert is not None or self.client_cert is not None

    def credentials(self, target: str) -> grpc.ChannelCredentials | None:
        """The channel credentials for ``target``; None: a plaintext channel."""
        if self.secure:
            credentials = grpc.ssl_channel_credentials(self.ca_cert, self.client_key, self.client_cert)
        elif self.token:
            if not _is_local(target):
                raise ValueError(
                    f"a token is sent only over TLS (or to this host): add --tls or --ca-cert to reach {target}"
                )
            kind = (
                grpc.LocalConnectionType.UDS if target.startswith("unix") else grpc.LocalConnectionType.LOCAL_TCP
            )
            credentials = grpc.local_channel_credentials(kind)
        else:
            return None
        if self.token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self.token)
            )
        return credentials

    def channel(self, target: str, options=None) -> grpc.Channel:
        """A blocking-API channel to ``target``."""
        credentials = self.credentials(target)
        if credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, credentials, options=options)

    def aio_channel(self, target: str, options=None) -> grpc.aio.Channel:
        """An asyncio channel to ``target`` (make it inside the running loop)."""
        credentials = self.credentials(target)
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, credentials, options=options)


def _is_local(target: str) -> bool:
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.removeprefix("dns:").removeprefix("ipv4:").removeprefix("ipv6:").lstrip("/")
    host = host.rpartition(":")[0] if host.count(":") == 1 or "]:" in host else host
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter without its noise: a flag's help ends with ``(default: X)`` unless the
    help states its default itself, or there is none to show (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == []:
            return text
        return super()._get_help_string(action)


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """``--tls``, ``--ca-cert``, ``--client-cert``, ``--client-key``, ``--token``: read them with
    :func:`connection_from_args`."""
    group = parser.add_argument_group("connection (TLS and token)")
    group.add_argument("--tls", action="store_true", help="use TLS, trusting the system's root certificates")
    group.add_argument("--ca-cert", metavar="PEM", help="use TLS, trusting this CA (a private CA's certificate)")
    group.add_argument("--client-cert", metavar="PEM", help="present this certificate (mTLS servers)")
    group.add_argument("--client-key", metavar="PEM", help="the client certificate's key")
    group.add_argument(
        "--token",
        default=None,
        help=f"send 'authorization: Bearer TOKEN' (default: ${TOKEN_ENV}; the environment keeps it out of ps)",
    )


def connection_from_args(args: argparse.Namespace) -> Connection:
    """The :class:`Connection` the flags ask for; ``ValueError`` (one line) for a file that cannot be read."""

    def read(path: str | None, flag: str) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as err:
            raise ValueError(f"{flag} {path}: {err.strerror or err}") from None

    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if token is not None and (not token.isascii() or not token.isprintable() or " " in token):
        raise ValueError("the token must be printable ASCII without spaces")
    return Connection(
        tls=args.tls,
        ca_cert=read(args.ca_cert, "--ca-cert"),
        client_cert=read(args.client_cert, "--client-cert"),
        client_key=read(args.client_key, "--client-key"),
        token=token,
    )


def describe_error(code: grpc.StatusCode, details: str, connection: Connection | None = None) -> str:
    """A failed call as one line; for TLS mismatches and token refusals, what to change."""
    details = " ".join((details or "").split())
    connection = connection or Connection()
    hint = ""
    if code == grpc.StatusCode.UNAVAILABLE:
        if "WRONG_VERSION_NUMBER" in details or "packet length too long" in details:
            hint = "the server does not speak TLS here: leave out --tls / --ca-cert" if connection.secure else ""
        elif "CERTIFICATE_VERIFY_FAILED" in details or "unable to get local issuer" in details:
            hint = "the server's certificate is not trusted: give its CA with --ca-cert"
        elif "Hostname Verification" in details or "not in peer certificate" in details:
            hint = "the server's certificate is not for this host name: connect by a name it holds"
        elif "CERTIFICATE_REQUIRED" in details or "ALERT_HANDSHAKE_FAILURE" in details:
            hint = "the server wants a client certificate: give --client-cert and --client-key"
        elif "Socket closed" in details or "Connection reset" in details:
            hint = (
                "the server closed the TLS connection: if it wants a client certificate, give --client-cert "
                "and --client-key (signed by a CA it trusts)"
                if connection.secure
                else "the server closed the connection at once: if it uses TLS, add --tls or --ca-cert"
            )
        elif connection.secure and "handshake" in details.lower():
            hint = "the TLS handshake failed"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        hint = (
            "give --token or set $" + TOKEN_ENV
            if not connection.token
            else "check the token (--token, $COSYSTREAM_TOKEN)"
        )
    line = f"{code.name}: {details}"
    return f"{hint} ({line})" if hint else line


class StreamStatus:
    """Feed it every response (``seen``); ``resolve`` an error the stream ended with."""

    def __init__(self) -> None:
        self.error: pb.StreamError | None = None

    def seen(self, response: pb.StreamingRecognizeResponse) -> None:
        if response.HasField("error"):
            self.error = response.error

    def code_and_details(self, err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
        code, details = err.code(), err.details() or ""
        if code == grpc.StatusCode.INTERNAL and self.error is not None and self.error.code in _CODES:
            return _CODES[self.error.code], self.error.message
        return code, details

    def resolve(self, err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
        """``err``, or the same error with the status the server sent."""
        code, details = self.code_and_details(err)
        if code == err.code():
            return err
        return grpc.aio.AioRpcError(code, err.initial_metadata(), err.trailing_metadata(), details)


WAV_HELP = (
    "accepted: WAV (RIFF) with PCM samples of 8, 16, 24 or 32 bits, 32/64-bit float, mu-law or A-law, any "
    "rate from 8 to 48 kHz, mono or more channels (averaged); convert anything else with "
    "`sox IN -c 1 -b 16 OUT.wav` or `ffmpeg -i IN -ac 1 OUT.wav`"
)
_PCM, _FLOAT, _ALAW, _MULAW, _EXTENSIBLE = 1, 3, 6, 7, 0xFFFE


def read_phrases(path) -> tuple[pb.Phrase, ...]:
    """A phrase list file for phrase boosting (``--phrases FILE``): one phrase per line, optionally a tab and
    its boost (nats per word, 0 < boost <= 20; none: the server's default); blank lines and lines starting
    with ``#`` are skipped. Raises ``ValueError`` naming the file and line; the server checks the phrases
    themselves (INVALID_ARGUMENT naming the phrase)."""
    phrases = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: {err}") from None
    for number, line in enumerate(lines, 1):
        text, _, boost = line.partition("\t")
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        try:
            phrases.append(pb.Phrase(text=text.strip(), boost=float(boost) if boost.strip() else 0.0))
        except ValueError:
            raise ValueError(f"{path}:{number}: the boost after the tab must be a number, got {boost!r}") from None
    return tuple(phrases)


class WavError(ValueError):
    """A file that is not a WAV file this reader takes; the message says what is accepted."""


def read_wav(path) -> tuple[np.ndarray, int]:
    """A WAV file's audio as float32 mono in [-1, 1] and its sample rate. Raises :class:`WavError`."""
    data = Path(path).read_bytes()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavError(f"{path}: not a WAV file (no RIFF/WAVE header); {WAV_HELP}")
    fmt, samples, offset = None, None, 12
    while offset + 8 <= len(data):
        kind, size = data[offset : offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
        body = data[offset + 8 : offset + 8 + size]
        if kind == b"fmt " and len(body) >= 16:
            fmt = struct.unpack_from("<HHIIHH", body)
            if fmt[0] == _EXTENSIBLE and len(body) >= 26:
                fmt = (struct.unpack_from("<H", body, 24)[0], *fmt[1:])  # the sub-format's tag
        elif kind == b"data":
            samples = body
            break
        offset += 8 + size + (size & 1)
    if fmt is None or samples is None:
        raise WavError(f"{path}: a WAV file without {'a fmt' if fmt is None else 'a data'} chunk; {WAV_HELP}")
    tag, channels, rate, _, _, bits = fmt
    if channels < 1 or rate <= 0:
        raise WavError(f"{path}: {channels} channels at {rate} Hz; {WAV_HELP}")
    if tag == _PCM and bits in (8, 16, 24, 32):
        audio = _pcm(samples, bits)
    elif tag == _FLOAT and bits in (32, 64):
        audio = np.frombuffer(samples[: len(samples) // (bits // 8) * (bits // 8)], f"<f{bits // 8}")
    elif tag in (_MULAW, _ALAW) and bits == 8:
        audio = (_MULAW_TABLE if tag == _MULAW else _ALAW_TABLE)[np.frombuffer(samples, np.uint8)]
    else:
        raise WavError(f"{path}: WAV format {tag} with {bits}-bit samples is not supported; {WAV_HELP}")
    audio = audio[: len(audio) // channels * channels].reshape(-1, channels).mean(axis=1)
    return np.clip(audio, -1.0, 1.0).astype(np.float32), rate


def _pcm(raw: bytes, bits: int) -> np.ndarray:
    width = bits // 8
    raw = raw[: len(raw) // width * width]
    if bits == 8:
        return (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    if bits == 16:
        return np.frombuffer(raw, "<i2").astype(np.float32) / 32768
    if bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        return ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / (1 << 23)
    return np.frombuffer(raw, "<i4").astype(np.float32) / (1 << 31)


def _g711_tables() -> tuple[np.ndarray, np.ndarray]:
    """ITU-T G.711 expansion of every byte, mu-law and A-law, to float in [-1, 1]."""
    byte = np.arange(256)
    u = ~byte & 0xFF
    magnitude = ((((u & 0x0F) << 3) + 0x84) << ((u >> 4) & 0x07)) - 0x84
    mulaw = np.where(u & 0x80, -magnitude, magnitude) / 32768.0
    a = byte ^ 0x55
    exponent, mantissa = (a >> 4) & 0x07, a & 0x0F
    linear = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    alaw = np.where(a & 0x80, linear, -linear) / 32768.0
    return mulaw.astype(np.float32), alaw.astype(np.float32)


_MULAW_TABLE, _ALAW_TABLE = _g711_tables()


def encode_mulaw(samples: np.ndarray) -> bytes:
    """float samples in [-1, 1] as G.711 mu-law bytes (the classic segment encoder, ITU-T G.711 / Sun g711.c),
    for a client that sends MULAW."""
    x = np.clip(np.asarray(samples, dtype=np.float64) * 32768.0, -32768, 32767).astype(np.int32)
    sign = np.where(x < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(x), 32635) + 0x84
    exponent = np.floor(np.log2(magnitude)).astype(np.int32) - 7
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


DETAILS_KEY = "grpc-status-details-bin"
"""The trailing metadata key of gRPC's rich error model (a ``google.rpc.Status``): a refusal's ``RetryInfo``."""


def retry_after_s(metadata: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """The ``RetryInfo`` delay of a status's trailing metadata, in seconds; None if it has none."""
    for key, value in metadata or ():
        if key != DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return info.retry_delay.ToMilliseconds() / 1000
    return None
