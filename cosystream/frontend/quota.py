"""Open sessions per token, counted across every frontend process of one server, for ``max_sessions``.

The frontends are separate processes sharing one port, so a per-process count would let a token open
``max_sessions`` on each of them. The counts live in shared memory made by the supervisor before it
spawns the frontends: a table of token-name slots, one row of counts per frontend (each process writes
only its own row), and one lock held for a few microseconds per claim or release. A name needs a slot
only while it has open sessions; a slot whose counts are all zero is free for any name.

A frontend that dies takes its sessions with it: the supervisor zeroes its row before respawning it.

The same shared memory holds what the HTTP port counts per token across the frontends (:class:`OwnedRows`):
the short-lived client secrets (``cosystream.server.http.secrets``) issued and not yet spent, with the key
that signs them (each secret is good for one connection, which may reach any frontend), and the open
WebSockets. Each row names the token's digest (its hashed entry, not its name: a name given a new value
is a new owner), so a per-token limit is one vector compare under the lock, and no token can fill a table
that the others need.

It also holds the audio each token name has sent, for its per-minute and per-day limits
(:mod:`cosystream.frontend.usage`); the supervisor keeps it across frontend restarts and token reloads.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
from dataclasses import dataclass

import numpy as np

from cosystream.frontend.usage import NO_LIMITS, Lease, UsageLimits, UsageTable

log = logging.getLogger(__name__)

SLOTS = 1024
"""Distinct token names that may hold open sessions at the same time."""
NAME_BYTES = 64
"""The longest token name (auth.py refuses longer ones)."""
LOCK_TIMEOUT_S = 0.05
SECRET_SLOTS = 4096
"""Client secrets issued, not yet spent nor expired, that the server holds (every token together)."""
WEBSOCKET_SLOTS = 8192
"""WebSockets opened with a token that the server holds open at once (every token together)."""
NONCE_BYTES = 16
OWNER_BYTES = 32
"""A token's SHA-256 digest: what owns a row."""


@dataclass(frozen=True, slots=True)
class Token:
    """A caller, as one line of the tokens file (``server/auth.py`` reads them). ``priorities`` None: any; ``max_sessions`` None: no quota;
    ``admin``: may make operator calls (the Admin service: loading and unloading models)."""

    name: str
    digest: bytes  # SHA-256 of the secret
    max_sessions: int | None = None
    priorities: frozenset[str] | None = None
    admin: bool = False
    usage: UsageLimits = NO_LIMITS  # audio seconds per minute and per day (none: not counted)

    def allows(self, priority: str) -> bool:
        return self.priorities is None or priority in self.priorities


class QuotaExceeded(Exception):
    """The token already holds its ``max_sessions``; the message names the quota."""


class OwnerLimit(QuotaExceeded):
    """The token already holds its limit of a table's rows (client secrets, WebSockets)."""


@dataclass(slots=True)
class Claim:
    """One open session counted against its token; :meth:`release` gives it back (idempotent)."""

    sessions: TokenSessions | None
    slot: int

    def release(self) -> None:
        if self.sessions is not None:
            self.sessions._release(self.slot)
            self.sessions = None


class Held(Claim):
    """One open WebSocket counted against its token; :meth:`release` gives it back (idempotent)."""

    __slots__ = ()

    def release(self) -> None:
        sessions, self.sessions = self.sessions, None
        if sessions is not None:
            sessions._close_websocket(self.slot)


