"""StateImageStorage: every slot holds one request's whole StateImage contiguously.

The device buffer is [slots, image_bytes] bytes; each field of the architecture's
StateImageLayout is exposed as a typed strided view [slots, (steps,) layers, *shape] whose slot
stride is the image size, so ops address a slot through the tensor's actual stride. A Host image
uses the same internal layout (one flat byte buffer, pinned when the device is CUDA), so saving or
restoring a slot is one contiguous copy.
"""

from __future__ import annotations

from collections import deque

import torch

from ninfer.contract.state import StateField, StateImageLayout
from ninfer.core.device import Device, host_empty, torch_dtype
from ninfer.core.kv_pool import PoolExhausted


class StateImageStorage:
    """``num_slots`` contiguous StateImages on one device, with slot allocation."""

    def __init__(self, layout: StateImageLayout, num_slots: int, device: Device) -> None:
        if num_slots < 1:
            raise ValueError(f"StateImageStorage needs at least one slot, got {num_slots}")
        self.layout = layout
        self.device = device
        self.num_slots = num_slots
        self.image_bytes = layout.nbytes_per_slot
        self.buffer = torch.zeros((num_slots, self.image_bytes), dtype=torch.uint8, device=device.torch)
        self._offsets = layout.offsets()
        self._free: deque[int] = deque(range(num_slots))
        self._used: set[int] = set()
        self._views = {f.name: self._make_view(f) for f in layout.fields}

    # -- typed views -------------------------------------------------------------------------------
    def _make_view(self, f: StateField) -> torch.Tensor:
        dtype = torch_dtype(f.dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        typed = self.buffer.view(dtype)  # [slots, image_bytes / elem]; offsets are 256-byte aligned
        copies = self.layout.copies(f)
        start = self._offsets[f.name] // elem
        count = copies * f.layers * (f.nbytes_per_layer // elem)
        inner = (f.layers, *f.shape) if copies == 1 else (copies, f.layers, *f.shape)
        return typed[:, start:start + count].unflatten(1, inner)

    def view(self, name: str) -> torch.Tensor:
        """Field ``name`` for every slot: [slots, layers, *shape] ([slots, steps, layers, *shape] per step)."""
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"StateImage has no field {name!r}; fields: {sorted(self._views)}") from None

    # -- slots -------------------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def allocate(self) -> int:
        if not self._free:
            raise PoolExhausted(f"all {self.num_slots} StateImage slots are in use")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"StateImage slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def zero(self, slot: int) -> None:
        self._check(slot)
        self.buffer[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Whole-image copy (one contiguous copy), e.g. to fork a state."""
        self._check(src)
        self._check(dst)
        self.buffer[dst].copy_(self.buffer[src])

    # -- host images -------------------------------------------------------------------------------
    def host_image(self) -> torch.Tensor:
        """An empty Host image of the same layout (pinned when the device is CUDA)."""
        return host_empty(self.image_bytes, torch.uint8, self.device)

    def save(self, slot: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy slot's image to host memory; returns the host image (complete when this returns)."""
        self._check(slot)
        out = self.host_image() if out is None else out
        out.copy_(self.buffer[slot])
        return out

    def restore(self, slot: int, image: torch.Tensor) -> None:
        """Copy a host image (same layout) into ``slot``."""
        self._check(slot)
        if image.dtype != torch.uint8 or image.numel() != self.image_bytes:
            raise ValueError(f"host image has {image.numel()} {image.dtype} elements, expected "
                             f"{self.image_bytes} uint8")
        self.buffer[slot].copy_(image)

    def _check(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"StateImage slot {slot} is not allocated")
