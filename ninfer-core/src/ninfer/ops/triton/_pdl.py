"""Programmatic dependent launch (Hopper and newer), for every kernel in this package.

A kernel launched with it may be scheduled while the previous kernel in the stream is still finishing. It
first waits (``griddepcontrol.wait``) until that kernel has completed and its writes are visible, so it
reads and writes nothing early; then it lets its own successor be scheduled. What this saves is the gap
between back-to-back small kernels (launch processing, CTA ramp-up), which is most of a small model's decode
step: 0.8B runs ~330 kernels per token. Waiting is transitive (each kernel waited for its predecessor), so
kernels launched without it (torch's, fla's) keep plain stream order around these.

On the H200 (docs/performance.md, session 4) it is bit-identical to launching without it, and it pays only for
small layers: 0.8B decode (~60 MB of weights per layer, 3-7 us kernels) went from 873 to 983 tokens/s at B=1,
while 9B (~600 MB per layer, 10-50 us kernels) lost 3-4 % (217.5 -> 211.5 tokens/s). So a model asks for it
at startup through ``prefer_for_layer_bytes``; ``NINFER_PDL=1`` / ``0`` (read at import) overrides that
choice either way. The setting is per process (one resident model). The Triton interpreter never sees it.
"""

from __future__ import annotations

import functools
import os

import torch

_FORCED = {"1": True, "0": False}.get(os.environ.get("NINFER_PDL", "").strip())
ENABLED = bool(_FORCED)  # what launches use now: the model's preference, or the environment's override
# Below this many weight bytes per decoder layer PDL measured faster (0.8B, ~60 MB), above it slower (9B, ~600 MB).
SMALL_LAYER_BYTES = 128 << 20
# Weight tiles per program the few-row linear hints into L2 before its wait (NINFER_PDL_PREFETCH to measure).
PREFETCH_TILES = int(os.environ.get("NINFER_PDL_PREFETCH", "2"))
# The few-row linear lets its successor be scheduled after its K loop rather than at its start (an experiment:
# early-placed successor programs may unbalance long bandwidth-bound kernels; NINFER_PDL_LATE=1 to measure).
LATE_TRIGGER = os.environ.get("NINFER_PDL_LATE", "").strip() == "1"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``USE_PDL`` constexpr: on when enabled and the device has it."""
    if ENABLED and device.type == "cuda" and _capable(device.index if device.index is not None
                                                      else torch.cuda.current_device()):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


def prefer_for_layer_bytes(layer_bytes: float) -> bool:
    """Turn PDL on for models whose decoder layers hold fewer than SMALL_LAYER_BYTES of weights (unless
    NINFER_PDL says otherwise); call before capturing CUDA graphs. Returns the setting now in force."""
    global ENABLED
    ENABLED = _FORCED if _FORCED is not None else layer_bytes < SMALL_LAYER_BYTES
    return ENABLED
