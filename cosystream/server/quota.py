"""Open sessions per token, counted across every frontend process of one server, for ``max_sessions``.

The frontends are separate processes sharing one port, so a per-process count would let a token open
``max_sessions`` on each of them. The counts live in shared memory made by the supervisor before it
spawns the frontends: a table of token-name slots, one row of counts per frontend (each process writes
only its own row), and one lock held for a few microseconds per claim or release. A name needs a slot
only while it has open sessions; a slot whose counts are all zero is free for any name.

A frontend that dies takes its sessions with it: the supervisor zeroes its row before respawning it.

The same shared memory holds what short-lived client secrets (``cosystream.server.http.secrets``) need
across the frontends: the key that signs them, and the secrets already spent (each is good for one
connection, which may reach any frontend).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

SLOTS = 1024
"""Distinct token names that may hold open sessions at the same time."""
NAME_BYTES = 64
"""The longest token name (auth.py refuses longer ones)."""
LOCK_TIMEOUT_S = 0.05
SPENT_SLOTS = 4096
"""Client secrets spent and not yet expired that the table remembers (their nonces)."""
NONCE_BYTES = 16


class QuotaExceeded(Exception):
    """The token already holds its ``max_sessions``; the message names the quota."""


@dataclass(slots=True)
class Claim:
    """One open session counted against its token; :meth:`release` gives it back (idempotent)."""

    sessions: TokenSessions | None
    slot: int

    def release(self) -> None:
        if self.sessions is not None:
            self.sessions._release(self.slot)
            self.sessions = None


class TokenSessions:
    """The shared table. Make it before spawning the frontends (``frontends`` rows) and hand each its row
    with :meth:`for_frontend`; it pickles into spawned processes only (as ``multiprocessing`` objects do)."""

    def __init__(self, frontends: int = 1):
        context = mp.get_context("spawn")
        self._lock = context.Lock()
        self._names_raw = context.RawArray(ctypes.c_char, SLOTS * NAME_BYTES)
        self._counts_raw = context.RawArray(ctypes.c_int32, frontends * SLOTS)
        self._secrets_raw = context.RawArray(ctypes.c_char, 32 + SPENT_SLOTS * NONCE_BYTES)
        self._spent_until_raw = context.RawArray(ctypes.c_double, SPENT_SLOTS)
        self._secrets_raw[:32] = os.urandom(32)
        self.frontends = frontends
        self.row = 0
        self._views()

    def _views(self) -> None:
        self._names = np.frombuffer(self._names_raw, dtype=f"S{NAME_BYTES}")
        self._counts = np.frombuffer(self._counts_raw, dtype=np.int32).reshape(self.frontends, SLOTS)
        self._spent = np.frombuffer(self._secrets_raw, dtype=f"S{NONCE_BYTES}", offset=32)
        self._spent_until = np.frombuffer(self._spent_until_raw, dtype=np.float64)
        self._slot_of: dict[bytes, int] = {}  # this process's guesses, checked under the lock
        self._unlocked = False

    _SHARED = ("_lock", "_names_raw", "_counts_raw", "_secrets_raw", "_spent_until_raw", "frontends", "row")

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

    def spend(self, nonce: bytes, expires_at: float, now: float) -> bool:
        """Mark a client secret spent until it expires; False if it was spent before. Raises
        :class:`QuotaExceeded` when ``SPENT_SLOTS`` unexpired secrets are spent already."""
        key = nonce[:NONCE_BYTES].ljust(NONCE_BYTES, b"\0")
        with self._locked():
            live = self._spent_until >= now
            if np.any(live & (self._spent == key)):
                return False
            free = np.flatnonzero(~live)
            if not len(free):
                raise QuotaExceeded(f"{SPENT_SLOTS} client secrets are in use; retry in a minute")
            slot = int(free[0])
            self._spent[slot] = key
            self._spent_until[slot] = expires_at
        return True

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
