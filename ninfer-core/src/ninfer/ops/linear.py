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


# Projections with their input's last elementwise op fused in (few rows on the GPU: one kernel instead of two,
# and the input is never written out). Each equals the composition of the public ops it replaces.

def linear_silu_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear_ref(silu_and_mul_ref(x), weight)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(silu_and_mul(x), weight) for x [..., 2K] = [gate | up] (the MLP's down projection)."""
    if weight.dim() != 2 or x.shape[-1] != 2 * weight.shape[1]:
        raise ValueError(f"linear_silu_mul: input {tuple(x.shape)} is not [gate | up] for weight "
                         f"{tuple(weight.shape)}")
    kernel = triton_kernel("linear", "linear_silu_mul", x)
    if kernel is not None:
        return kernel(x, weight)
    return linear(silu_and_mul(x), weight)


def linear_sigmoid_gate_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear_ref((x * torch.sigmoid(gate)).flatten(-2), weight)


def linear_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear((x * sigmoid(gate)) flattened over its last two dims, weight) for x, gate [..., heads, D]
    (attention's output gate before o_proj; gate may be a strided per-head slice)."""
    if weight.dim() != 2 or x.shape != gate.shape or x.shape[-2] * x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_sigmoid_gate: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight "
                         f"{tuple(weight.shape)} do not match")
    kernel = triton_kernel("linear", "linear_sigmoid_gate", x)
    if kernel is not None:
        return kernel(x, gate, weight)
    return linear((x * torch.sigmoid(gate)).flatten(-2), weight)
