"""SiLU-and-multiply (the MLP gate) on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, s_xr, s_yr, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    cc = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cc < inter
    a = tl.load(x_ptr + r * s_xr + cc, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + r * s_xr + inter + cc, mask=mask, other=0.0).to(tl.float32)
    # Round silu(a) to the output dtype before the product, as silu(a) * b does in that dtype.
    s = (a * tl.sigmoid(a)).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + r * s_yr + cc, (s * b).to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x, *, out=None, block: int = 1024):
    """silu(x[..., :inter]) * x[..., inter:] for x [..., 2I]."""
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul: last dimension {two_i} is odd")
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    y2 = out.view(-1, inter)
    if x2.shape[0] == 0:
        return out
    block = min(block, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, y2, x2.stride(0), y2.stride(0), inter, BLOCK=block, num_warps=4, **pdl_args(x2.device))
    return out