class OwnedRows:
    """A fixed table in shared memory of rows that a token holds until a time: a key (a secret's nonce),
    the owner (a token's digest), the time the row lapses (Unix seconds; inf: until freed) and the frontend
    that holds it (-1: none). A row whose time is past is free. The caller holds the table's lock."""

    def __init__(self, context, slots: int):
        self._raw = (
            context.RawArray(ctypes.c_char, slots * NONCE_BYTES),
            context.RawArray(ctypes.c_char, slots * OWNER_BYTES),
            context.RawArray(ctypes.c_double, slots),
            context.RawArray(ctypes.c_int32, slots),
        )
        self._views()

    def _views(self) -> None:
        keys, owners, until, frontend = self._raw
        self.keys = np.frombuffer(keys, dtype=f"S{NONCE_BYTES}")
        self.owners = np.frombuffer(owners, dtype=f"S{OWNER_BYTES}")
        self.until = np.frombuffer(until, dtype=np.float64)
        self.frontend = np.frombuffer(frontend, dtype=np.int32)

    def __getstate__(self):
        return self._raw

    def __setstate__(self, state) -> None:
        self._raw = state
        self._views()

    def add(self, key: bytes, owner: bytes, until: float, frontend: int, limit: int, now: float) -> int:
        """A new row's slot. Raises :class:`OwnerLimit` if ``owner`` holds ``limit`` live rows,
        :class:`QuotaExceeded` if none is free."""
        live = self.until > now
        held = int(np.count_nonzero(live & (self.owners == owner)))
        if held >= limit:
            raise OwnerLimit(f"{held} held, the limit is {limit}")
        free = np.flatnonzero(~live)
        if not len(free):
            raise QuotaExceeded(f"all {len(self.until)} are in use")
        slot = int(free[0])
        self.keys[slot], self.owners[slot], self.frontend[slot] = key, owner, frontend
        self.until[slot] = until
        return slot

    def take(self, key: bytes, now: float) -> bytes | None:
        """Free the live row of ``key``: its owner, or None if there is none."""
        found = np.flatnonzero((self.until > now) & (self.keys == key))
        if not len(found):
            return None
        slot = int(found[0])
        self.until[slot] = 0.0
        return bytes(self.owners[slot]).ljust(OWNER_BYTES, b"\0")  # (numpy drops trailing NULs)

    def free(self, slot: int) -> None:
        self.until[slot] = 0.0

    def free_frontend(self, frontend: int) -> None:
        """Frontend ``frontend`` died: the rows it held are gone."""
        self.until[self.frontend == frontend] = 0.0


