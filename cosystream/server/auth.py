"""Bearer tokens from a file (``serve --auth-tokens FILE``), checked on every call except gRPC health.

The file, one token a line (``#`` starts a comment)::

    NAME TOKEN [max_sessions=N] [max_audio_s_per_min=S] [max_audio_s_per_day=S] [priorities=REALTIME,BATCH] [admin]
    NAME sha256:HEX [...]            # the token's SHA-256 instead of the token: no secret in the file

``max_audio_s_per_min`` / ``max_audio_s_per_day``: seconds of audio the token's sessions may send together
in any 60 s, and on one UTC day, counted across the server's frontends (``cosystream.frontend.usage``).

Clients send ``authorization: Bearer TOKEN`` (Google's clients may send ``x-goog-api-key: TOKEN``). The
presented token is hashed and compared with every entry's digest by ``hmac.compare_digest``, so plain and
hashed entries take the same path and the time taken says nothing about the secrets.

:class:`TokenStore` holds the current tokens: :meth:`~TokenStore.reload` (SIGHUP) and a watch of the file's
mtime swap them whole; a file that does not parse keeps the old ones and logs why. Open sessions are never
dropped by a reload: a token is checked when a call starts. :class:`AuthInterceptor` refuses calls
without a known token (UNAUTHENTICATED, saying which header to send) and makes the token of an accepted
call readable by its handler through :func:`current_token`; the servicer checks the token's priorities
and session quota once it has read the stream's config.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import inspect
import logging
import math
import os
import re
from collections.abc import Callable, Iterable

import grpc

from cosystream.frontend.quota import Token
from cosystream.frontend.usage import UsageLimits

log = logging.getLogger(__name__)

AUDIO_LIMITS = ("max_audio_s_per_min", "max_audio_s_per_day")
PRIORITY_NAMES = ("REALTIME", "BATCH")
"""The values of ``priorities=`` (cosystream.v1 Priority names; an unspecified priority is REALTIME)."""
MIN_TOKEN_CHARS = 16
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
TOKEN_PATTERN = re.compile(r"[!-~]+")  # visible ASCII: what a gRPC metadata value may carry
WATCH_PERIOD_S = 1.0
UNAUTHENTICATED_HELP = (
    "send the metadata header 'authorization: Bearer TOKEN' (or 'x-goog-api-key: TOKEN') with a token "
    "this server knows"
)


class TokenFileError(ValueError):
    """A tokens file that cannot be used; the message names the file and line (one line)."""


def digest_of(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse_tokens(text: str, source: str = "tokens") -> tuple[Token, ...]:
    """The tokens of a file's text. Raises :class:`TokenFileError` on the first bad line."""
    tokens: list[Token] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source}:{number}"
        if len(fields) < 2:
            raise TokenFileError(
                f"{where}: expected 'NAME TOKEN [max_sessions=N] [max_audio_s_per_min=S] [max_audio_s_per_day=S] [priorities=...] [admin]'"
            )
        name, secret, *options = fields
        if not NAME_PATTERN.fullmatch(name):
            raise TokenFileError(
                f"{where}: name {name!r}: use up to 64 letters, digits and _ . @ - (it labels logs and metrics)"
            )
        if name in names:
            raise TokenFileError(f"{where}: the name {name!r} is used twice")
        digest = _digest_field(secret, where)
        if digest in digests:
            raise TokenFileError(f"{where}: the same token as an earlier line (each name needs its own)")
        tokens.append(_options(name, digest, options, where))
        names.add(name)
        digests.add(digest)
    if not tokens:
        raise TokenFileError(f"{source}: no tokens in it (every call would be refused)")
    return tuple(tokens)


def _digest_field(secret: str, where: str) -> bytes:
    if secret.lower().startswith("sha256:"):
        hexdigest = secret[len("sha256:") :]
        if not re.fullmatch(r"[0-9a-fA-F]{64}", hexdigest):
            raise TokenFileError(f"{where}: sha256: takes 64 hex digits (printf %s TOKEN | sha256sum)")
        return bytes.fromhex(hexdigest)
    if not TOKEN_PATTERN.fullmatch(secret):
        raise TokenFileError(f"{where}: a token is visible ASCII only")
    if len(secret) < MIN_TOKEN_CHARS:
        raise TokenFileError(
            f"{where}: a token needs at least {MIN_TOKEN_CHARS} characters (openssl rand -hex 32 makes one)"
        )
    return digest_of(secret)


