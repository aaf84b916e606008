"""Rotary position embedding (NeoX rotate_half on the first rotary_dim dims) on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue


@triton.jit
def _apply_rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, s_xn, s_xh, s_xd, s_cn, s_sn, s_yn, s_yh, s_yd,
    H, D, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    mask = (hh < H)[:, None] & (dd < D)[None, :]
    x = tl.load(x_ptr + n * s_xn + hh[:, None] * s_xh + dd[None, :] * s_xd, mask=mask, other=0.0).to(tl.float32)
    rot = dd < 2 * HALF
    first = dd < HALF
    # rotate_half: the partner of dim d is d + HALF (first half, taken negative) or d - HALF (second half).
    partner = tl.where(first, dd + HALF, dd - HALF)
    xp = tl.load(x_ptr + n * s_xn + hh[:, None] * s_xh + partner[None, :] * s_xd,
                 mask=mask & rot[None, :], other=0.0).to(tl.float32)
    xp = tl.where(first[None, :], -xp, xp)
    ci = tl.where(first, dd, dd - HALF)
    c = tl.load(cos_ptr + n * s_cn + ci, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + n * s_sn + ci, mask=rot, other=0.0).to(tl.float32)
    y = tl.where(rot[None, :], x * c[None, :] + xp * s[None, :], x)
    tl.store(y_ptr + n * s_yn + hh[:, None] * s_yh + dd[None, :] * s_yd, y.to(y_ptr.dtype.element_ty), mask=mask)


def apply_rope(x, cos, sin, rotary_dim: int, *, out=None):
    """x [N, H, D] with cos/sin [N, rotary_dim // 2]; dims past rotary_dim pass through unchanged."""
    N, H, D = x.shape
    half = rotary_dim // 2
    if rotary_dim % 2 or rotary_dim > D or tuple(cos.shape) != (N, half) or sin.shape != cos.shape:
        raise ValueError(f"apply_rope: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, "
                         f"rotary_dim {rotary_dim} do not fit")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    if out is None:
        out = torch.empty_like(x)
    if N == 0:
        return out
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_d))
    _apply_rope_kernel[(N, triton.cdiv(H, block_h))](
        x, cos, sin, out, *x.stride(), cos.stride(0), sin.stride(0), *out.stride(),
        H, D, HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, **pdl_args(x.device)
    )
    return out