class TokenSessions:
    """The shared table. Make it before spawning the frontends (``frontends`` rows) and hand each its row
    with :meth:`for_frontend`; it pickles into spawned processes only (as ``multiprocessing`` objects do)."""

    def __init__(self, frontends: int = 1):
        context = mp.get_context("spawn")
        self._lock = context.Lock()
        self._names_raw = context.RawArray(ctypes.c_char, SLOTS * NAME_BYTES)
        self._counts_raw = context.RawArray(ctypes.c_int32, frontends * SLOTS)
        self._secrets_raw = context.RawArray(ctypes.c_char, 32)
        self._secrets_raw[:] = os.urandom(32)
        self._secrets = OwnedRows(context, SECRET_SLOTS)
        self._websockets = OwnedRows(context, WEBSOCKET_SLOTS)
        self._usage = UsageTable(context)
        self.frontends = frontends
        self.row = 0
        self._views()

    def _views(self) -> None:
        self._names = np.frombuffer(self._names_raw, dtype=f"S{NAME_BYTES}")
        self._counts = np.frombuffer(self._counts_raw, dtype=np.int32).reshape(self.frontends, SLOTS)
        self._slot_of: dict[bytes, int] = {}  # this process's guesses, checked under the lock
        self._unlocked = False

    _SHARED = (
        "_lock",
        "_names_raw",
        "_counts_raw",
        "_secrets_raw",
        "_secrets",
        "_websockets",
        "_usage",
        "frontends",
        "row",
    )

    def __getstate__(self):
        return tuple(getattr(self, name) for name in self._SHARED)

    def __setstate__(self, state) -> None:
        for name, value in zip(self._SHARED, state, strict=True):
            setattr(self, name, value)
        self._views()

    def for_frontend(self, index: int) -> TokenSessions:
        """The same table, counting into frontend ``index``'s row."""
        if not 0 <= index < self.frontends:
            raise ValueError(f"frontend {index} of {self.frontends}")
        view = object.__new__(TokenSessions)
        view.__setstate__((*self.__getstate__()[:-1], index))
        return view

    @property
    def secret_key(self) -> bytes:
        """The key that signs client secrets, the same in every frontend of the server."""
        return bytes(self._secrets_raw[:32])

    def issue_secret(self, nonce: bytes, owner: bytes, expires_at: float, now: float, limit: int) -> None:
        """Hold a client secret issued for ``owner`` (a token's digest) until it is spent or expires. Raises
        :class:`OwnerLimit` when ``owner`` holds ``limit`` already, :class:`QuotaExceeded` when every token
        together holds ``SECRET_SLOTS``."""
        with self._locked():
            self._secrets.add(nonce, owner, expires_at, -1, limit, now)

    def spend(self, nonce: bytes, now: float) -> bytes | None:
        """Spend a client secret: the digest of the token it was issued for, or None if it is not held
        (spent already, or expired)."""
        with self._locked():
            return self._secrets.take(nonce, now)

    def open_websocket(self, owner: bytes, limit: int) -> Held:
        """Count one more open WebSocket of ``owner`` (a token's digest) on this frontend, until the
        returned :class:`Held` is released. Raises :class:`OwnerLimit` at ``limit``, :class:`QuotaExceeded`
        when the server holds ``WEBSOCKET_SLOTS``."""
        with self._locked():
            slot = self._websockets.add(b"", owner, float("inf"), self.row, limit, 0.0)
        return Held(self, slot)

    def _close_websocket(self, slot: int) -> None:
        with self._locked():
            self._websockets.free(slot)

    def claim(self, name: str, max_sessions: int | None) -> Claim:
        """Count one more session of ``name``; raises :class:`QuotaExceeded` at ``max_sessions`` (None: no
        quota, nothing counted)."""
        if max_sessions is None:
            return Claim(None, -1)
        key = name.encode()
        with self._locked():
            slot = self._slot(key)
            if slot is None:
                raise QuotaExceeded(f"more than {SLOTS} tokens hold sessions at once; retry later")
            if int(self._counts[:, slot].sum()) >= max_sessions:
                raise QuotaExceeded(
                    f"token {name!r} already has its max_sessions={max_sessions} sessions open: close one, "
                    "or ask for a larger quota"
                )
            self._counts[self.row, slot] += 1
        return Claim(self, slot)

    def audio_lease(self, name: str, limits: UsageLimits) -> Lease:
        """A stream's audio counted against ``name``'s ``limits`` (:mod:`cosystream.frontend.usage`)."""

        def reserve(want_s: float, debt_s: float, now: float) -> float:
            with self._locked():
                return self._usage.reserve(name, limits, want_s, debt_s, now)

        def give_back(seconds: float, reserved_at: float, now: float) -> None:
            with self._locked():
                self._usage.give_back(name, seconds, reserved_at, now)

        return Lease(reserve, give_back)

    def audio_used(self, name: str, now: float) -> tuple[float, float]:
        """Audio seconds ``name`` used in the last 60 s and today (UTC), on every frontend."""
        with self._locked():
            return self._usage.used(name, now)

    def open_sessions(self, name: str) -> int:
        """Sessions of ``name`` open now, on every frontend."""
        key = name.encode()
        with self._locked():
            found = np.flatnonzero(self._names == key)
            return int(self._counts[:, found].sum())

    def reset_row(self, index: int) -> None:
        """Frontend ``index`` died: its sessions are gone."""
        with self._locked():
            self._counts[index, :] = 0
            self._websockets.free_frontend(index)

    def _release(self, slot: int) -> None:
        with self._locked():
            if self._counts[self.row, slot] > 0:
                self._counts[self.row, slot] -= 1

    def _slot(self, key: bytes) -> int | None:
        """``key``'s slot, given one if it has none (under the lock)."""
        slot = self._slot_of.get(key)
        if slot is not None and self._names[slot] == key:
            return slot
        found = np.flatnonzero(self._names == key)
        if len(found):
            slot = int(found[0])
        else:
            free = np.flatnonzero(self._counts.sum(axis=0) == 0)
            if not len(free):
                return None
            slot = int(free[0])
            self._names[slot] = key  # a free slot's old name has no session left to count
        self._slot_of[key] = slot
        return slot

    def _locked(self):
        return _Held(self)


class _Held:
    """The table's lock, waited for at most ``LOCK_TIMEOUT_S`` (it is held for microseconds): a process
    killed while holding it must not stall every other frontend's event loop, so from then on this
    process counts without it (a race may then admit a session or two over a quota)."""

    __slots__ = ("_acquired", "_sessions")

    def __init__(self, sessions: TokenSessions):
        self._sessions = sessions
        self._acquired = False

    def __enter__(self) -> None:
        sessions = self._sessions
        if sessions._unlocked:
            return
        self._acquired = sessions._lock.acquire(timeout=LOCK_TIMEOUT_S)
        if not self._acquired:
            sessions._unlocked = True
            log.error("the session-quota lock is stuck (a frontend died holding it?): counting without it")

    def __exit__(self, *exc) -> None:
        if self._acquired:
            self._sessions._lock.release()
