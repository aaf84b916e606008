"""OpenAI-style error objects and the mapping from engine rejections to HTTP statuses.

Error bodies are ASCII JSON (non-ASCII text, lone surrogates included, is escaped), so an error that
echoes a client's text always encodes. A 5xx body never carries internal exception text: it names a
request id, and the details go to the log under that id.
"""

from __future__ import annotations

import json
import logging
import uuid

from starlette.responses import JSONResponse

from ninfer.contract import errors as engine_errors
from ninfer.contract.errors import EngineError
from ninfer.contract.values import JSON, JSONObject

log = logging.getLogger("ninfer_serve")


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


class ErrorResponse(JSONResponse):
    """A JSON response whose body is always encodable: every non-ASCII character is escaped."""

    def render(self, content: JSON) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


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

    def body(self) -> JSONObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one SSE event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body(), ensure_ascii=True)}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPES = {400: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
          500: "internal_server_error"}

# What a client is told for a 5xx, by engine error kind; the engine's own message goes to the log.
_SERVER_SIDE = {"engine_failed": "the engine has failed and accepts no more work",
                "capacity": "the request needs more KV cache or state than this server has",
                "request_failed": "the request could not be completed"}


def internal_error(request_id: str, *, code: str | None = "internal_error", what: str = "internal error") -> APIError:
    """The 500 a client sees: what happened in general terms and the id the log has the details under."""
    return APIError(500, f"{what} (request id {request_id}; the server log has the details)",
                    type="internal_server_error", code=code)


def from_engine_error(exc: BaseException, *, request_id: str, retry_after_s: int = 1) -> APIError:
    """Map an engine error onto an APIError by its ``http_status`` and ``kind`` (ninfer.contract.errors).

    Overload answers 429 and a queue timeout 503, both with Retry-After; invalid and too-long input 400;
    a closed engine 503; a request that ended because memory ran out 503 with Retry-After (its message names
    the stage and the exception's type only); a failed engine and anything unexpected 500 (logged, never echoed).
    """
    status, kind = (exc.http_status, exc.kind) if isinstance(exc, EngineError) else (500, None)
    if status >= 500 and status != 503:
        log.error("request %s failed (%s): %s: %s", request_id, kind, type(exc).__name__, exc)
        if kind in _SERVER_SIDE:
            return internal_error(request_id, code=kind, what=_SERVER_SIDE[kind])
        return internal_error(request_id)
    message = str(exc) or type(exc).__name__
    headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
    return APIError(status, message, type=_TYPES.get(status, "invalid_request_error"), code=kind, headers=headers)


def from_error_result(message: str | None, kind: str | None, *, request_id: str) -> APIError:
    """An APIError for a final ``GenerationResult`` with ``finish_reason=ERROR`` (kind in ``extra``)."""
    by_kind = {cls.kind: cls for cls in (engine_errors.QueueTimeout, engine_errors.Overloaded,
                                         engine_errors.InputTooLong, engine_errors.Unrepresentable,
                                         engine_errors.EngineFailed, engine_errors.EngineClosed,
                                         engine_errors.CapacityExhausted, engine_errors.RequestFailed,
                                         engine_errors.MemoryExhausted)}
    cls = by_kind.get(kind or "", engine_errors.EngineError)
    return from_engine_error(cls(message or "generation failed"), request_id=request_id)
