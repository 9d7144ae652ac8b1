"""The adaptive model under load (``serve --adaptive HEAVY=LIGHT``): when the engine is near saturation, new
utterances of sessions that asked for HEAVY run on LIGHT; once the load has fallen, they return.

The signal is the engine's **projected load**: the share of wall time its loop is busy with realtime work
(reading, stepping, sending; BATCH steps left out: they yield to realtime and are shed first), counting every
realtime step of LIGHT rows at what HEAVY would have cost it (the scheduler's measured cost model of HEAVY).
So the signal does not drop merely because LIGHT is cheaper, and one pair of water marks cannot flap:

- at or above ``high`` over a measuring window, new utterances go to LIGHT;
- at or below ``low`` over a window, and at least ``hold_s`` after the switch, they go back to HEAVY;
- between the two, nothing changes.

A session moves only between utterances (its caches are zeroed there anyway), so an utterance is decoded by
one model from its first frame to its final, and its result names that model.

:class:`AdaptivePolicy` is the state machine alone, on a clock it is given (the tests drive it with a fake
one); ``EngineCore`` feeds it and moves the sessions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

ADAPTIVE_HIGH = 0.85
"""Projected load at which new utterances of HEAVY sessions run on LIGHT (``--adaptive-high``)."""
ADAPTIVE_LOW = 0.55
"""Projected load at or below which they return to HEAVY (``--adaptive-low``)."""
ADAPTIVE_WINDOW_S = 0.5
"""The load is the busy share over windows this long."""
ADAPTIVE_HOLD_S = 5.0
"""The least time on LIGHT before returning to HEAVY, whatever the load does meanwhile."""


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """Which models fall back to which (HEAVY name -> LIGHT name), and the policy's marks."""

    pairs: tuple[tuple[str, str], ...] = ()
    high: float = ADAPTIVE_HIGH
    low: float = ADAPTIVE_LOW
    window_s: float = ADAPTIVE_WINDOW_S
    hold_s: float = ADAPTIVE_HOLD_S

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise ValueError(f"adaptive marks: need 0 < low < high, got low {self.low}, high {self.high}")
        if not self.window_s > 0 or self.hold_s < 0:
            raise ValueError("adaptive window must be > 0 and hold >= 0")
        heavy = [h for h, _ in self.pairs]
        if len(set(heavy)) != len(heavy):
            raise ValueError("--adaptive: one LIGHT model per HEAVY model")
        for h, light in self.pairs:
            if h == light:
                raise ValueError(f"--adaptive {h}={light}: a model cannot fall back to itself")
            if light in heavy:
                raise ValueError(f"--adaptive: {light} is a LIGHT model and a HEAVY one; chains are not followed")

    @property
    def fallbacks(self) -> dict[str, str]:
        return dict(self.pairs)


@dataclass(frozen=True, slots=True)
class Switch:
    """A change of mode: ``light`` is the new mode, ``load`` the window's projected load that caused it."""

    light: bool
    load: float
    at_s: float


class AdaptivePolicy:
    """Busy time in, mode out: :meth:`add` the loop's realtime busy seconds (projected at HEAVY's cost) as
    they are spent, and :meth:`update` once per loop iteration; it returns a :class:`Switch` when the mode
    changes at the end of a window, else None."""

    def __init__(self, config: AdaptiveConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self.light = False
        self.load = 0.0  # the last complete window's projected load
        self.windows = 0  # complete windows so far
        self.switches = 0
        self._window_start = clock()
        self._busy_s = 0.0
        self._since_s = self._window_start  # when the mode last changed

    def add(self, busy_s: float) -> None:
        """Realtime busy time spent (or projected) since the last call."""
        self._busy_s += max(0.0, busy_s)

    def update(self) -> Switch | None:
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < self.config.window_s:
            return None
        self.load = min(4.0, self._busy_s / elapsed)  # (over 1: projected work HEAVY could not have done)
        self._busy_s, self._window_start = 0.0, now
        self.windows += 1
        c = self.config
        if not self.light and self.load >= c.high:
            return self._switch(True, now)
        if self.light and self.load <= c.low and now - self._since_s >= c.hold_s:
            return self._switch(False, now)
        return None

    def _switch(self, light: bool, now: float) -> Switch:
        self.light, self._since_s = light, now
        self.switches += 1
        return Switch(light, self.load, now)
