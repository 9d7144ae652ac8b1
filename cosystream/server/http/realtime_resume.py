"""Resuming a Realtime WebSocket (``realtime.py``) after its connection dropped.

A connection opened with ``?resumable=true`` is told a resume token (the ``cosystream.session.resumable``
event) and, as it goes, how many of its events the server has taken (``cosystream.session.received``, at
least every second of audio). When its WebSocket goes away without a close frame, :class:`HeldConnections`
holds the whole connection for the resume window (``serve --resume-window-s``): its settings, item ids and
open buffers, whose native streams keep their engine slots and go on transcribing what they had. Its events
are kept meanwhile (the last :data:`REPLAY_EVENTS`, whether or not they were sent: one can be lost with the
connection). A new WebSocket with ``resume_token``, ``resume_offset_events`` and ``resume_after_event``
takes it back (:meth:`HeldConnections.take`): the events after ``resume_after_event`` are sent again, the
client sends its events again from ``resume_offset_events`` and the server skips those it already took. Not
resumed within the window, it is freed (``cosystream_sessions_expired_total``).

The offset counts the client's messages, not audio: every append is taken whole, and a count also says
whether a commit, clear or ``session.update`` sent around the cut was taken, which no audio offset can.

With several frontends the token starts with its holder's index (``2.…``) and each frontend's HTTP app also
listens on a socket of its own in the server's run folder (:func:`http_socket`); a frontend that gets a
sibling's token relays the WebSocket's messages both ways to it (:func:`relay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import WSMsgType, web

from cosystream.frontend.host import SessionHost
from cosystream.server.auth import Token

log = logging.getLogger(__name__)

REPLAY_EVENTS = 1024
"""Server events a resumable connection keeps after emitting them, to send again after a resume."""
PROGRESS_AUDIO_MS = 1000
"""A resumable connection is told what the server took at least every this much of its audio (and every
:data:`PROGRESS_EVENTS` events), so its client keeps about that much to send again."""
PROGRESS_EVENTS = 32
TAKE_OVER_S = 5.0
"""How long a resume waits for a connection the server has not seen drop to let the session go."""


class Resumable(Protocol):
    """What is held of a resumable connection (``realtime.RealtimeConnection``)."""

    session_id: str
    token: Token | None
    resume_token: str
    received_events: int  # the client's messages taken
    emitted: int  # the server's events, numbered 1, 2, ...
    detached: bool  # no WebSocket carries it
    ended: bool
    closing: tuple[int, str] | None  # (the server is closing it: it ends, it is not held)
    expiry: asyncio.TimerHandle | None
    skip_events: int  # (set by a resume: the client's messages it sends again that the server has)
    replay_from: int  # (set by a resume: the events after this one are sent again)

    def event_index(self, event_id: str) -> int | None: ...

    async def let_go(self, timeout_s: float) -> bool: ...

    def end(self) -> None: ...


class ResumeRefused(Exception):
    """A resume that cannot be honoured: sent as an ``error`` event with ``code``, then the WebSocket closes."""

    def __init__(self, message: str, code: str = "resume_refused"):
        super().__init__(message)
        self.message = message
        self.code = code


def _flag(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


@dataclass(frozen=True, slots=True)
class ResumeRequest:
    """A WebSocket's resume query: ``resume_token``, ``resume_offset_events`` (the count of its own events
    from which the client sends again: the last ``cosystream.session.received`` ``client_events``, or less)
    and ``resume_after_event`` (the ``event_id`` of the last server event it received)."""

    token: str
    offset_events: int
    after_event: str

    @classmethod
    def of(cls, query) -> ResumeRequest | None:
        """The request in ``query`` (None: not a resume); raises :class:`ResumeRefused` for a bad one."""
        token = query.get("resume_token")
        if token is None:
            return None
        offset = query.get("resume_offset_events")
        if offset is None or not offset.isdigit():
            raise ResumeRefused(
                f"resume_offset_events={offset!r}: give the count of your events from which you send again (the "
                "last cosystream.session.received client_events), a whole number >= 0",
                "invalid_value",
            )
        after = query.get("resume_after_event")
        if not after:
            raise ResumeRefused(
                "resume_after_event: give the event_id of the last server event you received", "invalid_value"
            )
        return cls(token, int(offset), after)


def wants_resume(query) -> bool:
    """Whether a new connection asked to be resumable (``?resumable=true``)."""
    return _flag(query.get("resumable"))


class HeldConnections:
    """The resumable Realtime connections of one frontend, by resume token, attached or held."""

    def __init__(self, host: SessionHost):
        self.host = host
        self._connections: dict[str, Resumable] = {}

    @property
    def window_s(self) -> float:
        return self.host.options.resume_window_s

    def add(self, connection: Resumable) -> str:
        """A new resumable connection's token."""
        token = self.host.new_resume_token()
        self._connections[token] = connection
        return token

    def forget(self, connection: Resumable) -> None:
        self._connections.pop(connection.resume_token, None)

    def park(self, connection: Resumable) -> None:
        """``connection``'s WebSocket went away without a close: hold it for the window."""
        connection.expiry = asyncio.get_running_loop().call_later(self.window_s, self._expire, connection)
        log.info(
            "realtime session %s: its connection went away; held %g s for a resume after %d client events "
            "and %d server events",
            connection.session_id,
            self.window_s,
            connection.received_events,
            connection.emitted,
        )

    def _expire(self, connection: Resumable, why: str = "no resume within the window") -> None:
        if connection.detached and not connection.ended:
            self.host.metrics.expired()
            log.info("realtime session %s freed: %s", connection.session_id, why)
            connection.end()

    def expire_all(self, why: str) -> None:
        """Free every held connection now (the server stops)."""
        for connection in list(self._connections.values()):
            self._expire(connection, why)

    async def take(self, request: ResumeRequest, caller: Token | None) -> Resumable:
        """The connection ``request`` names, let go by its old WebSocket (if it still had one), checked for
        ``request``'s offsets and for ``caller`` (None: authentication is off: its owner's token, as gRPC's
        resume); raises :class:`ResumeRefused` saying why not (the connection stays held)."""
        connection = self._connections.get(request.token)
        owner = connection.token if connection is not None else None
        if owner is not None and (caller is None or caller.name != owner.name):
            connection = None  # (another token's session: as if unknown, so a token reveals nothing of it)
        if connection is None or connection.ended or connection.closing is not None:
            raise ResumeRefused(
                "no session to resume with this resume_token: it ended, its resume window passed, or it was never "
                "issued here; open a new session",
                "resume_not_found",
            )
        if not connection.detached:  # (its old WebSocket has not been seen to drop: it is let go)
            if not await connection.let_go(TAKE_OVER_S):
                raise ResumeRefused("the session's old connection did not let it go; retry", "resume_busy")
            if connection.ended:
                raise ResumeRefused("the session ended while it was taken over", "resume_not_found")
        if request.offset_events > connection.received_events:
            raise ResumeRefused(
                f"resume_offset_events={request.offset_events} is past the {connection.received_events} events "
                f"the server took: send your events from event {connection.received_events} (or earlier) on"
            )
        after = connection.event_index(request.after_event)
        if after is None:
            raise ResumeRefused(
                f"resume_after_event={request.after_event!r} is not one of the last {REPLAY_EVENTS} events this "
                "session sent: open a new session"
            )
        # Taken: no await from here on, so no other resume can take it meanwhile.
        if connection.expiry is not None:
            connection.expiry.cancel()
            connection.expiry = None
        connection.detached = False
        connection.skip_events = connection.received_events - request.offset_events
        connection.replay_from = after
        self.host.metrics.resumed()
        log.info(
            "realtime session %s resumed after client event %d (skipping %d) and server event %d (%d sent again)",
            connection.session_id,
            request.offset_events,
            connection.skip_events,
            after,
            connection.emitted - after,
        )
        return connection


