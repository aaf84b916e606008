"""Programmatic dependent launch (Hopper and newer), for every kernel in this package.

A kernel launched with it may be scheduled while the previous kernel in the stream is still finishing. It
first waits (``griddepcontrol.wait``) until that kernel has completed and its writes are visible, so it
reads and writes nothing early; then it lets its own successor be scheduled. What this saves is the gap
between back-to-back small kernels (launch processing, CTA ramp-up), which is most of a small model's decode
step: 0.8B runs ~330 kernels per token. Waiting is transitive (each kernel waited for its predecessor), so
kernels launched without it (torch's, fla's) keep plain stream order around these.

Off by default until ``scripts/gpu-pending pdl`` validates it on the device: ``NINFER_PDL=1`` (read at
import) or ``ENABLED = True`` turns it on. The Triton interpreter (CPU) never sees it.
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("NINFER_PDL", "").strip() == "1"
# Weight tiles per program the few-row linear hints into L2 before its wait (NINFER_PDL_PREFETCH to measure).
PREFETCH_TILES = int(os.environ.get("NINFER_PDL_PREFETCH", "2"))


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``USE_PDL`` constexpr: on when enabled and the device has it."""
    if ENABLED and device.type == "cuda" and _capable(device.index if device.index is not None
                                                      else torch.cuda.current_device()):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
