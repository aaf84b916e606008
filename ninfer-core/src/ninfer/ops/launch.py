"""How a Program's Triton kernels launch: programmatic dependent launch, and the arrival counters it owns.

PDL (Hopper and newer): a kernel launched with it may be scheduled while the previous kernel in the stream is
still finishing. It first waits (``griddepcontrol.wait``) until that kernel has completed and its writes are
visible, so it reads and writes nothing early; then it lets its own successor be scheduled. What this saves is
the gap between back-to-back small kernels (launch processing, CTA ramp-up), which dominates a small model's
decode step. Waiting is transitive (each kernel waited for its predecessor), so kernels launched without it
(torch's, fla's) keep plain stream order around these. It is a per-Program choice: the model's Startup asks
``prefers_pdl`` (it pays for small decoder layers and costs for large ones; docs/kernels.md has the
measurements). ``NINFER_PDL=1`` / ``0`` overrides every model's preference. The Triton interpreter never sees it.

Arrival counters: kernels whose last-arriving program finishes a shared piece of work (split-K linear, greedy
sampling, the fused GDN step, the one-token MoE block) count arrivals in an int32 buffer, all zero between
launches (each kernel's last arrival resets its counter). Launches on one stream never overlap, so every such
kernel of one owner can use the same buffer. ``Arrivals`` holds them for one owner, the Program: outgrown
buffers are kept while it lives (a captured CUDA graph may still point at them) and go with it, or with
``release()`` once its graphs are gone.

A Program runs its launches, CUDA graph capture included, inside ``scope(pdl, arrivals)``. Nothing
process-wide changes, so two Programs may differ. Launches outside any scope (tests, one-kernel benchmarks)
use no PDL and a process-wide ``Arrivals``.
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
_MIN_COUNTERS = 1024


class Arrivals:
    """The arrival counter buffers of one owner, one list per device (the newest, largest, is in use)."""

    def __init__(self) -> None:
        self._held: dict[torch.device, list[torch.Tensor]] = {}

    def counters(self, device: torch.device, n: int) -> torch.Tensor:
        """A zeroed int32 counter buffer of at least ``n`` entries on ``device``."""
        held = self._held.setdefault(device, [])
        if not held or held[-1].numel() < n:
            held.append(torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device))
        return held[-1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for held in self._held.values() for t in held)

    def release(self) -> None:
        """Free every buffer (call once no captured graph uses them); later launches allocate afresh."""
        self._held.clear()


_UNSCOPED = Arrivals()  # launches outside any owner's scope
_PDL: contextvars.ContextVar[bool] = contextvars.ContextVar("ninfer_pdl", default=False)
_ARRIVALS: contextvars.ContextVar[Arrivals | None] = contextvars.ContextVar("ninfer_arrivals", default=None)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefers_pdl(layer_bytes: float) -> bool:
    """Whether a model whose decode step reads ``layer_bytes`` of weights per decoder layer should launch with
    PDL (``NINFER_PDL`` decides when set)."""
    forced = env.get("NINFER_PDL")
    return forced if forced is not None else layer_bytes < SMALL_LAYER_BYTES


@contextlib.contextmanager
def scope(pdl: bool, arrivals: Arrivals | None = None) -> Iterator[None]:
    """Launches in this block (this thread / task) use PDL when ``pdl`` and the device has it, and count
    arrivals in ``arrivals`` (the process-wide buffers when None)."""
    pdl_token, arrivals_token = _PDL.set(pdl), _ARRIVALS.set(arrivals)
    try:
        yield
    finally:
        _ARRIVALS.reset(arrivals_token)
        _PDL.reset(pdl_token)


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``USE_PDL`` constexpr: on inside an enabled scope on a capable GPU."""
    if _PDL.get() and device.type == "cuda" and _capable(device.index if device.index is not None
                                                         else torch.cuda.current_device()):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """The current scope's zeroed int32 counter buffer of at least ``n`` entries on ``device``."""
    return (_ARRIVALS.get() or _UNSCOPED).counters(device, n)
