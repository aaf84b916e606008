"""Arrival counters for kernels whose last-arriving program finishes a shared piece of work.

One int32 buffer per device, all zero between launches: each kernel's last arrival resets its counter.
Launches on one stream never overlap, so every such kernel can use the same buffer. Outgrown buffers
are kept, not freed: a captured CUDA graph may still point at them.
"""

from __future__ import annotations

import torch

_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 counter buffer of at least ``n`` entries on ``device``."""
    held = _ARRIVALS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return held[-1]
