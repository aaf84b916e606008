"""SwiGLU activation over a fused [gate | up] projection output."""

from __future__ import annotations

import torch

from ninfer.ops.dispatch import triton_kernel


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[..., 2I] -> silu(x[..., :I]) * x[..., I:]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {tuple(x.shape)}")
    kernel = triton_kernel("activation", "silu_and_mul", x)
    if kernel is not None:
        return kernel(x)
    return silu_and_mul_ref(x)