def http_socket(peer: str) -> str:
    """The path of the HTTP socket of the frontend whose gRPC socket is ``peer`` (``unix:DIR/frontend-N.sock``):
    beside it, in the server's private run folder."""
    return peer.removeprefix("unix:").removesuffix(".sock") + "-http.sock"


async def relay(
    request: web.Request, ws: web.WebSocketResponse, socket_path: str, headers: dict[str, str]
) -> None:
    """Carry ``ws`` (prepared) to the same resume on the sibling frontend listening on ``socket_path``: its
    messages there, the sibling's back, and a close either way closes the other (the sibling sees a drop as a
    drop, so the session stays held)."""
    url = f"http://localhost{request.path_qs}"
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as client:
        try:
            upstream = await client.ws_connect(url, headers=headers, autoping=True, heartbeat=30.0)
        except (aiohttp.ClientError, OSError) as err:
            log.warning("a resume could not reach the frontend holding its session (%s): %s", socket_path, err)
            raise ResumeRefused(
                "the frontend holding this session is not answering; retry", "resume_busy"
            ) from None
        pipes = {
            asyncio.ensure_future(_pipe(upstream, ws)): "down",
            asyncio.ensure_future(_pipe(ws, upstream)): "up",
        }
        clean = False  # (a close frame either way; else the sibling must see a drop, to hold the session)
        try:
            done, _ = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            clean = any(not task.exception() and task.result() for task in done)
            if not clean and any(pipes[task] == "down" for task in done):
                await ws.close(code=1012, message=b"the frontend holding the session went away; resume again")
        finally:
            for task in pipes:
                task.cancel()
            for task in pipes:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if not clean:  # the client dropped: so does the relay, with no close frame (the sibling holds it)
                sock = upstream.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)


async def _pipe(source, sink) -> bool:
    """Copy ``source``'s messages to ``sink`` until it goes away; True: with a close frame (passed on)."""
    while True:
        message = await source.receive()
        if message.type == WSMsgType.TEXT:
            await sink.send_str(message.data)
        elif message.type == WSMsgType.BINARY:
            await sink.send_bytes(message.data)
        elif message.type == WSMsgType.CLOSE:
            await sink.close(code=message.data, message=(message.extra or "").encode())
            return True
        elif message.type in (WSMsgType.CLOSED, WSMsgType.CLOSING, WSMsgType.ERROR):
            return False
