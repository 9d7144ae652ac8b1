"""Linux process settings every cosystream process makes at start: no import beyond the standard library, so
a frontend process can use them without loading the engine (and torch).
"""

from __future__ import annotations

import ctypes
import logging
import signal

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def exit_with_parent(signum: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send ``signum`` to this process when its parent dies, so none is orphaned
    (SIGKILL for a process that may be stopped when it happens: a stopped process does not act on SIGTERM)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable")


def set_process_name(name: str) -> None:
    """Linux: name this process (``ps -o comm``, ``top``, the benchmarks' per-process CPU), <= 15 bytes."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        log.debug("prctl(PR_SET_NAME) unavailable")
