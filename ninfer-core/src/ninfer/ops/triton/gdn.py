"""Gated DeltaNet on the GPU: the one-token recurrent decode kernel (ours), the fused decode step (conv update +
gates + recurrent step, ours) and chunked prefill (fla-core).

Decode is bandwidth-bound: each step reads and writes the whole fp32 state [HV, Dk, Dv] of every row once
(2 MiB per row and layer for Qwen3.5), so one program owns a [Dk, BV] column block of one value head, keeps
it in registers for the whole update, and fuses the q/k L2 norm and the q scaling around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.fast_paths import fla_available
from ninfer.ops.launch import arrival_counters, pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.gdn_shared import default_block_v


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, o_ptr,
    s_qb, s_qh, s_qd, s_kb, s_kh, s_kd, s_vb, s_vh, s_vd,
    s_gb, s_gh, s_betab, s_betah,
    s_ss, s_sh, s_sk, s_sv,
    s_ob, s_oh, s_od,
    scale,
    DK: tl.constexpr, DV: tl.constexpr, HV_PER_HK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // HV_PER_HK
    slot = tl.load(slot_ptr + b).to(tl.int64)

    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV

    q = tl.load(q_ptr + b * s_qb + hk * s_qh + offs_k * s_qd, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * s_kb + hk * s_kh + offs_k * s_kd, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * s_vb + h * s_vh + offs_v * s_vd, mask=mask_v, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * s_gb + h * s_gh).to(tl.float32)
    beta = tl.load(beta_ptr + b * s_betab + h * s_betah).to(tl.float32)

    # L2 norm over Dk (eps inside the rsqrt, as the reference), then the 1/sqrt(Dk) query scale.
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)

    s_ptrs = state_ptr + slot * s_ss + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    s_mask = mask_k[:, None] & mask_v[None, :]
    state, o = _state_update(tl.load(s_ptrs, mask=s_mask, other=0.0), q, k, v, tl.exp(g), beta)
    tl.store(s_ptrs, state, mask=s_mask)
    tl.store(o_ptr + b * s_ob + h * s_oh + offs_v * s_od, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def gdn_decode(q, k, v, g, beta, states, slots, *, out=None, block_v: int | None = None, num_warps: int = 4):
    """One recurrent step per row, updating ``states[slots[b]]`` in place; returns o [B, HV, Dv] in v.dtype."""
    B, HK, DK = q.shape
    _, HV, DV = v.shape
    if k.shape != q.shape or v.shape[0] != B or HV % HK != 0:
        raise ValueError(f"gdn_decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if states.dtype != torch.float32 or tuple(states.shape[1:]) != (HV, DK, DV):
        raise ValueError(f"gdn_decode: states must be fp32 [S, {HV}, {DK}, {DV}], got {states.dtype} "
                         f"{tuple(states.shape)}")
    if tuple(g.shape) != (B, HV) or tuple(beta.shape) != (B, HV) or tuple(slots.shape) != (B,):
        raise ValueError("gdn_decode: g and beta must be [B, HV] and slots [B]")
    if out is None:
        out = torch.empty((B, HV, DV), dtype=v.dtype, device=v.device)
    if B == 0:
        return out
    block_v = block_v or default_block_v(B, HV, DV, tuning.device_key(q))
    grid = (triton.cdiv(DV, block_v), HV, B)
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, states, slots, out,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *states.stride(), *out.stride(),
        DK ** -0.5,
        DK=DK, DV=DV, HV_PER_HK=HV // HK,
        BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=block_v, num_warps=num_warps, **pdl_args(q.device)
    )
    return out


@triton.jit
def _conv_window(x_row, w_ptr, cs_row, cc, c_ok, s_xc, s_wc, s_wk, s_csc, s_csk,
                 KW: tl.constexpr, BLOCK_W: tl.constexpr):
    """(window, y) of one row over channels cc: the window [state_0 .. state_{K-2}, x] (the state holds the K-1
    previous inputs, oldest first) and silu(conv) in fp32, rounded to the input dtype as the unfused op stores it."""
    ww = tl.arange(0, BLOCK_W)
    win = tl.load(cs_row + cc[:, None] * s_csc + ww[None, :] * s_csk,
                  mask=c_ok[:, None] & (ww[None, :] < KW - 1), other=0.0).to(tl.float32)
    x = tl.load(x_row + cc * s_xc, mask=c_ok, other=0.0)
    win = tl.where(ww[None, :] == KW - 1, x.to(tl.float32)[:, None], win)
    w = tl.load(w_ptr + cc[:, None] * s_wc + ww[None, :] * s_wk, mask=c_ok[:, None] & (ww[None, :] < KW),
                other=0.0).to(tl.float32)
    acc = tl.sum(win * w, axis=1)
    y = acc * tl.sigmoid(acc)
    return win, y.to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _conv_shift(cs_row, cc, mask, win, s_csc, s_csk, KW: tl.constexpr, BLOCK_W: tl.constexpr):
    """New conv state j = window j + 1, stored where mask holds."""
    ww = tl.arange(0, BLOCK_W)
    for j in tl.static_range(KW - 1):
        val = tl.sum(tl.where(ww[None, :] == j + 1, win, 0.0), axis=1)
        tl.store(cs_row + cc * s_csc + j * s_csk, val.to(cs_row.dtype.element_ty), mask=mask)


@triton.jit
def _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, b, h, s_ab, s_ah, s_bb, s_bh):
    """(exp(g), beta) of row b, value head h: g = -exp(A_log) softplus(a + dt_bias) with torch's softplus
    threshold of 20, beta = sigmoid(b)."""
    x = tl.load(a_ptr + b * s_ab + h * s_ah).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
    return tl.exp(g), tl.sigmoid(tl.load(b_ptr + b * s_bb + h * s_bh).to(tl.float32))


@triton.jit
def _state_update(state, q, k, v, decay, beta):
    """One recurrent step of an fp32 [Dk, BLOCK_V] state block held in registers: (the decayed, delta-corrected
    block, o = its product with q)."""
    state = state * decay
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


@triton.jit
def _gdn_decode_fused_kernel(
    x_ptr, a_ptr, b_ptr, w_ptr, cs_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, o_ptr, arrive_ptr,
    s_xb, s_xc, s_ab, s_ah, s_bb, s_bh, s_wc, s_wk, s_css, s_csc, s_csk,
    s_ss, s_sh, s_sk, s_sv, s_ob, s_oh, s_od,
    scale,
    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HV_PER_HK: tl.constexpr, KW: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    # Programs as _gdn_decode_kernel: (Dv block, value head, row). Each owns the conv channels of its v block;
    # the q/k channels of a key head are read by all HV_PER_HK * n_blocks programs of that head, so the last
    # one to arrive (an acq_rel counter per row and key head, left at 0 again) shifts their conv state.
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // HV_PER_HK
    slot = tl.load(slot_ptr + b).to(tl.int64)
    x_row = x_ptr + b.to(tl.int64) * s_xb
    cs_row = cs_ptr + slot * s_css

    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < DK
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < DV
    q_ch, k_ch, v_ch = hk * DK + offs_k, (HK + hk) * DK + offs_k, 2 * HK * DK + h * DV + offs_v
    q_win, q = _conv_window(x_row, w_ptr, cs_row, q_ch, mask_k, s_xc, s_wc, s_wk, s_csc, s_csk, KW, BLOCK_W)
    k_win, k = _conv_window(x_row, w_ptr, cs_row, k_ch, mask_k, s_xc, s_wc, s_wk, s_csc, s_csk, KW, BLOCK_W)
    v_win, v = _conv_window(x_row, w_ptr, cs_row, v_ch, mask_v, s_xc, s_wc, s_wk, s_csc, s_csk, KW, BLOCK_W)
    decay, beta = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, b, h, s_ab, s_ah, s_bb, s_bh)
    s_ptrs = state_ptr + slot * s_ss + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    s_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0)
    # Every load comes before the arrival (its acquire would hold later loads behind its round trip), and the
    # arrival before the state math: its latency overlaps the step instead of following the stores.
    counter = arrive_ptr + b * HK + hk
    tl.debug_barrier()  # every thread's reads of the q/k windows are done before the arrival is published
    last = tl.atomic_add(counter, 1, sem="acq_rel") == HV_PER_HK * tl.num_programs(0) - 1
    _conv_shift(cs_row, v_ch, mask_v, v_win, s_csc, s_csk, KW, BLOCK_W)
    # L2 norm over Dk (eps inside the rsqrt, as the reference), then the 1/sqrt(Dk) query scale.
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    state, o = _state_update(state, q, k, v, decay, beta)
    tl.store(s_ptrs, state, mask=s_mask)
    tl.store(o_ptr + b * s_ob + h * s_oh + offs_v * s_od, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    _conv_shift(cs_row, q_ch, mask_k & last, q_win, s_csc, s_csk, KW, BLOCK_W)
    _conv_shift(cs_row, k_ch, mask_k & last, k_win, s_csc, s_csk, KW, BLOCK_W)
    tl.store(counter, 0, mask=last)


def gdn_decode_fused(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots, *, out=None,
                     block_v: int | None = None, num_warps: int = 4):
    """Conv update (+SiLU), gates and recurrent step of one decode token per row in one launch; conv_states
    and states are updated in place at slots; returns o [B, HV, Dv] in mixed_qkv.dtype.

    The programs are those of ``gdn_decode`` (Dv block, value head, row). Launches on one device must not
    overlap (they share the arrival counters).
    """
    from ninfer.ops.gdn import _fused_head_counts

    HK, HV, DK, DV = _fused_head_counts(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots)
    B = mixed_qkv.shape[0]
    KW = conv_weight.shape[1]
    if out is None:
        out = torch.empty((B, HV, DV), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if B == 0:
        return out
    block_v = min(block_v or default_block_v(B, HV, DV, tuning.device_key(mixed_qkv)), triton.next_power_of_2(DV))
    arrivals = arrival_counters(mixed_qkv.device, B * HK)
    _gdn_decode_fused_kernel[(triton.cdiv(DV, block_v), HV, B)](
        mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots, out, arrivals,
        *mixed_qkv.stride(), *a.stride(), *b.stride(), *conv_weight.stride(), *conv_states.stride(),
        *states.stride(), *out.stride(), DK ** -0.5,
        HK=HK, DK=DK, DV=DV, HV_PER_HK=HV // HK, KW=KW, BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=block_v,
        BLOCK_W=triton.next_power_of_2(KW), num_warps=num_warps, **pdl_args(mixed_qkv.device))
    return out


@triton.jit
def _gdn_gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, N, HV, s_an, s_bn,
                      BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    nn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    mask = (nn < N)[:, None] & (hh < HV)[None, :]
    a = tl.load(a_ptr + nn[:, None] * s_an + hh[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + nn[:, None] * s_bn + hh[None, :], mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + hh, mask=hh < HV, other=0.0).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + hh, mask=hh < HV, other=0.0).to(tl.float32)
    x = a + dt_bias[None, :]
    # softplus with torch's threshold of 20 (linear above it).
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(a_log)[None, :] * softplus
    tl.store(g_ptr + nn[:, None] * HV + hh[None, :], g, mask=mask)
    tl.store(beta_ptr + nn[:, None] * HV + hh[None, :], tl.sigmoid(b), mask=mask)


def gdn_gates(a, b, A_log, dt_bias, *, out=None):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); both fp32 [N, HV]."""
    N, HV = a.shape
    if b.shape != a.shape or tuple(A_log.shape) != (HV,) or tuple(dt_bias.shape) != (HV,):
        raise ValueError(f"gdn_gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, "
                         f"dt_bias {tuple(dt_bias.shape)} do not fit")
    if a.stride(1) != 1 or b.stride(1) != 1:
        a, b = a.contiguous(), b.contiguous()
    g, beta = out if out is not None else (torch.empty((N, HV), dtype=torch.float32, device=a.device),
                                           torch.empty((N, HV), dtype=torch.float32, device=a.device))
    if N == 0:
        return g, beta
    block_h = triton.next_power_of_2(HV)
    block_n = max(1, 1024 // block_h)
    _gdn_gates_kernel[(triton.cdiv(N, block_n),)](
        a, b, A_log, dt_bias, g, beta, N, HV, a.stride(0), b.stride(0), BLOCK_N=block_n, BLOCK_H=block_h,
        num_warps=4, **pdl_args(a.device))
    return g, beta


def gdn_prefill(q, k, v, g, beta, state, has_initial_state: bool, *, out=None):
    """Chunked GDN over one sequence through fla-core's ``chunk_gated_delta_rule``; state updated in place.
    Without fla-core installed this is the torch reference (same math, slower)."""
    if not fla_available():
        from ninfer.ops.gdn import gdn_prefill_ref

        o = gdn_prefill_ref(q, k, v, g, beta, state, has_initial_state)
        return o if out is None else out.copy_(o)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    T, HK, DK = q.shape
    HV = v.shape[1]
    if state.dtype != torch.float32 or tuple(state.shape) != (HV, DK, v.shape[2]):
        raise ValueError(f"gdn_prefill: state must be fp32 [{HV}, {DK}, {v.shape[2]}], got {state.dtype} "
                         f"{tuple(state.shape)}")
    initial = state.unsqueeze(0) if has_initial_state else None
    o, final = chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).float(), beta.unsqueeze(0).float(),
        scale=DK ** -0.5, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    state.copy_(final[0])
    if out is None:
        return o[0]
    out.copy_(o[0])
    return out

