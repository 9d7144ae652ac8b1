"""Short-lived client secrets: what a browser presents instead of a real token.

A browser cannot set an ``Authorization`` header on a WebSocket, and a page must not hold a long-lived
token. As with OpenAI's ephemeral keys, a backend that holds a real token trades it for a client secret
(``POST /v1/realtime/transcription_sessions`` or ``POST /v1/realtime/client_secrets``) and hands that to
the page, which presents it in the WebSocket's subprotocols (``openai-insecure-api-key.SECRET``) or as
``?client_secret=SECRET``.

A secret is ``ek_`` + base64url(nonce, expiry, token name, HMAC-SHA256 of those) under a key made at
start-up and shared by every frontend, so any frontend can check one that another issued. It opens one
connection: spending it records its nonce in shared memory until it expires
(:meth:`cosystream.server.quota.TokenSessions.spend`). It carries the token's rights (priorities, session
quota, checked as for the token itself), and stops working when the token is revoked from the tokens
file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
import time

from cosystream.server.auth import Token, TokenStore
from cosystream.server.quota import NONCE_BYTES, QuotaExceeded, TokenSessions

PREFIX = "ek_"
DEFAULT_TTL_S = 60
MAX_TTL_S = 600
MIN_TTL_S = 10
_MAC_BYTES = 16
_HEAD = struct.Struct(f">{NONCE_BYTES}sQ")


class SecretRefused(Exception):
    """A client secret that does not open a connection; the message says why (never the secret)."""


class ClientSecrets:
    def __init__(self, shared: TokenSessions, tokens: TokenStore | None):
        self._shared = shared
        self._key = shared.secret_key
        self._tokens = tokens

    def issue(self, token: Token | None, ttl_s: int = DEFAULT_TTL_S) -> tuple[str, int]:
        """A new secret for ``token`` (None: authentication is off) and its expiry (Unix seconds)."""
        expires_at = int(time.time()) + ttl_s
        name = b"" if token is None else token.name.encode()
        body = _HEAD.pack(os.urandom(NONCE_BYTES), expires_at) + name
        return PREFIX + _b64(body + self._mac(body)), expires_at

    def spend(self, secret: str) -> Token | None:
        """The token a secret stands for (None: authentication is off), spending the secret. Raises
        :class:`SecretRefused` for a secret that is malformed, forged, expired, spent or revoked."""
        if not secret.startswith(PREFIX):
            raise SecretRefused("not a client secret")
        try:
            raw = base64.urlsafe_b64decode(secret[len(PREFIX) :] + "=" * (-len(secret) % 4))
        except ValueError:
            raise SecretRefused("not a client secret") from None
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if len(body) < _HEAD.size or not hmac.compare_digest(mac, self._mac(body)):
            raise SecretRefused("the client secret is not one this server issued")
        nonce, expires_at = _HEAD.unpack_from(body)
        name = body[_HEAD.size :].decode("utf-8", "replace")
        now = time.time()
        if expires_at < now:
            raise SecretRefused("the client secret has expired: ask your backend for a new one")
        token = None
        if self._tokens is not None:
            token = next((t for t in self._tokens.tokens if t.name == name), None)
            if token is None:
                raise SecretRefused("the token this client secret was issued for is no longer valid")
        try:
            fresh = self._shared.spend(nonce, float(expires_at), now)
        except QuotaExceeded as err:
            raise SecretRefused(str(err)) from None
        if not fresh:
            raise SecretRefused("the client secret was used already: each opens one connection")
        return token

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:_MAC_BYTES]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
