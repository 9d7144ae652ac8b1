"""A refusal's retry delay as gRPC's rich error model carries it: ``google.rpc.RetryInfo``.

A status whose refusal is temporary (a token's audio quota) carries, in the trailing metadata
``grpc-status-details-bin``, a ``google.rpc.Status`` with one ``RetryInfo`` detail (its ``retry_delay``),
as Google's APIs send it; ``grpc_status.rpc_status.from_call(call)`` reads it on the client, as does
``cosystream.v1.client.retry_after_s``. The native stream's last response says the same in
``StreamError.retry_delay_ms``, the HTTP port in ``Retry-After``.
"""

from __future__ import annotations

import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from cosystream.v1.client import DETAILS_KEY


def rich_status(code: grpc.StatusCode, message: str, retry_after_s: float | None) -> status_pb2.Status:
    """``google.rpc.Status`` of ``code``, with a ``RetryInfo`` detail unless ``retry_after_s`` is None."""
    status = status_pb2.Status(code=code.value[0], message=message)
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(math.ceil(max(0.0, retry_after_s) * 1000))
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        status.details.append(detail)
    return status


def retry_metadata(code: grpc.StatusCode, message: str, retry_after_s: float | None) -> tuple:
    """The trailing metadata of a status ``code`` that may be retried after ``retry_after_s`` (None: ())."""
    if retry_after_s is None:
        return ()
    return ((DETAILS_KEY, rich_status(code, message, retry_after_s).SerializeToString()),)
