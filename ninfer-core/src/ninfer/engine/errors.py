"""Engine errors. Request-level rejections carry a ``kind`` the gateway maps to an HTTP status; the error family
itself lives in ``ninfer.contract.errors`` (shared model parts raise it without importing the engine).

``is_fatal`` sorts what a worker step raised (docs/engine.md, "Failure"): a broken invariant, a device error
or an interpreter exit fails the engine; anything else ends only the requests the step concerned
(``request_failure``: ``MemoryExhausted`` when memory ran out, else ``RequestFailed``).
"""

from __future__ import annotations

import sys

from ninfer.contract.batch import PendingBatchError
from ninfer.contract.errors import (  # noqa: F401  (re-exported: the engine's public error family)
    CapacityExhausted,
    EngineClosed,
    EngineError,
    EngineFailed,
    InputTooLong,
    InvalidConstraint,
    MemoryExhausted,
    Overloaded,
    QueueTimeout,
    RequestCancelled,
    RequestFailed,
    RequestRejected,
    Unrepresentable,
    VisionNotEnabled,
)


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
