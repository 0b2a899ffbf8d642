"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; the error middleware (gateway/server.py) turns it, and
any aiohttp HTTP exception, into this envelope. Messages never carry tracebacks
and never echo user input beyond a short, truncated excerpt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from aiohttp import web

from gateway.backend import BackendError, BackendErrorKind

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """An error answered in OpenAI's envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        reason: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param[:64] if param else param  # never echo a huge field name
        self.code = code
        self.headers = dict(headers or {})
        # Label for llm_requests_rejected_total; None: not counted as a rejection.
        self.reason = reason
        self.close = close  # close the connection after the answer (e.g. a body that never came)

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        resp = web.Response(
            status=self.status,
            body=json.dumps(self.body()).encode(),
            content_type="application/json",
            headers=self.headers,
        )
        if self.close:
            resp.force_close()
        return resp


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    """400 naming the offending parameter."""
    return APIError(400, message, param=param, code=code or "invalid_value", reason="invalid")


def unavailable(message: str, code: str, retry_after: float | None, reason: str) -> APIError:
    """503 with Retry-After (whole seconds, at least 1)."""
    seconds = max(1, math.ceil(retry_after)) if retry_after is not None else 1
    return APIError(503, message, code=code, headers={"Retry-After": str(seconds)}, reason=reason)


def from_backend(err: BackendError, retry_after_s: float) -> APIError:
    """Map a BackendError raised before the first event to an HTTP error."""
    retry = err.retry_after if err.retry_after is not None else retry_after_s
    if err.kind is BackendErrorKind.NO_WORKERS:
        return unavailable(err.message, "no_workers", retry, "no_workers")
    if err.kind is BackendErrorKind.OVERLOADED:
        return unavailable(err.message, "overloaded", retry, "backend_overloaded")
    if err.kind is BackendErrorKind.TIMEOUT:
        return APIError(504, err.message, code="timeout", reason="timeout")
    if err.kind is BackendErrorKind.INVALID:
        return APIError(400, err.message, code="invalid_request", reason="invalid")
    return APIError(500, err.message, code="backend_failed", reason="backend_failed")


def excerpt(value: object, limit: int = 64) -> str:
    """A short printable rendering of user input for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