def _options(name: str, digest: bytes, options: list[str], where: str) -> Token:
    values: dict = {}
    for option in options:
        key, equals, value = option.partition("=")
        if key in values:
            raise TokenFileError(f"{where}: {key} given twice")
        if key == "admin" and not equals:
            values["admin"] = True
        elif key == "max_sessions" and equals:
            if not value.isdigit() or int(value) < 1:
                raise TokenFileError(f"{where}: max_sessions={value}: give a whole number >= 1")
            values["max_sessions"] = int(value)
        elif key in AUDIO_LIMITS and equals:
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            if not 0 < seconds < math.inf:
                raise TokenFileError(f"{where}: {key}={value}: give a number of seconds > 0")
            values[key] = seconds
        elif key == "priorities" and equals:
            chosen = frozenset(p.strip().upper() for p in value.split(",") if p.strip())
            unknown = sorted(chosen - set(PRIORITY_NAMES))
            if unknown or not chosen:
                raise TokenFileError(
                    f"{where}: priorities={value}: use a comma-separated list of {', '.join(PRIORITY_NAMES)}"
                )
            values["priorities"] = chosen
        else:
            raise TokenFileError(
                f"{where}: unknown option {option!r} (max_sessions=N, max_audio_s_per_min=S, "
                "max_audio_s_per_day=S, priorities=REALTIME,BATCH, admin)"
            )
    usage = UsageLimits(values.pop(AUDIO_LIMITS[0], None), values.pop(AUDIO_LIMITS[1], None))
    return Token(name, digest, usage=usage, **values)


def load_tokens(path: str) -> tuple[Token, ...]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise TokenFileError(f"{path}: {getattr(err, 'strerror', None) or err}") from None
    return parse_tokens(text, path)


