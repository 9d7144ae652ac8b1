"""A stream's responses on their way to the client, bounded whatever the client does.

A client that reads slowly (or never) must not make the server buffer without limit. Interim results are
superseded by the next one, so a waiting interim is replaced by a newer interim of the same utterance
(coalesced); finals, speech events and the stream's end are never dropped. Past ``max_items`` the stream
stops reading the client's requests (``wait_for_room``): no new audio, so no new responses, and HTTP/2
flow control pushes back on the client. What stays queued is then bounded by the audio already in flight.
"""

from __future__ import annotations

import asyncio
from collections import deque

from cosystream.frontend.results import Response

DEFAULT_MAX_ITEMS = 32


def _interim_utterance(item: object) -> int | None:
    """The utterance index of an interim (a session's :class:`Response`), else None."""
    return item.interim_of if isinstance(item, Response) else None


class ResponseQueue:
    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS):
        self.max_items = max_items
        self._items: deque[object] = deque()
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self.coalesced = 0  # interims replaced before they were sent

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self.max_items

    def put(self, item: object) -> None:
        """Queue ``item`` (never blocks, never drops anything but a superseded interim)."""
        utterance = _interim_utterance(item)
        if utterance is not None and self._items and _interim_utterance(self._items[-1]) == utterance:
            self._items[-1] = item
            self.coalesced += 1
        else:
            self._items.append(item)
        self._ready.set()
        if self.full:
            self._room.clear()

    async def get(self) -> object:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if not self.full:
            self._room.set()
        return item

    async def wait_for_room(self) -> None:
        """Return once a response was taken from a full queue, or at ``wake()`` (at once if not full)."""
        if self.full:
            self._room.clear()
            await self._room.wait()

    def wake(self) -> None:
        """Release a ``wait_for_room`` (the stream is ending)."""
        self._room.set()
