"""Hyper-connections on the GPU: the per-stream norm, the streams' gated mean and the injection, each one pass over
the wide rows with math in fp32, and the two activations of the low-rank mix and the injection weights in one
launch (see ``ninfer.ops.hyper_connection`` for the formulas). A decode step runs them on a few rows, where the
torch compositions they replace cost a launch per elementwise op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue

_BLOCK_H = 1024  # columns of one stream per program in the mean and the injection


@triton.jit
def _grouped_rms_norm_kernel(x_ptr, w_ptr, y_ptr, G, s_xr, s_yr, Hg, eps, BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr = False):
    # One program per (row, group): the group's Hg features normed by their own RMS, times (1 + w).
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0).to(tl.int64)
    row, g = pid // G, pid % G
    cols = tl.arange(0, BLOCK)
    ok = cols < Hg
    x = tl.load(x_ptr + row * s_xr + g * Hg + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + g * Hg + cols, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / Hg + eps) * (1.0 + w)
    tl.store(y_ptr + row * s_yr + g * Hg + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _stream_mix_kernel(m_ptr, n_ptr, y_ptr, s_mr, s_nr, s_yr, H, S: tl.constexpr, BLOCK_H: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    # y[r, h] = mean over streams s of sigmoid(m[r, s*H + h]) * n[r, s*H + h].
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in tl.static_range(S):
        m = tl.load(m_ptr + row * s_mr + s * H + cols, mask=ok, other=0.0).to(tl.float32)
        n = tl.load(n_ptr + row * s_nr + s * H + cols, mask=ok, other=0.0).to(tl.float32)
        acc += tl.sigmoid(m) * n
    tl.store(y_ptr + row * s_yr + cols, (acc / S).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _inject_kernel(x_ptr, o_ptr, w_ptr, y_ptr, s_xr, s_or, s_wr, s_yr, H, S, BLOCK_H: tl.constexpr,
                   USE_PDL: tl.constexpr = False):
    # y[r, s*H + h] = x[r, s*H + h] + o[r, h] * w[r, s]; one program per (row, stream, column block).
    pdl_prologue(USE_PDL)
    rs = tl.program_id(0).to(tl.int64)
    row, s = rs // S, rs % S
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    w = tl.load(w_ptr + row * s_wr + s).to(tl.float32)
    x = tl.load(x_ptr + row * s_xr + s * H + cols, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + row * s_or + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_yr + s * H + cols, (x + o * w).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gates_kernel(l_ptr, g_ptr, a_ptr, w_ptr, s_lr, s_gr, s_ar, s_wr, R, S, HAS_W: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False):
    # One program per row: a = silu(l / S) over the R low-rank columns, w = 2 sigmoid(g / S) over the S streams,
    # each rounded to the output dtype where the torch form rounds (after the division, after silu / sigmoid).
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    ok = cols < R
    t = (tl.load(l_ptr + row * s_lr + cols, mask=ok, other=0.0).to(tl.float32) / S).to(a_ptr.dtype.element_ty)
    t = t.to(tl.float32)
    tl.store(a_ptr + row * s_ar + cols, (t / (1.0 + tl.exp(-t))).to(a_ptr.dtype.element_ty), mask=ok)
    if HAS_W:
        streams = tl.arange(0, BLOCK_S)
        on = streams < S
        u = (tl.load(g_ptr + row * s_gr + streams, mask=on, other=0.0).to(tl.float32) / S).to(w_ptr.dtype.element_ty)
        sig = (1.0 / (1.0 + tl.exp(-u.to(tl.float32)))).to(w_ptr.dtype.element_ty)
        tl.store(w_ptr + row * s_wr + streams, (2.0 * sig.to(tl.float32)).to(w_ptr.dtype.element_ty), mask=on)


def _rows(t: torch.Tensor, width: int, what: str) -> torch.Tensor:
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"{what}: {tuple(t.shape)} is not rows of {width}")
    return t if t.stride(1) == 1 else t.contiguous()


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    """x [N, G * group_size] -> each group normed by its own RMS, times (1 + weight[group's columns])."""
    if x.shape[-1] % group_size or weight.shape != x.shape[-1:]:
        raise ValueError(f"grouped_rms_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not split into "
                         f"groups of {group_size}")
    x2 = _rows(x.reshape(-1, x.shape[-1]), x.shape[-1], "grouped_rms_norm")
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    G = x2.shape[1] // group_size
    if x2.shape[0]:
        block = triton.next_power_of_2(group_size)
        _grouped_rms_norm_kernel[(x2.shape[0] * G,)](
            x2, weight, y, G, x2.stride(0), y.stride(0), group_size, eps, BLOCK=block,
            num_warps=8 if block >= 2048 else 4, **pdl_args(x.device))
    return y.view(x.shape)


def stream_mix(mix: torch.Tensor, normed: torch.Tensor, streams: int) -> torch.Tensor:
    """[N, H]: the mean over the ``streams`` of sigmoid(mix) * normed (both [N, S * H])."""
    if mix.shape != normed.shape or mix.dim() != 2 or mix.shape[1] % streams:
        raise ValueError(f"stream_mix: mix {tuple(mix.shape)} and normed {tuple(normed.shape)} must be the same "
                         f"[N, {streams} * H]")
    N, H = mix.shape[0], mix.shape[1] // streams
    m, n = _rows(mix, mix.shape[1], "stream_mix"), _rows(normed, mix.shape[1], "stream_mix")
    y = torch.empty((N, H), dtype=normed.dtype, device=normed.device)
    if N:
        _stream_mix_kernel[(N, triton.cdiv(H, _BLOCK_H))](
            m, n, y, m.stride(0), n.stride(0), y.stride(0), H, S=streams, BLOCK_H=_BLOCK_H, num_warps=4,
            **pdl_args(mix.device))
    return y


def hyper_connection_inject(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, S * H] + out [N, H] scaled per stream by weights [N, S], as a new tensor."""
    N, S = weights.shape
    if x.dim() != 2 or out.shape != (N, x.shape[1] // S) or x.shape != (N, S * out.shape[1]):
        raise ValueError(f"hyper_connection_inject: x {tuple(x.shape)}, out {tuple(out.shape)}, weights "
                         f"{tuple(weights.shape)} do not fit")
    H = out.shape[1]
    x2, o2, w2 = _rows(x, S * H, "hyper_connection_inject"), _rows(out, H, "hyper_connection_inject"), \
        _rows(weights, S, "hyper_connection_inject")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if N:
        _inject_kernel[(N * S, triton.cdiv(H, _BLOCK_H))](
            x2, o2, w2, y, x2.stride(0), o2.stride(0), w2.stride(0), y.stride(0), H, S, BLOCK_H=_BLOCK_H,
            num_warps=4, **pdl_args(x.device))
    return y


def hyper_connection_gates(low: torch.Tensor, logits: torch.Tensor | None, streams: int
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(silu(low / S) [N, R], 2 sigmoid(logits / S) [N, S] or None without ``logits``), in one launch."""
    if low.dim() != 2 or (logits is not None and (logits.dim() != 2 or logits.shape != (low.shape[0], streams))):
        raise ValueError(f"hyper_connection_gates: low {tuple(low.shape)} and logits "
                         f"{None if logits is None else tuple(logits.shape)} must be [N, R] and [N, {streams}]")
    N, R = low.shape
    l2 = _rows(low, R, "hyper_connection_gates")
    act = torch.empty((N, R), dtype=low.dtype, device=low.device)
    weights = None if logits is None else torch.empty((N, streams), dtype=logits.dtype, device=logits.device)
    g2 = l2 if logits is None else _rows(logits, streams, "hyper_connection_gates")
    if N:
        _gates_kernel[(N,)](
            l2, g2, act, act if weights is None else weights, l2.stride(0), g2.stride(0), act.stride(0),
            0 if weights is None else weights.stride(0), R, streams, HAS_W=weights is not None,
            BLOCK_R=triton.next_power_of_2(R), BLOCK_S=triton.next_power_of_2(streams), num_warps=4,
            **pdl_args(low.device))
    return act, weights
