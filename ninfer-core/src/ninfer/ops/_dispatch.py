"""Choosing an op's implementation: the pure-torch reference, or a validated Triton kernel on CUDA.

Every op module ``ninfer.ops.<module>`` has a reference ``<name>_ref`` that runs anywhere. A Triton
kernel with the same signature lives in ``ninfer.ops.triton.<module>``; it is used for CUDA tensors
only once its name is listed in ``TRITON_OPS`` (added after it passes ``scripts/gpu-check``), so
enabling a kernel is a one-line edit here. The Triton module is imported lazily, on first use, so
importing ``ninfer.ops`` never imports triton.

``NINFER_OPS=torch`` forces the references everywhere (debugging, kernel comparisons).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# "module.name" of every Triton kernel validated on the GPU.
TRITON_OPS: frozenset[str] = frozenset({
})


def references_forced() -> bool:
    return os.environ.get("NINFER_OPS", "").strip().lower() == "torch"


@functools.cache
def _load(module: str, name: str) -> Callable:
    return getattr(importlib.import_module(f"ninfer.ops.triton.{module}"), name)


def triton_kernel(module: str, name: str, tensor: torch.Tensor) -> Callable | None:
    """The validated Triton kernel for ``module.name`` when ``tensor`` is on CUDA, else None."""
    if tensor.device.type != "cuda" or f"{module}.{name}" not in TRITON_OPS or references_forced():
        return None
    return _load(module, name)
