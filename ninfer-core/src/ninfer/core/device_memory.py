"""Memory readings for the startup planner: device snapshots (free, used, what the caching allocator holds) and
the host's available memory. The planner only reads through ``DeviceMemory``, so a test can stand in a fake
allocator (a scripted shortfall) without a GPU.
"""

from __future__ import annotations

import gc

import attrs
import torch

from ninfer.core.device import Device


@attrs.frozen(kw_only=True)
class MemorySnapshot:
    """One reading. ``used``: the device's total less its free memory (every process, driver included);
    ``reserved``: what this process's caching allocator holds (weights, stores, workspaces, graph pools)."""

    free: int
    total: int
    reserved: int

    @property
    def used(self) -> int:
        return self.total - self.free


class DeviceMemory:
    """Reads one device. A CPU device has nothing to read (``snapshot`` is None): the plan is arithmetic alone."""

    def __init__(self, device: Device) -> None:
        self.device = device

    @property
    def measures(self) -> bool:
        return self.device.is_cuda

    def settle(self) -> None:
        """Finish queued work and return cached blocks, so a snapshot sees what is really held."""
        gc.collect()  # graphs and Programs hold reference cycles (bound methods)
        if self.device.is_cuda:
            torch.cuda.synchronize(self.device.torch)
            torch.cuda.empty_cache()

    def snapshot(self) -> MemorySnapshot | None:
        if not self.device.is_cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.device.torch)
        return MemorySnapshot(free=free, total=total, reserved=torch.cuda.memory_reserved(self.device.torch))

    def reset_peak(self) -> None:
        if self.device.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device.torch)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device.torch) if self.device.is_cuda else 0


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
