"""Choosing an op's implementation: the pure-torch reference, or a validated Triton kernel on CUDA.

Every op module ``ninfer.ops.<module>`` has a reference ``<name>_ref`` that runs anywhere. A Triton
kernel with the same signature lives in ``ninfer.ops.triton.<module>``; it is used for CUDA tensors
only once its name is listed in ``TRITON_OPS`` (added after it passes ``scripts/gpu-check``), so
enabling a kernel is a one-line edit here. The Triton module is imported lazily, on first use, so
importing ``ninfer.ops`` never imports triton.

``NINFER_OPS=torch`` forces the references everywhere (debugging, kernel comparisons);
``NINFER_OPS=triton`` uses every Triton kernel that exists, listed or not (to try kernels end to end
before listing them).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from ninfer import env

if TYPE_CHECKING:
    import torch

# "module.name" of every Triton kernel validated on the GPU.
TRITON_OPS: frozenset[str] = frozenset({
    # scripts/gpu-check on an H200, 2026-11-29: all rows within tolerance at Qwen3.5-9B shapes (docs/kernels.md).
    "norm.rms_norm", "norm.rms_norm_gated", "activation.silu_and_mul", "rope.apply_rope",
    "gdn.gdn_gates", "gdn.gdn_decode", "gdn.gdn_prefill",
    "conv1d.causal_conv1d_decode", "conv1d.causal_conv1d_prefill",
    "attention.write_kv", "attention.paged_attention",
    # scripts/gpu-pending kernels, 2026-11-29 (session 2): 140/140 rows, faster than the sequences they replace
    # (add_rms_norm 1.6 vs 2.3 us at B=1; gdn_decode_fused 6.5 vs 9.6 us at B=1, 18.3 vs 18.6 us at B=8).
    "norm.add_rms_norm", "gdn.gdn_decode_fused",
    # scripts/gpu-pending linear, 2026-11-29 (session 3): 316/316 rows at 9B, 271/271 at 0.8B shapes; with the
    # measured configurations 11.3-47.3 us vs cuBLAS 12.9-48.0 us at 9B, 4.8 vs 12.9 us for 0.8B's [1024x2048].
    "linear.linear",
    # scripts/gpu-pending fused, 2026-11-29 (session 3): 23/23 rows; swiglu 47.7 vs 49.0 us unfused at B=1 (bitwise
    # equal to it), gated attention 10.6 vs 15.2 us at B=1 ctx 1k; 9B B=1 217.5 tok/s with both.
    "linear.swiglu", "attention.paged_attention_gated",
    # scripts/gpu-pending fuse2, 2026-11-29 (session 4): 67/67 rows at 9B, 15/15 at 0.8B shapes. norm_rope_write_kv
    # 2.7 vs 13.1 us for the five kernels it replaces (0.8B, N=1), bitwise equal to them at N=1 and 8; greedy
    # bitwise equal to torch.argmax (ties, NaN, -inf, -0.0), 4.6 vs 9.7 us for one fp32 248320-wide row.
    "attention.norm_rope_write_kv", "sampling.greedy",
})


def _mode() -> str:
    return env.get("NINFER_OPS")


def references_forced() -> bool:
    return _mode() == "torch"


@functools.cache
def _load(module: str, name: str) -> Callable:
    return getattr(importlib.import_module(f"ninfer.ops.triton.{module}"), name)


def triton_kernel(module: str, name: str, tensor: torch.Tensor) -> Callable | None:
    """The validated Triton kernel for ``module.name`` when ``tensor`` is on CUDA, else None."""
    if tensor.device.type != "cuda":
        return None
    mode = _mode()
    if mode == "torch":
        return None
    if f"{module}.{name}" in TRITON_OPS:
        return _load(module, name)
    if mode == "triton":
        try:
            return _load(module, name)
        except (ImportError, AttributeError):  # no kernel written for this op
            return None
    return None