def _signature(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class AuthError(Exception):
    """A call refused: its status code and message (never the token)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def presented_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token a call carries: ``authorization: Bearer TOKEN``, else ``x-goog-api-key: TOKEN``.
    Raises :class:`AuthError` for an ``authorization`` header of another scheme."""
    api_key = None
    for key, value in metadata:
        if isinstance(value, bytes):
            continue
        if key == "authorization":
            scheme, _, credentials = value.strip().partition(" ")
            if scheme.lower() != "bearer" or not credentials.strip():
                raise AuthError(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"the authorization header is not a bearer token: {UNAUTHENTICATED_HELP}",
                )
            return credentials.strip()
        if key == "x-goog-api-key":
            api_key = value.strip()
    return api_key


class TokenStore:
    """The current tokens of a file, swapped whole on reload. Raises :class:`TokenFileError` if the file
    cannot be used at start-up."""

    def __init__(self, path: str):
        self.path = path
        self._signature = _signature(path)
        self.tokens = load_tokens(path)
        self.generation = 0  # successful reloads

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Token:
        """The token of a call's metadata. Raises :class:`AuthError` (UNAUTHENTICATED)."""
        secret = presented_token(metadata)
        if not secret:
            raise AuthError(
                grpc.StatusCode.UNAUTHENTICATED, f"this server requires a token: {UNAUTHENTICATED_HELP}"
            )
        presented = digest_of(secret)
        found = None
        for token in self.tokens:  # every entry, found or not: no early exit
            if hmac.compare_digest(presented, token.digest):
                found = token
        if found is None:
            raise AuthError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the token is not known here (wrong or revoked): {UNAUTHENTICATED_HELP}",
            )
        return found

    def reload(self, why: str = "SIGHUP") -> bool:
        """Read the file again; True if the new tokens are in use. A bad file keeps the old ones."""
        self._signature = _signature(self.path)
        try:
            tokens = load_tokens(self.path)
        except TokenFileError as err:
            log.error("tokens not reloaded (%s), keeping the %d in use: %s", why, len(self.tokens), err)
            return False
        self.tokens = tokens
        self.generation += 1
        log.info("tokens reloaded (%s): %d token(s)", why, len(tokens))
        return True

    def reload_if_changed(self) -> bool:
        if _signature(self.path) == self._signature:
            return False
        return self.reload("the file changed")

    async def watch(self, period_s: float = WATCH_PERIOD_S) -> None:
        """Reload when the file changes (its mtime, size or inode), until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            self.reload_if_changed()


_current_token: contextvars.ContextVar[Token | None] = contextvars.ContextVar("cosystream_token", default=None)


def current_token() -> Token | None:
    """The token of the call being handled (None: authentication is off)."""
    return _current_token.get()


def use_token(token: Token | None) -> None:
    """Make ``token`` the current one for the running task (and the tasks it starts from now on): the
    HTTP adapters' counterpart of the interceptor."""
    _current_token.set(token)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every method needs a known token, except those under ``exempt_prefixes`` (gRPC health: Kubernetes
    probes send no metadata).

    ``refusal_response(method, code, message)`` may give a response to send before the status (the native
    API's status-as-last-response, see cosystream.v1.client.StreamStatus); ``on_refused(method, code)``
    counts refusals.
    """

    def __init__(
        self,
        store: TokenStore,
        exempt_prefixes: tuple[str, ...] = ("/grpc.health.v1.Health/",),
        refusal_response: Callable[[str, grpc.StatusCode, str], object | None] | None = None,
        on_refused: Callable[[str, grpc.StatusCode], None] | None = None,
    ):
        self.store = store
        self.exempt_prefixes = exempt_prefixes
        self.refusal_response = refusal_response
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self.exempt_prefixes):
            return handler
        try:
            token = self.store.authenticate(handler_call_details.invocation_metadata or ())
        except AuthError as err:
            log.info("refused %s: %s", method, err.code.name)
            if self.on_refused is not None:
                self.on_refused(method, err.code)
            return _refusing(handler, method, err, self.refusal_response)
        return _with_token(handler, token)


def _handler(template, **behaviour) -> grpc.RpcMethodHandler:
    """A handler of ``template``'s kind and (de)serializers with one behaviour replaced."""
    make = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    ((kind, function),) = behaviour.items()
    return make[kind](
        function,
        request_deserializer=template.request_deserializer,
        response_serializer=template.response_serializer,
    )


def _with_token(handler, token: Token) -> grpc.RpcMethodHandler:
    """``handler`` with ``token`` readable through :func:`current_token` while it runs (set inside the
    behaviour, so it is in the context of the task that runs the call)."""
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            _current_token.set(token)
            return await _awaited(inner(request, context))

        return _handler(handler, unary_unary=unary_unary)
    if handler.stream_unary:
        inner = handler.stream_unary

        async def stream_unary(requests, context):
            _current_token.set(token)
            return await _awaited(inner(requests, context))

        return _handler(handler, stream_unary=stream_unary)
    kind = "unary_stream" if handler.unary_stream else "stream_stream"
    inner = handler.unary_stream or handler.stream_stream
    if not inspect.isasyncgenfunction(inner):  # a coroutine that writes with context.write()

        async def writing(request_or_requests, context):
            _current_token.set(token)
            return await _awaited(inner(request_or_requests, context))

        return _handler(handler, **{kind: writing})

    async def streaming(request_or_requests, context):
        _current_token.set(token)
        # Closing this generator (the call ended) closes the handler's at once, running its cleanup.
        async with contextlib.aclosing(inner(request_or_requests, context)) as responses:
            async for response in responses:
                yield response

    return _handler(handler, **{kind: streaming})


async def _awaited(result):
    """A handler's result, awaited if it is a coroutine (grpc.aio also takes plain functions)."""
    return await result if inspect.isawaitable(result) else result


def _refusing(handler, method: str, err: AuthError, refusal_response) -> grpc.RpcMethodHandler:
    async def abort(_request, context):
        await context.abort(err.code, err.message)

    if handler.unary_unary:
        return _handler(handler, unary_unary=abort)
    if handler.stream_unary:
        return _handler(handler, stream_unary=abort)
    kind = "unary_stream" if handler.unary_stream else "stream_stream"

    async def abort_stream(_request, context):
        response = refusal_response(method, err.code, err.message) if refusal_response else None
        if response is not None:
            yield response
        await context.abort(err.code, err.message)

    return _handler(handler, **{kind: abort_stream})
