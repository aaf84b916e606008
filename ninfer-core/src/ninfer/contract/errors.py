"""Errors that cross the contracts: what an implementation raises for the engine to map onto its request
rejections, and the engine's public error family (``EngineError``: each rejection carries the ``kind`` and
``http_status`` a gateway answers with). Shared model parts raise these without importing the engine;
``ninfer.engine.errors`` re-exports them."""

from __future__ import annotations


class PromptTooLong(ValueError):
    """The prompt has more than the ``max_tokens`` the engine passed to ``Frontend.prepare``.

    ``tokens`` is the prompt's length, or a lower bound on it when ``exact`` is False (the Frontend rejected
    the prompt without tokenizing all of it); ``limit`` is the ``max_tokens`` it exceeds.
    """

    def __init__(self, *, tokens: int, limit: int, exact: bool, detail: str = "") -> None:
        self.tokens, self.limit, self.exact, self.detail = tokens, limit, exact, detail
        amount = f"{tokens}" if exact else f"at least {tokens}"
        super().__init__(f"the prompt has {amount} tokens{detail}; at most {limit} fit")


class NoRoomToScore(RuntimeError):
    """A scoring window found no free state slot or too few free KV pages (generation holds them for now)."""


class EngineError(Exception):
    """Base of every error the public Engine raises or reports."""

    kind = "internal"
    http_status = 500


class RequestRejected(EngineError):
    """The request was refused; the engine itself is healthy."""

    kind = "invalid"
    http_status = 400


class Overloaded(RequestRejected):
    """Every outstanding-request place is taken; retry later."""

    kind = "overload"
    http_status = 429


class QueueTimeout(RequestRejected):
    """The request waited longer than its queue timeout without being admitted."""

    kind = "queue_timeout"
    http_status = 503


class InputTooLong(RequestRejected):
    """The prompt leaves no room for one generated token within the context limit."""

    kind = "too_long"
    http_status = 400


class Unrepresentable(RequestRejected):
    """The request cannot be expressed for this model (bad template, tokens, media or parameters)."""

    kind = "invalid"
    http_status = 400


class VisionNotEnabled(Unrepresentable):
    """The request carries images or videos and the model was started without the vision feature."""

    kind = "vision_not_enabled"
    http_status = 400


class InvalidConstraint(RequestRejected):
    """The request's constraint does not compile (schema, regex, grammar or tool choice); the message says why."""

    kind = "invalid_constraint"
    http_status = 400


class RequestCancelled(RequestRejected):
    """The caller's ``cancel`` event was set while ``submit`` prepared the request (its constraint compiled);
    the preparation was abandoned and nothing was queued."""

    kind = "cancelled"
    http_status = 499  # the client closed the request (nginx's code); nobody reads the answer


class EngineFailed(EngineError):
    """An internal invariant broke or the device failed; every response ends with this error."""

    kind = "engine_failed"
    http_status = 500


class EngineClosed(EngineError):
    """The engine was shut down and accepts no new work."""

    kind = "closed"
    http_status = 503


class CapacityExhausted(EngineError):
    """The request alone needs more KV/state than the Program has; it ends with an error."""

    kind = "capacity"
    http_status = 500


class RequestFailed(EngineError):
    """This request alone could not continue (its output could not be interpreted, a step serving it raised);
    the engine is healthy. ``stage``: where it failed (docs/engine.md, "Failure")."""

    kind = "request_failed"
    http_status = 500

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class MemoryExhausted(RequestFailed):
    """Host or device memory ran out while serving this request; it ended, the engine goes on (retry later)."""

    kind = "memory_exhausted"
    http_status = 503
