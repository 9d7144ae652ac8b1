"""How a session ends or is refused, in the frontend's own terms: a transport maps :class:`Status` to its own
(gRPC's status codes and ``google.rpc.Code`` share its values; HTTP adapters pick a status per code)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Status(IntEnum):
    """A session's end; the values are the canonical RPC codes (``google.rpc.Code``)."""

    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14


@dataclass(frozen=True, slots=True)
class Ended:
    """A session's end other than OK: why, and when to retry a temporary refusal (None: not temporary)."""

    status: Status
    message: str
    retry_after_s: float | None = None


class Refused(Exception):
    """A stream refused before it has a session, or by its token's quotas: its status, and the metrics'
    reject reason (None: not counted)."""

    def __init__(
        self,
        status: Status,
        message: str,
        reason: str | None = "invalid_argument",
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.reason, self.retry_after_s = status, message, reason, retry_after_s

    @property
    def ended(self) -> Ended:
        return Ended(self.status, self.message, self.retry_after_s)


def draining() -> Refused:
    return Refused(Status.UNAVAILABLE, "the server is shutting down; retry on another one", "draining")
