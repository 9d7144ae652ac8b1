"""The runner's settings that the engine's configuration names, in the standard library only: ``serve``'s
supervisor builds that configuration (``engine/config.py``) and never imports torch."""

from __future__ import annotations

import enum


class GraphMode(enum.Enum):
    EAGER = "eager"
    GRAPHS = "graphs"


COMPILE_BUDGET_S = 0.0
"""Start-up seconds spent compiling keys that are not in the cache (checked between keys, so one key may
run over it); None: compile every key. By default none: a start uses the packages cached and runs the rest
eager, so no start waits on a compiler (``serve`` then compiles them in the background and swaps each in)."""
