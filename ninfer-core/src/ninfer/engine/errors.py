"""Engine errors. Request-level rejections carry a ``kind`` the gateway maps to an HTTP status.

``is_fatal`` sorts what a worker step raised (docs/engine.md, "Failure"): a broken invariant, a device error
or an interpreter exit fails the engine; anything else ends only the requests the step concerned
(``request_failure``: ``MemoryExhausted`` when memory ran out, else ``RequestFailed``).
"""

from __future__ import annotations

import sys

from ninfer.contract.batch import PendingBatchError


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


class InvariantBroken(RuntimeError):
    """Engine-internal state contradicts itself; the engine fails (never read as a cache miss)."""


# Texts of RuntimeErrors that report an exhausted allocator (torch's CPU allocator, CUDA, cuBLAS).
_MEMORY_TEXTS = ("can't allocate memory", "cannot allocate memory", "out of memory", "cublas_status_alloc_failed")
# Texts of RuntimeErrors a device raises once its context is broken (its state cannot be trusted).
_DEVICE_TEXTS = ("cuda error", "cuda driver error", "device-side assert", "illegal memory access",
                 "cublas_status_execution_failed", "cudnn error", "triton error [cuda]", "unspecified launch failure")


def is_memory_exhaustion(exc: BaseException) -> bool:
    """Host or device memory ran out: recoverable, the memory may come back."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # not imported: no torch error can have been raised
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _MEMORY_TEXTS)


def is_device_error(exc: BaseException) -> bool:
    """The accelerator reported a failure of its own (its memory or kernels may hold anything now)."""
    if is_memory_exhaustion(exc):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.AcceleratorError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _DEVICE_TEXTS)


def is_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` fails the engine: a broken invariant (the engine's, or the Program's PendingBatch
    contract), a device error, or not an ``Exception`` at all (KeyboardInterrupt, SystemExit)."""
    if not isinstance(exc, Exception):
        return True
    return isinstance(exc, InvariantBroken | PendingBatchError | AssertionError) or is_device_error(exc)


def request_failure(request_id: str, stage: str, exc: BaseException) -> RequestFailed:
    """The error that ends one request because ``stage`` raised ``exc`` while serving it. A memory shortage
    names only the exception's type (its client may see the message); other causes carry the text (logged)."""
    if is_memory_exhaustion(exc):
        err: RequestFailed = MemoryExhausted(
            f"request {request_id} ended at {stage}: the server ran out of memory ({type(exc).__name__}); "
            f"retry later", stage=stage)
    else:
        err = RequestFailed(f"request {request_id} failed at {stage}: {type(exc).__name__}: {exc}", stage=stage)
    err.__cause__ = exc
    return err
