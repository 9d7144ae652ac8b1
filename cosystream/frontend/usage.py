"""Audio seconds per token, per minute and per day (``max_audio_s_per_min=``, ``max_audio_s_per_day=``).

Counted across every frontend process of one server, in the same shared memory as the session counts
(:class:`~cosystream.frontend.quota.TokenSessions` holds the table and its lock): a row per token name, with
the audio charged in each of the last 60 seconds (the minute is a sliding window: at most N seconds of audio
in any 60 s) and the audio charged on the current UTC day (a fixed window: it starts again at midnight UTC).
Rows are keyed by name, not by secret, and live in the supervisor's memory, so a SIGHUP reload that gives a
name a new secret, or changes its limits, keeps what it has used.

A stream does not take the lock per chunk: it reserves a *lease* (a second of audio, or what is left if
less) and spends it locally, reserving the next when it runs out; what it has not spent when it ends is
given back. The table sees one lock a second per stream of a limited token; a token without limits is not
counted at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from dataclasses import dataclass

import numpy as np

USAGE_SLOTS = 4096
"""Token names with limits that the table can count at once (a row is reused once its minute and day have
nothing left to count)."""
NAME_BYTES = 64
WINDOW_S = 60
"""The per-minute limit's sliding window, in one-second bins."""
DAY_S = 86_400
LEASE_S = 1.0
"""Audio a stream reserves at a time: the most a stream can spend beyond its token's limit before it is
stopped is one slice of a request (0.5 s of LINEAR16 at 16 kHz)."""


class UsageExceeded(Exception):
    """The token has used its audio for now; ``retry_after_s``: when it may send again, ``per`` ``min`` or
    ``day``: which limit."""

    def __init__(self, message: str, retry_after_s: float, per: str):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.per = per


