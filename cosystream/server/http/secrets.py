"""Short-lived client secrets: what a browser presents instead of a real token.

A browser cannot set an ``Authorization`` header on a WebSocket, and a page must not hold a long-lived
token. As with OpenAI's ephemeral keys, a backend that holds a real token trades it for a client secret
(``POST /v1/realtime/transcription_sessions`` or ``POST /v1/realtime/client_secrets``) and hands that to
the page, which presents it in the WebSocket's subprotocols (``openai-insecure-api-key.SECRET``) or as
``?client_secret=SECRET``.

A secret is ``ek_`` + base64url(nonce, expiry, HMAC-SHA256 of those) under a key made at start-up and
shared by every frontend, so any frontend can check one that another issued. Issuing it records its nonce
in shared memory with the digest of the token it was issued for (:meth:`TokenSessions.issue_secret
<cosystream.frontend.quota.TokenSessions.issue_secret>`); spending it, on opening a connection, frees that
row, so it opens one connection. A token holds at most :func:`outstanding_limit` secrets unspent and
unexpired (beyond, :class:`~cosystream.frontend.quota.OwnerLimit`: 429), so no token can fill the table that
the others need. A secret carries its token's rights (priorities, session quota, checked as for the token
itself), and stops working when the token is revoked from the tokens file or given a new value: it is
bound to the token's digest, not its name.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
import time

from cosystream.frontend.quota import NONCE_BYTES, TokenSessions
from cosystream.server.auth import Token, TokenStore

PREFIX = "ek_"
DEFAULT_TTL_S = 60
MAX_TTL_S = 600
MIN_TTL_S = 10
SECRETS_PER_SESSION = 4
"""Unspent client secrets a token may hold per session of its ``max_sessions``..."""
SECRETS_PER_TOKEN = 64
"""... and at most, also for a token without ``max_sessions``."""
_MAC_BYTES = 16
_HEAD = struct.Struct(f">{NONCE_BYTES}sQ")


class SecretRefused(Exception):
    """A client secret that does not open a connection; the message says why (never the secret)."""


def outstanding_limit(token: Token) -> int:
    """The unspent, unexpired client secrets ``token`` may hold at once."""
    if token.max_sessions is None:
        return SECRETS_PER_TOKEN
    return min(SECRETS_PER_TOKEN, SECRETS_PER_SESSION * token.max_sessions)


class ClientSecrets:
    def __init__(self, shared: TokenSessions, tokens: TokenStore):
        self._shared = shared
        self._key = shared.secret_key
        self._tokens = tokens

    def issue(self, token: Token, ttl_s: int = DEFAULT_TTL_S) -> tuple[str, int]:
        """A new secret for ``token`` and its expiry (Unix seconds). Raises
        :class:`~cosystream.frontend.quota.OwnerLimit` when the token holds :func:`outstanding_limit` secrets
        already, :class:`~cosystream.frontend.quota.QuotaExceeded` when the server's table is full."""
        now = time.time()
        expires_at = int(now) + ttl_s
        nonce = os.urandom(NONCE_BYTES)
        self._shared.issue_secret(nonce, token.digest, float(expires_at), now, outstanding_limit(token))
        body = _HEAD.pack(nonce, expires_at)
        return PREFIX + _b64(body + self._mac(body)), expires_at

    def spend(self, secret: str) -> Token:
        """The token a secret stands for, spending the secret. Raises :class:`SecretRefused` for a secret
        that is malformed, forged, expired, spent or revoked."""
        if not secret.startswith(PREFIX):
            raise SecretRefused("not a client secret")
        encoded = secret[len(PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        except ValueError:
            raise SecretRefused("not a client secret") from None
        if _b64(raw) != encoded:  # (the last character's spare bits, or characters the decoder skips)
            raise SecretRefused("the client secret is not one this server issued")
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if len(body) != _HEAD.size or not hmac.compare_digest(mac, self._mac(body)):
            raise SecretRefused("the client secret is not one this server issued")
        nonce, expires_at = _HEAD.unpack(body)
        now = time.time()
        if expires_at < now:
            raise SecretRefused("the client secret has expired: ask your backend for a new one")
        owner = self._shared.spend(nonce, now)
        if owner is None:
            raise SecretRefused("the client secret was used already: each opens one connection")
        found = None
        for token in self._tokens.tokens:  # every entry, found or not, as TokenStore.authenticate does
            if hmac.compare_digest(owner, token.digest):
                found = token
        if found is None:
            raise SecretRefused("the token this client secret was issued for is no longer valid")
        return found

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:_MAC_BYTES]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
