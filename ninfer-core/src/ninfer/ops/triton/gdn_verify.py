"""Gated DeltaNet speculative verification on the GPU: R fused decode steps per row in one launch, every step's
state kept and the slot left as it was (``ninfer.ops.gdn.gdn_verify``).

The programs are those of the fused decode step (Dv block, value head, row). Each reads its fp32 [Dk, BLOCK_V]
state block and its conv windows from the slot once, keeps them in registers across the row's R tokens and
writes them to the step buffers after every token: the state is read once instead of R times, and there are
no copies. Since the slot is never written, the q/k conv channels shared by the programs of a key head need no
arrival counter: one program per (row, key head) stores their step conv states.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.gdn_shared import default_block_v


@triton.jit
def _load_history(cs_row, sc_row, cc, c_ok, s_csc, s_csk, KW: tl.constexpr, BLOCK_W: tl.constexpr):
    """The slot's K-1 previous inputs of channels cc in columns 0..K-2 (oldest first), in fp32 but rounded
    through the step buffer's dtype (at sc_row), as the reference copies them there before its first step."""
    ww = tl.arange(0, BLOCK_W)
    hist = tl.load(cs_row + cc[:, None] * s_csc + ww[None, :] * s_csk,
                   mask=c_ok[:, None] & (ww[None, :] < KW - 1), other=0.0)
    return hist.to(sc_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _conv_token(x_row, cc, c_ok, s_xc, w, hist, sc_row, store_ok, s_scc, s_sck,
                KW: tl.constexpr, BLOCK_W: tl.constexpr):
    """One conv token of channels cc: window [hist_0 .. hist_{K-2}, x] against the fp32 weights w [C, BLOCK_W].
    Stores the shifted window (the step's conv state) at sc_row where store_ok; returns it, as stored, with
    silu(conv) rounded to the input dtype as the unfused op stores it."""
    ww = tl.arange(0, BLOCK_W)
    x = tl.load(x_row + cc * s_xc, mask=c_ok, other=0.0)
    win = tl.where(ww[None, :] == KW - 1, x.to(tl.float32)[:, None], hist)
    acc = tl.sum(win * w, axis=1)
    y = acc * tl.sigmoid(acc)
    nxt = tl.zeros_like(win)
    for j in tl.static_range(KW - 1):
        nxt = tl.where(ww[None, :] == j, tl.sum(tl.where(ww[None, :] == j + 1, win, 0.0), axis=1)[:, None], nxt)
    nxt = nxt.to(sc_row.dtype.element_ty)
    tl.store(sc_row + cc[:, None] * s_scc + ww[None, :] * s_sck, nxt,
             mask=store_ok[:, None] & (ww[None, :] < KW - 1))
    return nxt.to(tl.float32), y.to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _conv_weights(w_ptr, cc, c_ok, s_wc, s_wk, KW: tl.constexpr, BLOCK_W: tl.constexpr):
    ww = tl.arange(0, BLOCK_W)
    return tl.load(w_ptr + cc[:, None] * s_wc + ww[None, :] * s_wk, mask=c_ok[:, None] & (ww[None, :] < KW),
                   other=0.0).to(tl.float32)


@triton.jit
def _gdn_verify_kernel(
    x_ptr, a_ptr, b_ptr, w_ptr, cs_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, sc_ptr, ss_ptr, o_ptr,
    s_xn, s_xc, s_an, s_ah, s_bn, s_bh, s_wc, s_wk, s_css, s_csc, s_csk, s_ss, s_sh, s_sk, s_sv, s_slot,
    s_scb, s_sct, s_scc, s_sck, s_ssb, s_sst, s_ssh, s_ssk, s_ssv, s_on, s_oh, s_od,
    scale,
    R: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HV_PER_HK: tl.constexpr,
    KW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = h // HV_PER_HK
    slot = tl.load(slot_ptr + b * s_slot).to(tl.int64)
    cs_row = cs_ptr + slot * s_css
    sc_row = sc_ptr + b * s_scb

    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < DK
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < DV
    q_ch, k_ch, v_ch = hk * DK + offs_k, (HK + hk) * DK + offs_k, 2 * HK * DK + h * DV + offs_v
    # Every program computes its key head's q/k channels; the first program of the head stores their states.
    qk_store = mask_k & ((pid_v == 0) & (h % HV_PER_HK == 0))
    q_w = _conv_weights(w_ptr, q_ch, mask_k, s_wc, s_wk, KW, BLOCK_W)
    k_w = _conv_weights(w_ptr, k_ch, mask_k, s_wc, s_wk, KW, BLOCK_W)
    v_w = _conv_weights(w_ptr, v_ch, mask_v, s_wc, s_wk, KW, BLOCK_W)
    q_hist = _load_history(cs_row, sc_row, q_ch, mask_k, s_csc, s_csk, KW, BLOCK_W)
    k_hist = _load_history(cs_row, sc_row, k_ch, mask_k, s_csc, s_csk, KW, BLOCK_W)
    v_hist = _load_history(cs_row, sc_row, v_ch, mask_v, s_csc, s_csk, KW, BLOCK_W)

    s_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptr + slot * s_ss + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv,
                    mask=s_mask, other=0.0)
    ss_block = ss_ptr + b * s_ssb + h * s_ssh + offs_k[:, None] * s_ssk + offs_v[None, :] * s_ssv
    # softplus(a + dt_bias) with torch's threshold of 20, scaled by -exp(A_log): the log decay, as gdn_gates.
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    for t in tl.static_range(R):
        n = b * R + t  # the token's row in mixed_qkv, a, b and the output
        x_row = x_ptr + n * s_xn
        sc_step = sc_row + t * s_sct
        q_hist, q = _conv_token(x_row, q_ch, mask_k, s_xc, q_w, q_hist, sc_step, qk_store, s_scc, s_sck,
                                KW, BLOCK_W)
        k_hist, k = _conv_token(x_row, k_ch, mask_k, s_xc, k_w, k_hist, sc_step, qk_store, s_scc, s_sck,
                                KW, BLOCK_W)
        v_hist, v = _conv_token(x_row, v_ch, mask_v, s_xc, v_w, v_hist, sc_step, mask_v, s_scc, s_sck,
                                KW, BLOCK_W)
        # L2 norm over Dk (eps inside the rsqrt, as the reference), then the 1/sqrt(Dk) query scale.
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        x = tl.load(a_ptr + n * s_an + h * s_ah).to(tl.float32) + dt_bias
        g = neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        beta = tl.sigmoid(tl.load(b_ptr + n * s_bn + h * s_bh).to(tl.float32))
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        tl.store(ss_block + t * s_sst, state, mask=s_mask)
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(o_ptr + n * s_on + h * s_oh + offs_v * s_od, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def _check(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots, step_conv, step_states
           ) -> tuple[int, int, int, int]:
    """(HK, HV, Dk, Dv), or a ValueError naming the shapes that do not fit."""
    from ninfer.ops.gdn import _fused_head_counts

    def bad(why: str) -> ValueError:
        return ValueError(f"gdn_verify: {why} (mixed_qkv {tuple(mixed_qkv.shape)}, a {tuple(a.shape)}, b "
                          f"{tuple(b.shape)}, slots {tuple(slots.shape)}, step_conv {tuple(step_conv.shape)} "
                          f"{step_conv.dtype}, step_states {tuple(step_states.shape)} {step_states.dtype}, "
                          f"conv_states {tuple(conv_states.shape)}, states {tuple(states.shape)})")

    if step_conv.dim() != 4 or step_states.dim() != 5 or mixed_qkv.dim() != 2 or a.dim() != 2 or b.dim() != 2:
        raise bad("mixed_qkv, a and b must be [B*R, ...], step_conv [B, R, conv_dim, K-1] and step_states "
                  "[B, R, HV, Dk, Dv]")
    B, R = step_conv.shape[:2]
    if mixed_qkv.shape[0] != B * R or a.shape[0] != B * R or b.shape[0] != B * R or slots.shape != (B,) \
            or step_states.shape[:2] != (B, R):
        raise bad("mixed_qkv, a and b must hold R rows per slot, step_conv and step_states [B, R, ...]")
    if step_conv.shape[2:] != conv_states.shape[1:] or step_states.shape[2:] != states.shape[1:] \
            or step_states.dtype != torch.float32:
        raise bad("each step's states must be shaped as a slot's, the recurrent ones fp32")
    try:  # one token per row is a fused decode step
        return _fused_head_counts(mixed_qkv[:B], a[:B], b[:B], conv_weight, conv_states, A_log, dt_bias, states,
                                  slots)
    except ValueError as e:
        raise bad(f"one step does not fit: {e}") from None


def gdn_verify(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots, step_conv, step_states,
               *, out=None, block_v: int | None = None, num_warps: int = 4):
    """R fused decode steps per row (rows b*R..b*R+R-1 of mixed_qkv, a and b) from the slot's states, which stay
    unchanged; the state after token t goes to ``step_conv[b, t]`` / ``step_states[b, t]`` (strided views);
    returns o [B*R, HV, Dv] in mixed_qkv.dtype."""
    HK, HV, DK, DV = _check(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots, step_conv,
                            step_states)
    B, R = step_conv.shape[:2]
    KW = conv_weight.shape[1]
    if out is None:
        out = torch.empty((B * R, HV, DV), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if B == 0:
        return out
    block_v = min(block_v or default_block_v(B, HV, DV, tuning.device_key(mixed_qkv)), triton.next_power_of_2(DV))
    _gdn_verify_kernel[(triton.cdiv(DV, block_v), HV, B)](
        mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots, step_conv, step_states, out,
        *mixed_qkv.stride(), *a.stride(), *b.stride(), *conv_weight.stride(), *conv_states.stride(),
        *states.stride(), slots.stride(0), *step_conv.stride(), *step_states.stride(), *out.stride(), DK ** -0.5,
        R=R, HK=HK, DK=DK, DV=DV, HV_PER_HK=HV // HK, KW=KW, BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=block_v,
        BLOCK_W=triton.next_power_of_2(KW), num_warps=num_warps, **pdl_args(mixed_qkv.device))
    return out


@triton.jit
def _copy_rows_kernel(dst_ptr, dst_rows_ptr, src_ptr, src_rows_ptr, n, s_dst, s_src, s_dr, s_sr,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    # Programs: (row, block of the row's n contiguous elements).
    i = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(dst_rows_ptr + i * s_dr).to(tl.int64)
    s = tl.load(src_rows_ptr + i * s_sr).to(tl.int64)
    tl.store(dst_ptr + d * s_dst + offs, tl.load(src_ptr + s * s_src + offs, mask=mask), mask=mask)


def _copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for 2-D views whose rows are contiguous (any row stride)."""
    n = dst.shape[1]
    if dst.dtype != src.dtype or src.shape[1] != n or dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError(f"copy_rows: dst {tuple(dst.shape)} {dst.dtype} and src {tuple(src.shape)} {src.dtype} "
                         f"need the same dtype, row length and contiguous rows")
    if dst_rows.shape[0] == 0:
        return
    block = 4096
    _copy_rows_kernel[(dst_rows.shape[0], triton.cdiv(n, block))](
        dst, dst_rows, src, src_rows, n, dst.stride(0), src.stride(0), dst_rows.stride(0), src_rows.stride(0),
        BLOCK=block, num_warps=4, **pdl_args(dst.device))


def _row_view(t: torch.Tensor, lead: int) -> torch.Tensor | None:
    """``t`` as 2-D [rows, n] without a copy (rows over its first ``lead`` axes, which must collapse into one
    stride; n over the rest, contiguous), or None when its layout does not allow that."""
    inner = t.shape[lead:]
    n, expect = 1, 1
    for size, stride in zip(reversed(inner), reversed(t.stride()[lead:]), strict=True):
        if size != 1 and stride != expect:
            return None
        expect *= size
        n *= size
    if lead == 2 and t.shape[1] != 1 and t.stride(0) != t.stride(1) * t.shape[1]:
        return None
    row = t.stride(lead - 1)
    return t.as_strided((t.shape[:lead].numel(), n), (row, 1))


def gdn_verify_commit(conv_states, states, slots, step_conv, step_states, steps):
    """``ninfer.ops.gdn.gdn_verify_commit`` as two row copies (every layer of a row's kept step is one contiguous
    block of the step buffers, and one of the slot's StateImage); other layouts take the reference."""
    from ninfer.ops.gdn import gdn_verify_commit_ref

    views = [_row_view(conv_states, 1), _row_view(states, 1), _row_view(step_conv, 2), _row_view(step_states, 2)]
    if any(v is None for v in views):
        return gdn_verify_commit_ref(conv_states, states, slots, step_conv, step_states, steps)
    dst_conv, dst_states, src_conv, src_states = views
    R = step_conv.shape[1]
    src_rows = torch.arange(step_conv.shape[0], device=steps.device) * R + steps
    _copy_rows(dst_conv, slots, src_conv, src_rows)
    _copy_rows(dst_states, slots, src_states, src_rows)