@dataclass(frozen=True, slots=True)
class UsageLimits:
    """A token's audio limits in seconds (None: no limit)."""

    per_min_s: float | None = None
    per_day_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("max_audio_s_per_min", self.per_min_s), ("max_audio_s_per_day", self.per_day_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    @property
    def limited(self) -> bool:
        return self.per_min_s is not None or self.per_day_s is not None


NO_LIMITS = UsageLimits()


class UsageTable:
    """The rows in shared memory (``context.RawArray``s); every method runs under the caller's lock.

    ``now`` is Unix time (seconds): the day is the UTC day, and every frontend of a server shares the clock.
    """

    def __init__(self, context, slots: int = USAGE_SLOTS):
        self._raw = (
            context.RawArray(ctypes.c_char, slots * NAME_BYTES),
            context.RawArray(ctypes.c_double, slots * WINDOW_S),  # audio charged in each second's bin
            context.RawArray(ctypes.c_int64, slots * WINDOW_S),  # the Unix second each bin counts
            context.RawArray(ctypes.c_int64, slots),  # the UTC day (days since the epoch) day_s counts
            context.RawArray(ctypes.c_double, slots),
        )
        self._views()

    def _views(self) -> None:
        names, bins, bin_s, day, day_s = self._raw
        slots = len(day)
        self.names = np.frombuffer(names, dtype=f"S{NAME_BYTES}")
        self.bins = np.frombuffer(bins, dtype=np.float64).reshape(slots, WINDOW_S)
        self.bin_s = np.frombuffer(bin_s, dtype=np.int64).reshape(slots, WINDOW_S)
        self.day = np.frombuffer(day, dtype=np.int64)
        self.day_s = np.frombuffer(day_s, dtype=np.float64)
        self._slot_of: dict[bytes, int] = {}  # this process's guesses, checked against the names

    def __getstate__(self):
        return self._raw

    def __setstate__(self, state) -> None:
        self._raw = state
        self._views()

    def used(self, name: str, now: float) -> tuple[float, float]:
        """Audio seconds ``name`` used in the last minute and today."""
        slot = self._find(name.encode())
        if slot is None:
            return 0.0, 0.0
        second, today = int(now), int(now // DAY_S)
        minute = float(self.bins[slot][self.bin_s[slot] > second - WINDOW_S].sum())
        return minute, float(self.day_s[slot]) if self.day[slot] == today else 0.0

    def reserve(self, name: str, limits: UsageLimits, want_s: float, debt_s: float, now: float) -> float:
        """Charge ``debt_s`` (audio already spent beyond the last lease) and reserve up to ``want_s`` more:
        the seconds reserved, > 0. Raises :class:`UsageExceeded` when nothing is left (the debt is charged
        all the same: that audio was heard)."""
        key = name.encode()
        slot = self._slot(key, now)
        if slot is None:
            raise UsageExceeded(
                f"more than {len(self.day)} tokens with audio limits are counted at once; retry later", 1.0, "min"
            )
        second, today = int(now), int(now // DAY_S)
        bins, bin_s = self.bins[slot], self.bin_s[slot]
        current = second % WINDOW_S
        if bin_s[current] != second:
            bins[current], bin_s[current] = 0.0, second
        if self.day[slot] != today:
            self.day[slot], self.day_s[slot] = today, 0.0
        live = bin_s > second - WINDOW_S
        bins[current] += debt_s
        self.day_s[slot] += debt_s
        left, per, retry_s = math.inf, "", 0.0
        if limits.per_min_s is not None:
            left = limits.per_min_s - float(bins[live].sum())
            if left <= 0:
                per, retry_s = (
                    "min",
                    _minute_retry_s(bins, bin_s, live, -left + min(want_s, limits.per_min_s), now),
                )
        if limits.per_day_s is not None and not per:
            day_left = limits.per_day_s - float(self.day_s[slot])
            left = min(left, day_left)
            if day_left <= 0:
                per, retry_s = "day", (today + 1) * DAY_S - now
        if per:
            limit = limits.per_min_s if per == "min" else limits.per_day_s
            window = "in any 60 s" if per == "min" else "today (UTC)"
            raise UsageExceeded(
                f"token {name!r} has used its max_audio_s_per_{per}={limit:g} seconds of audio {window}: retry "
                f"in {math.ceil(retry_s):g} s, or ask for a larger quota",
                retry_s,
                per,
            )
        granted = min(want_s, left)
        bins[current] += granted
        self.day_s[slot] += granted
        return granted

    def give_back(self, name: str, seconds: float, reserved_at: float, now: float) -> None:
        """Return ``seconds`` of a lease reserved at ``reserved_at`` and not spent (a stream that ended)."""
        slot = self._find(name.encode())
        if slot is None or seconds <= 0:
            return
        second = int(reserved_at)
        bin_index = second % WINDOW_S
        if self.bin_s[slot, bin_index] == second:
            self.bins[slot, bin_index] = max(0.0, self.bins[slot, bin_index] - seconds)
        if self.day[slot] == int(reserved_at // DAY_S) == int(now // DAY_S):
            self.day_s[slot] = max(0.0, self.day_s[slot] - seconds)

    def _find(self, key: bytes) -> int | None:
        slot = self._slot_of.get(key)
        if slot is not None and self.names[slot] == key:
            return slot
        found = np.flatnonzero(self.names == key)
        if not len(found):
            return None
        self._slot_of[key] = slot = int(found[0])
        return slot

    def _slot(self, key: bytes, now: float) -> int | None:
        """``key``'s row, given one if it has none: a row never used, or one whose minute and day are over."""
        slot = self._find(key)
        if slot is not None:
            return slot
        second, today = int(now), int(now // DAY_S)
        idle = ~(self.bin_s > second - WINDOW_S).any(axis=1) & ((self.day != today) | (self.day_s == 0))
        free = np.flatnonzero(idle)
        if not len(free):
            return None
        slot = int(free[0])
        self.names[slot] = key
        self.bins[slot], self.bin_s[slot], self.day[slot], self.day_s[slot] = 0.0, 0, 0, 0.0
        self._slot_of[key] = slot
        return slot


def _minute_retry_s(bins: np.ndarray, bin_s: np.ndarray, live: np.ndarray, need_s: float, now: float) -> float:
    """When enough of the window's audio has aged out of it to free ``need_s`` seconds."""
    freed = 0.0
    for index in np.argsort(np.where(live, bin_s, np.iinfo(np.int64).max)):
        if not live[index]:
            break
        freed += bins[index]
        if freed >= need_s:
            return max(0.0, bin_s[index] + WINDOW_S - now)
    return float(WINDOW_S)


def unix_time() -> float:
    """The clock the limits count by (every frontend of a server reads the same one)."""
    return time.time()


class Lease:
    """One stream's audio against its token's limits: :meth:`spend` what it hears, :meth:`close` at its end.

    ``reserve`` is the table's :meth:`UsageTable.reserve` under its lock (``TokenSessions.audio_lease``),
    ``give_back`` its :meth:`UsageTable.give_back`.
    """

    __slots__ = ("_give_back", "_reserve", "_reserved_at", "left_s", "spent_s")

    def __init__(self, reserve, give_back):
        self._reserve, self._give_back = reserve, give_back
        self.left_s = 0.0  # reserved and not yet spent (< 0: spent beyond the lease, charged at the next)
        self.spent_s = 0.0
        self._reserved_at = 0.0

    def ensure(self) -> None:
        """Have audio left to spend: reserve the next lease if this one is spent. Raises
        :class:`UsageExceeded` when the token has none left."""
        if self.left_s > 0:
            return
        now = unix_time()
        debt_s, self.left_s = -self.left_s, 0.0
        self.left_s = self._reserve(LEASE_S, debt_s, now)
        self._reserved_at = now

    def spend(self, seconds: float) -> None:
        self.left_s -= seconds
        self.spent_s += seconds

    def close(self) -> None:
        """Give back what is reserved and not spent, or charge what was spent beyond it. Idempotent."""
        left_s, self.left_s = self.left_s, 0.0
        if left_s > 0:
            self._give_back(left_s, self._reserved_at, unix_time())
        elif left_s < 0:
            with contextlib.suppress(UsageExceeded):  # (charged all the same)
                self._reserve(0.0, -left_s, unix_time())
