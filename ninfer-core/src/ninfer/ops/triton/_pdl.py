"""Programmatic dependent launch (Hopper and newer), for every kernel in this package.

A kernel launched with it may be scheduled while the previous kernel in the stream is still finishing. It
first waits (``griddepcontrol.wait``) until that kernel has completed and its writes are visible, so it
reads and writes nothing early; then it lets its own successor be scheduled. What this saves is the gap
between back-to-back small kernels (launch processing, CTA ramp-up), which dominates a small model's decode
step. Waiting is transitive (each kernel waited for its predecessor), so kernels launched without it
(torch's, fla's) keep plain stream order around these.

It is a per-Program choice: the model's Startup asks ``prefers_pdl`` (it pays for small decoder layers and
costs for large ones; docs/kernels.md has the measurements), and the Program runs its launches, CUDA graph
capture included, inside ``scope(enabled)``. Nothing process-wide changes, so two Programs may differ.
``NINFER_PDL=1`` / ``0`` overrides every model's preference. The Triton interpreter never sees it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch

from ninfer import env

# Below this many weight bytes read per decoder layer and decode step, PDL measured faster (0.8B ~60 MB, the
# 35B-A3B MoE ~173 MB with its k experts), above it slower (9B ~560 MB); docs/kernels.md.
SMALL_LAYER_BYTES = 192 << 20
# Weight tiles per program the few-row linear hints into L2 before its wait: 1 measured faster than 0, 2 or 8 on
# every model that runs PDL (0.8B, the 35B-A3B MoE; docs/kernels.md).
PREFETCH_TILES = 1
# Whether the few-row linear lets its successor be scheduled after its K loop instead of at its start. Off:
# measured as a loss at B=8 (docs/kernels.md); ``benchmarks`` may set it to repeat that experiment.
LATE_TRIGGER = False

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("ninfer_pdl", default=False)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefers_pdl(layer_bytes: float) -> bool:
    """Whether a model whose decode step reads ``layer_bytes`` of weights per decoder layer should launch with
    PDL (``NINFER_PDL`` decides when set)."""
    forced = env.get("NINFER_PDL")
    return forced if forced is not None else layer_bytes < SMALL_LAYER_BYTES


@contextlib.contextmanager
def scope(enabled: bool) -> Iterator[None]:
    """Launches in this block (this thread / task) use PDL when ``enabled`` and the device has it."""
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``USE_PDL`` constexpr: on inside an enabled scope on a capable GPU."""
    if _ACTIVE.get() and device.type == "cuda" and _capable(device.index if device.index is not None
                                                             else torch.cuda.current_device()):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
