"""A session's service class, as the wire API, the frontends and the engine's scheduler all know it. Stated once
here, importing nothing, so a transport or a client-side module names it without loading the scheduler."""

from enum import IntEnum


class Priority(IntEnum):
    """A session's service class. Lower values are served first; the values match the wire enum."""

    REALTIME = 1
    BATCH = 2
