"""Dense projections y = x @ weight.T (weight [N, K], as stored by Hugging Face and the artifact).

Decode multiplies a few rows by every weight of the model once per step, so its speed is the speed
of reading the weights. cuBLAS (``F.linear``) is the reference and the path for many rows; a Triton
kernel for few rows (``ninfer.ops.triton.linear``) is used once validated and listed (``dispatch``).
A quantized weight (``ninfer.ops.quant.QuantizedWeight``) dispatches here as well: few rows to a weight-only
kernel that dequantizes in registers (decode reads half or a quarter of the bytes), many rows to W8A8 when Startup
chose the A8 path for it, else to a dequantized copy and cuBLAS (``ninfer.ops.triton.linear_quant``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.contract.quant import A8, FP8_BLOCK
from ninfer.ops.activation import silu_and_mul, silu_and_mul_ref
from ninfer.ops.dispatch import triton_kernel
from ninfer.ops.quant import QuantizedWeight, linear_quant_ref

# Rows up to which a quantized weight takes the weight-only GEMV (decode, verify): past it, a GEMM.
FEW_ROWS = 32


def linear_ref(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N] in x.dtype, or in out_dtype = torch.float32 (the lm_head's logits).

    The reference (and cuBLAS, for many rows) rounds the product to x.dtype and then casts; the Triton kernel
    stores its fp32 accumulator directly, which skips a cast kernel and is more precise (not rounded to bf16):
    the two differ by up to x.dtype's rounding."""
    if isinstance(weight, QuantizedWeight):
        return linear_quantized(x, weight, out_dtype=out_dtype)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"linear: out_dtype must be the input's {x.dtype} or torch.float32, got {out_dtype}")
    kernel = triton_kernel("linear", "linear", x)
    if kernel is not None:
        return kernel(x, weight, out_dtype=out_dtype)
    return linear_ref(x, weight, out_dtype=out_dtype)


def linear_quantized(x: torch.Tensor, weight: QuantizedWeight, *,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``linear`` for a quantized weight ``[N, K]`` (the format's definition: ``linear_quant_ref``)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input {tuple(x.shape)} does not match {weight.format} weight {weight.shape}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"linear: out_dtype must be the input's {x.dtype} or torch.float32, got {out_dtype}")
    rows = x.numel() // x.shape[-1]
    if rows <= FEW_ROWS:
        name = "linear_fp8" if weight.format == FP8_BLOCK else "linear_nvfp4"
    elif weight.activation == A8:
        name = "linear_fp8_w8a8"
    else:
        name = "linear_dequant"
    kernel = triton_kernel("linear_quant", name, x)
    if kernel is not None:
        return kernel(x, weight, out_dtype=out_dtype)
    return linear_quant_ref(x, weight, out_dtype=out_dtype)


def swiglu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(linear_ref(x, weight))


def swiglu(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """silu_and_mul(linear(x, weight)) for weight [2I, K] = [gate; up] stacked: the MLP's first half, [..., I].
    On the GPU, few rows run it as one kernel (the activation is the projection's epilogue)."""
    if isinstance(weight, QuantizedWeight):
        if weight.shape[0] % 2:
            raise ValueError(f"swiglu: a [gate; up] weight has an even number of rows, got {weight.shape}")
        return silu_and_mul(linear_quantized(x, weight))
    if weight.dim() != 2 or weight.shape[0] % 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"swiglu: input {tuple(x.shape)} does not match a [gate; up] weight {tuple(weight.shape)}")
    kernel = triton_kernel("linear", "swiglu", x)
    if kernel is not None:
        return kernel(x, weight)
    return silu_and_mul(linear(x, weight))
