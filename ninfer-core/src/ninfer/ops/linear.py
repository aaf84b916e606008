"""Dense projections y = x @ weight.T (weight [N, K], as stored by Hugging Face and the artifact).

Decode multiplies a few rows by every weight of the model once per step, so its speed is the speed
of reading the weights. cuBLAS (``F.linear``) is the reference and the path for many rows; a Triton
kernel for few rows (``ninfer.ops.triton.linear``) is used once validated and listed (``_dispatch``).
A quantized weight format will dispatch here as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops._dispatch import triton_kernel
from ninfer.ops.activation import silu_and_mul, silu_and_mul_ref


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N] in x.dtype."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    kernel = triton_kernel("linear", "linear", x)
    if kernel is not None:
        return kernel(x, weight)
    return linear_ref(x, weight)



def swiglu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(linear_ref(x, weight))


def swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(linear(x, weight)) for weight [2I, K] = [gate; up] stacked: the MLP's first half, [..., I].
    On the GPU, few rows run it as one kernel (the activation is the projection's epilogue)."""
    if weight.dim() != 2 or weight.shape[0] % 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"swiglu: input {tuple(x.shape)} does not match a [gate; up] weight {tuple(weight.shape)}")
    kernel = triton_kernel("linear", "swiglu", x)
    if kernel is not None:
        return kernel(x, weight)
    return silu_and_mul(linear(x, weight))
