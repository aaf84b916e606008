"""Depthwise causal conv1d with SiLU (the GDN input conv) on the GPU, prefill and in-place decode by slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue


@triton.jit
def _conv1d_decode_kernel(
    x_ptr, w_ptr, cs_ptr, slot_ptr, y_ptr,
    s_xb, s_xc, s_wc, s_wk, s_css, s_csc, s_csk, s_yb, s_yc,
    C, KW: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    b = tl.program_id(1)
    cc = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cc < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    # Window [state_0 .. state_{K-2}, x]: the state holds the K-1 previous inputs, oldest first.
    st_ptrs = cs_ptr + slot * s_css + cc[:, None] * s_csc + kk[None, :] * s_csk
    in_state = c_ok[:, None] & (kk[None, :] < KW - 1)
    win = tl.load(st_ptrs, mask=in_state, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * s_xb + cc * s_xc, mask=c_ok, other=0.0)
    win = tl.where(kk[None, :] == KW - 1, x.to(tl.float32)[:, None], win)
    w = tl.load(w_ptr + cc[:, None] * s_wc + kk[None, :] * s_wk, mask=c_ok[:, None] & (kk[None, :] < KW),
                other=0.0).to(tl.float32)
    acc = tl.sum(win * w, axis=1)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + b * s_yb + cc * s_yc, y.to(y_ptr.dtype.element_ty), mask=c_ok)
    # Shift left by one: new state j = window j + 1. Loads above complete before this store.
    for j in tl.static_range(KW - 1):
        val = tl.sum(tl.where(kk[None, :] == j + 1, win, 0.0), axis=1)
        tl.store(cs_ptr + slot * s_css + cc * s_csc + j * s_csk, val.to(cs_ptr.dtype.element_ty), mask=c_ok)


def causal_conv1d_decode(x, weight, conv_states, slots, *, out=None, block_c: int = 256):
    """One step per row: y[b] = silu(conv(state[slots[b]], x[b])); the state shifts in place."""
    B, C = x.shape
    KW = weight.shape[1]
    if tuple(weight.shape) != (C, KW) or tuple(conv_states.shape[1:]) != (C, KW - 1) or slots.shape != (B,):
        raise ValueError(f"causal_conv1d_decode: x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_states "
                         f"{tuple(conv_states.shape)}, slots {tuple(slots.shape)} do not fit")
    if out is None:
        out = torch.empty_like(x)
    if B == 0:
        return out
    grid = (triton.cdiv(C, block_c), B)
    _conv1d_decode_kernel[grid](
        x, weight, conv_states, slots, out,
        *x.stride(), *weight.stride(), *conv_states.stride(), *out.stride(),
        C, KW=KW, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(KW), num_warps=4, **pdl_args(x.device)
    )
    return out


@triton.jit
def _conv1d_prefill_kernel(
    x_ptr, w_ptr, cs_ptr, y_ptr,
    s_xt, s_xc, s_wc, s_wk, s_csc, s_csk, s_yt, s_yc,
    T, C, HAS_STATE: tl.constexpr, KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    pid_t = tl.program_id(0)
    tt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cc < C
    x_rows = x_ptr + cc[None, :] * s_xc
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(KW):
        # Tap j multiplies input t - (KW-1) + j.
        src = tt - (KW - 1) + j
        xv = tl.load(x_rows + src[:, None] * s_xt, mask=((src >= 0) & (tt < T))[:, None] & c_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cc * s_wc + j * s_wk, mask=c_ok, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * w[None, :]
    if HAS_STATE:
        if pid_t == 0:
            # Only the first K-1 outputs reach back into the state (column KW-1 + src for src < 0).
            for j in tl.static_range(KW - 1):
                src = tt - (KW - 1) + j
                sv = tl.load(cs_ptr + cc[None, :] * s_csc + (src + KW - 1)[:, None] * s_csk,
                             mask=((src < 0) & (tt < T))[:, None] & c_ok[None, :], other=0.0)
                w = tl.load(w_ptr + cc * s_wc + j * s_wk, mask=c_ok, other=0.0).to(tl.float32)
                acc += sv.to(tl.float32) * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + tt[:, None] * s_yt + cc[None, :] * s_yc, y.to(y_ptr.dtype.element_ty),
             mask=(tt < T)[:, None] & c_ok[None, :])


@triton.jit
def _conv1d_state_kernel(
    x_ptr, cs_ptr, s_xt, s_xc, s_csc, s_csk,
    T, C, HAS_STATE: tl.constexpr, KW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    # New state column j = input at time T - (KW-1) + j, from x, else from the old state (short inputs).
    cc = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cc < C
    jj = tl.arange(0, BLOCK_K)
    src = T - (KW - 1) + jj
    j_ok = jj < KW - 1
    xv = tl.load(x_ptr + src[None, :] * s_xt + cc[:, None] * s_xc, mask=c_ok[:, None] & (j_ok & (src >= 0))[None, :],
                 other=0.0)
    if HAS_STATE:
        old = tl.load(cs_ptr + cc[:, None] * s_csc + (src + KW - 1)[None, :] * s_csk,
                      mask=c_ok[:, None] & (j_ok & (src < 0))[None, :], other=0.0)
        xv = tl.where((src >= 0)[None, :], xv.to(cs_ptr.dtype.element_ty), old)
    tl.store(cs_ptr + cc[:, None] * s_csc + jj[None, :] * s_csk, xv.to(cs_ptr.dtype.element_ty),
             mask=c_ok[:, None] & j_ok[None, :])


def causal_conv1d_prefill(x, weight, conv_state, has_initial_state: bool, *, out=None,
                          block_t: int = 16, block_c: int = 256):
    """Causal depthwise conv over T inputs after the K-1 held in conv_state; conv_state gets the last K-1."""
    T, C = x.shape
    KW = weight.shape[1]
    if tuple(weight.shape) != (C, KW) or tuple(conv_state.shape) != (C, KW - 1):
        raise ValueError(f"causal_conv1d_prefill: x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_state "
                         f"{tuple(conv_state.shape)} do not fit")
    if out is None:
        out = torch.empty_like(x)
    if T == 0:
        return out
    block_t = max(block_t, triton.next_power_of_2(KW - 1))  # the state reaches into the first block only
    _conv1d_prefill_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
        x, weight, conv_state, out, *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(),
        T, C, HAS_STATE=bool(has_initial_state), KW=KW, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=8,
        **pdl_args(x.device)
    )
    # A second launch, so every read of the old state above happens before it is overwritten.
    _conv1d_state_kernel[(triton.cdiv(C, 256),)](
        x, conv_state, *x.stride(), *conv_state.stride(), T, C, HAS_STATE=bool(has_initial_state), KW=KW,
        BLOCK_K=triton.next_power_of_2(max(KW - 1, 1)), BLOCK_C=256, num_warps=4, **pdl_args(x.device)
    )
    return out
