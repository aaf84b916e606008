"""OpenAI-style error objects and the mapping from engine rejections to HTTP statuses."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one SSE event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPES = {400: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
          500: "internal_server_error"}


def from_engine_error(exc: BaseException, *, retry_after_s: int = 1) -> APIError:
    """Map an engine error onto an APIError by its ``http_status`` and ``kind`` (ninfer.engine.errors).

    Overload answers 429 and a queue timeout 503, both with Retry-After; invalid and too-long input 400;
    a closed engine 503; a failed engine and anything unexpected 500.
    """
    status = getattr(exc, "http_status", 500)
    kind = getattr(exc, "kind", None)
    message = str(exc) or type(exc).__name__
    if kind == "engine_failed":
        message = f"the engine has failed and accepts no more work: {message}"
    elif status == 500 and kind in (None, "internal"):
        message = f"internal error: {message}"
    headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
    return APIError(status, message, type=_TYPES.get(status, "internal_server_error"), code=kind, headers=headers)


def from_error_result(message: str | None, kind: str | None) -> APIError:
    """An APIError for a final ``GenerationResult`` with ``finish_reason=ERROR`` (kind in ``extra``)."""
    from ninfer.engine import errors as engine_errors

    by_kind = {cls.kind: cls for cls in (engine_errors.QueueTimeout, engine_errors.Overloaded,
                                         engine_errors.InputTooLong, engine_errors.Unrepresentable,
                                         engine_errors.EngineFailed, engine_errors.EngineClosed,
                                         engine_errors.CapacityExhausted)}
    cls = by_kind.get(kind or "", engine_errors.EngineError)
    return from_engine_error(cls(message or "generation failed"))
