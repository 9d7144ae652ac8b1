"""``google.longrunning.Operations`` for Google's ``LongRunningRecognize``: operations kept in memory by the
frontend process that started them.

An operation is a task of this process's event loop and a ``google.longrunning.Operation`` it fills in:
``metadata`` while it runs, then ``response`` or ``error``. Only the token that started an operation sees
it (another gets NOT_FOUND, as for a name never issued). The store is bounded (:class:`OperationLimits`): a
finished operation is forgotten ``retention_s`` after it ended, or earlier when ``max_operations`` are held
(the oldest finished first); when all of those are still running a new one is refused with
RESOURCE_EXHAUSTED.

The name carries the frontend process's id: with ``--frontends N`` the processes share the port, and a
gRPC channel's calls all go to the process its connection landed on, so the official client (which polls
on the channel it started the operation on) finds it; a poll that reaches another process (a new
connection) gets NOT_FOUND saying so. There is no hand-off between processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2

from cosystream.server.auth import current_token
from cosystream.server.compat.bridge import CompatError
from cosystream.server.retry import rich_status

log = logging.getLogger(__name__)

SERVICE_NAME = operations_pb2.DESCRIPTOR.services_by_name["Operations"].full_name
MAX_WAIT_S = 60.0
"""The longest ``WaitOperation`` waits (its ``timeout`` may ask for less)."""


@dataclass(frozen=True, slots=True)
class OperationLimits:
    max_operations: int = 256  # held per frontend process, running and finished
    retention_s: float = 3600.0  # a finished operation is answered for this long after it ended

    def __post_init__(self) -> None:
        if self.max_operations < 1 or self.retention_s <= 0:
            raise ValueError(f"need max_operations >= 1 and retention_s > 0: {self}")


@dataclass(slots=True)
class _Entry:
    operation: operations_pb2.Operation
    owner: str | None  # the token's name (None: no tokens)
    metadata: Message
    task: asyncio.Task | None = None
    ended_s: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _owner() -> str | None:
    token = current_token()
    return None if token is None else token.name


class OperationStore:
    """The operations of this frontend process, and the ``google.longrunning.Operations`` servicer."""

    def __init__(self, limits: OperationLimits = OperationLimits(), clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._entries)

    def _make_room(self) -> None:
        now = self._clock()
        for name, entry in list(self._entries.items()):
            if entry.ended_s is not None and now - entry.ended_s > self.limits.retention_s:
                del self._entries[name]
        if len(self._entries) < self.limits.max_operations:
            return
        finished = next((name for name, entry in self._entries.items() if entry.ended_s is not None), None)
        if finished is None:
            raise CompatError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self._entries)} operations are running on this server process (its limit): "
                "wait for one to finish",
            )
        del self._entries[finished]

    def start(self, metadata: Message, run: Callable[[Message], Awaitable[Message]]) -> _Entry:
        """A new operation running ``run(metadata)`` (which may update ``metadata`` as it goes) as a task;
        its result becomes ``response``, a :class:`CompatError` ``error``. Raises :class:`CompatError`
        (RESOURCE_EXHAUSTED) when the store is full of running operations."""
        self._make_room()
        name = f"cosystream-{self._pid}-{secrets.token_hex(12)}"
        entry = _Entry(operations_pb2.Operation(name=name), _owner(), metadata)
        self._entries[name] = entry
        entry.task = asyncio.get_running_loop().create_task(self._run(entry, run))
        return entry

    def forget(self, entry: _Entry) -> None:
        """Drop an operation the caller never handed out (it was refused before its name was returned)."""
        self._entries.pop(entry.operation.name, None)

    async def _run(self, entry: _Entry, run: Callable[[Message], Awaitable[Message]]) -> None:
        operation = entry.operation
        try:
            operation.response.Pack(await run(entry.metadata))
        except CompatError as err:
            operation.error.CopyFrom(rich_status(err.code, err.message, err.retry_after_s))
        except asyncio.CancelledError:
            operation.error.code, operation.error.message = code_pb2.CANCELLED, "the operation was cancelled"
        except Exception:
            log.exception("operation %s failed", operation.name)
            operation.error.code, operation.error.message = code_pb2.INTERNAL, "the operation failed on the server"
        finally:
            operation.done = True
            entry.ended_s = self._clock()
            entry.done.set()

    def snapshot(self, entry: _Entry) -> operations_pb2.Operation:
        operation = operations_pb2.Operation()
        operation.CopyFrom(entry.operation)
        operation.metadata.Pack(entry.metadata)
        return operation

    async def _find(self, name: str, context: grpc.aio.ServicerContext) -> _Entry:
        entry = self._entries.get(name)
        if entry is not None and entry.owner == _owner():
            return entry
        pid = name.split("-")[1] if name.startswith("cosystream-") and name.count("-") == 2 else ""
        if pid and pid != str(self._pid):
            message = (
                f"operation {name!r} is not held by this server process: operations are kept by the frontend "
                "process that started them; poll on the channel that started it (one connection), or serve "
                "with --frontends 1"
            )
        else:
            message = f"operation {name!r} not found (finished operations are kept {self.limits.retention_s:g} s)"
        await context.abort(grpc.StatusCode.NOT_FOUND, message)

    async def GetOperation(self, request, context):
        return self.snapshot(await self._find(request.name, context))

    async def ListOperations(self, request, context):
        """This token's operations, oldest first; ``filter`` is ignored; ``page_token`` is an offset."""
        owner = _owner()
        mine = [entry for entry in self._entries.values() if entry.owner == owner]
        try:
            start = int(request.page_token or 0)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_token {request.page_token!r} is not ours")
        size = request.page_size if request.page_size > 0 else len(mine)
        response = operations_pb2.ListOperationsResponse(
            operations=[self.snapshot(entry) for entry in mine[start : start + size]]
        )
        if start + size < len(mine):
            response.next_page_token = str(start + size)
        return response

    async def CancelOperation(self, request, context):
        """Ends a running operation (its session too); its ``error`` becomes CANCELLED."""
        entry = await self._find(request.name, context)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await entry.done.wait()
        return empty_pb2.Empty()

    async def DeleteOperation(self, request, context):
        """Forgets an operation, cancelling it first if it still runs."""
        entry = await self._find(request.name, context)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await entry.done.wait()
        self._entries.pop(request.name, None)
        return empty_pb2.Empty()

    async def WaitOperation(self, request, context):
        """The operation once done, or as it is after ``timeout`` (at most :data:`MAX_WAIT_S`)."""
        entry = await self._find(request.name, context)
        wait_s = MAX_WAIT_S
        if request.HasField("timeout"):
            wait_s = min(wait_s, max(0.0, request.timeout.ToTimedelta().total_seconds()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(entry.done.wait(), wait_s)
        return self.snapshot(entry)

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        def unary(method, request_type, response_type):
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=request_type.FromString,
                response_serializer=response_type.SerializeToString,
            )

        ops = operations_pb2
        return {
            "GetOperation": unary(self.GetOperation, ops.GetOperationRequest, ops.Operation),
            "ListOperations": unary(self.ListOperations, ops.ListOperationsRequest, ops.ListOperationsResponse),
            "CancelOperation": unary(self.CancelOperation, ops.CancelOperationRequest, empty_pb2.Empty),
            "DeleteOperation": unary(self.DeleteOperation, ops.DeleteOperationRequest, empty_pb2.Empty),
            "WaitOperation": unary(self.WaitOperation, ops.WaitOperationRequest, ops.Operation),
        }
