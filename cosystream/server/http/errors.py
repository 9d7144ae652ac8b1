"""Errors in OpenAI's JSON shape, and the native status codes they come from.

OpenAI's APIs answer ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status; its SDKs
raise ``BadRequestError`` (400), ``AuthenticationError`` (401), ``PermissionDeniedError`` (403),
``RateLimitError`` (429), ``InternalServerError`` (5xx) and so on from them, so code written against them
handles ours the same way.
"""

from __future__ import annotations

import math

import grpc
from aiohttp import web

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for a status: a client's error (4xx) is ``invalid_request_error``, but for
    429's ``rate_limit_error``; the server's (5xx) is ``server_error``."""
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class ApiError(Exception):
    """An error response in OpenAI's shape: raise it from a handler (the app's middleware answers it)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.message, self.status, self.code, self.param)

    def response(self, headers: dict | None = None) -> web.Response:
        """The JSON error; a temporary refusal says when to retry in ``Retry-After`` (whole seconds) and
        ``retry-after-ms``, both of which OpenAI's SDKs honour."""
        if self.retry_after_s is not None:
            headers = {
                **(headers or {}),
                "Retry-After": str(math.ceil(self.retry_after_s)),
                "retry-after-ms": str(math.ceil(self.retry_after_s * 1000)),
            }
        return web.json_response(self.body(), status=self.status, headers=headers)


def from_status(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> ApiError:
    """The HTTP error for a native stream's status (``retry_after_s``: a temporary refusal's delay)."""
    return ApiError(HTTP_STATUS.get(code, 500), message, code.name.lower(), retry_after_s=retry_after_s)
