"""Paged attention on the GPU: KV writes into pages and one flash-attention kernel over the block table.

One program handles BLOCK_Q query tokens of one sequence times all G query heads of one KV head (GQA
packing), so each K/V tile is read once for the whole group and the score matrix has BLOCK_Q * G rows,
enough for tensor-core dots even for a single decode token. Decode batches (every query length 1) split
the context into NUM_SPLITS ranges computed in the kernel from the device sequence lengths, so a captured
graph stays right for any length; a second kernel merges the partial softmax states.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_kn, s_kh, s_kd, s_vn, s_vh, s_vd,
    s_kcp, s_kco, s_kch, s_kcd, s_vcp, s_vco, s_vch, s_vcd,
    page_size,
    KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    page = slot // page_size
    off = slot % page_size
    hh = tl.arange(0, BLOCK_H)[:, None]
    dd = tl.arange(0, BLOCK_D)[None, :]
    mask = (hh < KVH) & (dd < D)
    k = tl.load(k_ptr + n * s_kn + hh * s_kh + dd * s_kd, mask=mask)
    v = tl.load(v_ptr + n * s_vn + hh * s_vh + dd * s_vd, mask=mask)
    tl.store(kc_ptr + page * s_kcp + off * s_kco + hh * s_kch + dd * s_kcd, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + page * s_vcp + off * s_vco + hh * s_vch + dd * s_vcd, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Store the new tokens' K/V at their flat cache slots (page = slot // page_size) in place."""
    N, KVH, D = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (KVH, D):
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} do not fit")
    if tuple(slot_mapping.shape) != (N,):
        raise ValueError(f"write_kv: slot_mapping must be [{N}], got {tuple(slot_mapping.shape)}")
    if N == 0:
        return
    _write_kv_kernel[(N,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        k_cache.shape[1],
        KVH=KVH, D=D, BLOCK_H=triton.next_power_of_2(KVH), BLOCK_D=triton.next_power_of_2(D),
        num_warps=4, **pdl_args(k.device)
    )


@triton.jit
def _norm_rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, inv_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, axes_ptr,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_qon, s_qoh,
    s_kcp, s_kco, s_kch, s_vcp, s_vco, s_vch, s_pos,
    page_size, eps,
    H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, MROPE: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    # One program per (token, head): heads 0..H-1 are query heads, H.. the key heads (each also stores its v).
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dd = tl.arange(0, BLOCK_D)
    inside = dd < D
    rot = dd < 2 * HALF
    first = dd < HALF
    partner = tl.where(first, dd + HALF, dd - HALF)  # rotate_half's partner of each rotated dim
    if h < H:
        row = q_ptr + n * s_qn + h * s_qh
        w_ptr = qw_ptr
    else:
        row = k_ptr + n * s_kn + (h - H) * s_kh
        w_ptr = kw_ptr
    x = tl.load(row + dd, mask=inside, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=rot, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + dd, mask=inside, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    # The normed values and cos/sin are rounded to the model dtype before the rotation, as the unfused ops do.
    dt = qo_ptr.dtype.element_ty
    normed = (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
    normed_p = (xp * rstd * (1.0 + wp)).to(dt).to(tl.float32)
    slot_j = tl.where(first, dd, dd - HALF)  # the frequency slot of each rotated dim
    if MROPE:  # positions [3, N]: each frequency slot rotates by the t, h or w row that axes names
        axis = tl.load(axes_ptr + slot_j, mask=rot, other=0)
        pos = tl.load(pos_ptr + axis * s_pos + n, mask=rot, other=0).to(tl.float32)
    else:
        pos = tl.load(pos_ptr + n).to(tl.float32)
    angle = pos * tl.load(inv_ptr + slot_j, mask=rot, other=0.0)
    # tl.cos/sin compile to libdevice's precise cosf/sinf (not the .approx instructions, wrong for angles of
    # 1e5 rad and more; checked in the sm_90 PTX), the functions torch's CUDA cos/sin use.
    c = tl.cos(angle).to(dt).to(tl.float32)
    s = tl.sin(angle).to(dt).to(tl.float32)
    y = tl.where(rot, normed * c + tl.where(first, -normed_p, normed_p) * s, normed)
    if h < H:
        tl.store(qo_ptr + n * s_qon + h * s_qoh + dd, y.to(dt), mask=inside)
    else:
        slot = tl.load(slot_ptr + n).to(tl.int64)
        page = slot // page_size
        off = slot % page_size
        tl.store(kc_ptr + page * s_kcp + off * s_kco + (h - H) * s_kch + dd, y.to(kc_ptr.dtype.element_ty),
                 mask=inside)
        v = tl.load(v_ptr + n * s_vn + (h - H) * s_vh + dd, mask=inside)
        tl.store(vc_ptr + page * s_vcp + off * s_vco + (h - H) * s_vch + dd, v.to(vc_ptr.dtype.element_ty),
                 mask=inside)


def norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping, *,
                       out=None):
    """Per-head (1 + w) RMSNorm + rotary embedding of q and k, and the K/V store, in one launch (see
    ``ninfer.ops.attention.norm_rope_write_kv``); q, k, v may be strided per token and head."""
    return _norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache,
                               slot_mapping, None, out)


def norm_rope_write_kv_mrope(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping,
                             axes, *, out=None):
    """``norm_rope_write_kv`` at MRoPE positions [3, N]: frequency slot j rotates by row ``axes[j]`` (the same
    kernel, its 1-D path compiled out)."""
    if axes is None or tuple(axes.shape) != tuple(inv_freq.shape):
        raise ValueError(f"norm_rope_write_kv_mrope: axes must have one entry per frequency slot "
                         f"({inv_freq.numel()})")
    return _norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache,
                               slot_mapping, axes, out)


def _norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping, axes,
                        out):
    N, H, D = q.shape
    KVH = k.shape[1]
    half = inv_freq.numel()
    want_pos = (N,) if axes is None else (3, N)
    if k.shape != (N, KVH, D) or v.shape != k.shape or tuple(k_cache.shape[2:]) != (KVH, D) \
            or v_cache.shape != k_cache.shape or tuple(slot_mapping.shape) != (N,) or positions.shape != want_pos \
            or 2 * half > D or q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"norm_rope_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(k_cache.shape)}, positions {tuple(positions.shape)}, inv_freq "
                         f"{tuple(inv_freq.shape)} do not fit")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("norm_rope_write_kv: the head dim of q, k, v and the caches must be contiguous")
    if out is None:
        out = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    mrope = axes is not None
    if mrope:
        positions = positions.contiguous()  # the kernel steps rows by stride(0) and tokens by 1
    _norm_rope_write_kv_kernel[(N, H + KVH)](
        q, k, v, q_weight, k_weight, positions, inv_freq.to(torch.float32), out, k_cache, v_cache, slot_mapping,
        axes.to(device=q.device, dtype=torch.int32) if mrope else slot_mapping,  # 1-D: never read
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), positions.stride(0) if mrope else 0, k_cache.shape[1], eps,
        H=H, D=D, HALF=half, BLOCK_D=triton.next_power_of_2(D), MROPE=mrope, num_warps=2, **pdl_args(q.device)
    )
    return out


@triton.jit
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, g_ptr,
    s_qn, s_qh, s_qd, s_gn, s_gh,
    s_kcp, s_kco, s_kch, s_kcd, s_vcp, s_vco, s_vch, s_vcd,
    s_btb, s_on, s_oh, s_od,
    s_pon, s_poh, s_pos, s_pmn, s_pmh,
    page_size, qk_scale_log2,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, GATED: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    qblk = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    # The batch's index tensors are written before the step, never by the kernel just before this one (which
    # writes q and the new K/V): they load while that kernel finishes.
    q_start = tl.load(qsl_ptr + b)
    qlen = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    pdl_prologue(USE_PDL)
    if qblk * BLOCK_Q < qlen:
        ctx = seq_len - qlen  # earlier context: query j sits at position ctx + j

        rows = tl.arange(0, BLOCK_M)
        qi = qblk * BLOCK_Q + rows // G
        head = kvh * G + rows % G
        row_ok = (rows < BLOCK_Q * G) & (qi < qlen)
        q_pos = ctx + qi
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < D
        tok = (q_start + qi).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * s_qn + head[:, None] * s_qh + dd[None, :] * s_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # Keys this program may need: up to the last query position of its block; split evenly by tiles.
        kv_end = tl.minimum(seq_len, ctx + tl.minimum(qlen, (qblk + 1) * BLOCK_Q))
        n_tiles = tl.cdiv(kv_end, TILE_N)
        per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        t_lo = split * per_split
        t_hi = tl.minimum(t_lo + per_split, n_tiles)

        # Finite start for the running maxima: a row with no visible key yet keeps exp2(m_old - m_new) at 1.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        cols = tl.arange(0, TILE_N)
        for t in range(t_lo, t_hi):
            n = t * TILE_N + cols
            n_ok = n < kv_end
            page = tl.load(bt_ptr + b * s_btb + n // page_size, mask=n_ok, other=0).to(tl.int64)
            off = n % page_size
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(kc_ptr + page[:, None] * s_kcp + off[:, None] * s_kco + kvh * s_kch + dd[None, :] * s_kcd,
                        mask=kv_mask, other=0.0)
            v = tl.load(vc_ptr + page[:, None] * s_vcp + off[:, None] * s_vco + kvh * s_vch + dd[None, :] * s_vcd,
                        mask=kv_mask, other=0.0)  # beside k: both in flight at once
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
            visible = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            if GATED:
                g = tl.load(g_ptr + tok[:, None] * s_gn + head[:, None] * s_gh + dd[None, :], mask=out_mask,
                            other=0.0)
                o = _gate(o, g, o_ptr.dtype.element_ty)
            tl.store(o_ptr + tok[:, None] * s_on + head[:, None] * s_oh + dd[None, :] * s_od,
                     o.to(o_ptr.dtype.element_ty), mask=out_mask)
        else:
            # Unnormalised partial state of this split; maxima are in the log2 domain.
            tl.store(po_ptr + tok[:, None] * s_pon + head[:, None] * s_poh + split * s_pos + dd[None, :],
                     acc, mask=out_mask)
            tl.store(pm_ptr + tok * s_pmn + head * s_pmh + split, m_i, mask=row_ok)
            tl.store(pl_ptr + tok * s_pmn + head * s_pmh + split, l_i, mask=row_ok)


@triton.jit
def _gate(o, g, dtype: tl.constexpr):
    """o * sigmoid(g) rounded as the unfused torch ops round: o to dtype, sigmoid(g) to dtype, the product."""
    s = tl.sigmoid(g.to(tl.float32)).to(dtype).to(tl.float32)
    return o.to(dtype).to(tl.float32) * s


@triton.jit
def _merge_splits_kernel(
    po_ptr, pm_ptr, pl_ptr, o_ptr, g_ptr,
    s_pon, s_poh, s_pos, s_pmn, s_pmh, s_on, s_oh, s_od, s_gn, s_gh,
    NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, GATED: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    dd = tl.arange(0, BLOCK_D)
    m = tl.load(pm_ptr + n * s_pmn + h * s_pmh + sp)
    l_ = tl.load(pl_ptr + n * s_pmn + h * s_pmh + sp)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    acc = tl.load(po_ptr + n * s_pon + h * s_poh + sp[:, None] * s_pos + dd[None, :], mask=(dd < D)[None, :],
                  other=0.0)
    o = tl.sum(acc * w[:, None], axis=0)
    denom = tl.sum(l_ * w, axis=0)
    o = o / tl.where(denom > 0, denom, 1.0)
    if GATED:
        o = _gate(o, tl.load(g_ptr + n * s_gn + h * s_gh + dd, mask=dd < D, other=0.0), o_ptr.dtype.element_ty)
    tl.store(o_ptr + n * s_on + h * s_oh + dd * s_od, o.to(o_ptr.dtype.element_ty), mask=dd < D)


def _decode_splits(batch: int, kv_heads: int, max_seq_len: int, tile_n: int, choices: Mapping[str, int]) -> int:
    """Splits of the context for a decode batch: about ``decode_programs`` programs (eight per SM measured best
    on the H200 for B = 1..8 at 1k..8k context), at least two tiles per split of the longest context, at most
    ``max_decode_splits``. A power of two. Only speed depends on it: the ranges are computed in the kernel, so a
    graph captured with one max_seq_len stays right for any context."""
    want = triton.cdiv(choices["decode_programs"], max(batch * kv_heads, 1))
    most = triton.cdiv(max(max_seq_len, 1), 2 * tile_n)
    s = max(1, min(want, most, choices["max_decode_splits"]))
    return 1 << (s.bit_length() - 1)


def launch_config(batch: int, kv_heads: int, group: int, max_query_len: int, max_seq_len: int,
                  device: tuning.DeviceKey, *, tile_n: int | None = None, block_q: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None
                  ) -> tuple[int, int, int, int, int, int]:
    """(tile_n, block_q, block_m, num_splits, num_warps, num_stages) of a paged-attention launch: the given
    values, the rest from ``device``'s tuning table (``tables/attention.json``)."""
    decode = max_query_len <= 1
    c = tuning.choices("attention", device)
    tile_n = tile_n or (c["decode_tile_n"] if decode else c["prefill_tile_n"])
    if block_q is None:
        # Prefill: prefill_rows score rows per program (128 measured best on the H200 for head_dim 256, G = 4).
        block_q = 1 if decode else max(1, c["prefill_rows"] // group)
    block_q = min(block_q, triton.next_power_of_2(max(max_query_len, 1)))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    if num_splits is None:
        num_splits = _decode_splits(batch, kv_heads, max_seq_len, tile_n, c) if decode else 1
    if num_splits & (num_splits - 1):
        raise ValueError(f"paged_attention: num_splits must be a power of two, got {num_splits}")
    if num_warps is None:
        num_warps = 4 if block_m <= 16 else 8
    if num_stages is None:
        num_stages = c["decode_stages"] if decode else c["prefill_stages"]
    return tile_n, block_q, block_m, num_splits, num_warps, num_stages


def paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int, max_seq_len: int,
    scale: float, *, out=None, num_splits: int | None = None, block_q: int | None = None,
    tile_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None, gate=None,
):
    """Causal attention of packed queries over their paged history (see ``ninfer.ops.attention``); with
    ``gate`` [N, H, D] (unit stride inside a head) the output is o * sigmoid(gate), applied as the epilogue."""
    N, H, D = q.shape
    P, page_size, KVH, Dk = k_cache.shape
    B = seq_lens.shape[0]
    if Dk != D or v_cache.shape != k_cache.shape or H % KVH != 0:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} and caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} do not fit")
    if tuple(query_start_loc.shape) != (B + 1,) or block_tables.shape[0] != B:
        raise ValueError("paged_attention: query_start_loc must be [B+1] and block_tables [B, Pmax]")
    if block_tables.stride(1) != 1:
        raise ValueError("paged_attention: block_tables rows must be contiguous")
    if gate is not None and (tuple(gate.shape) != (N, H, D) or gate.stride(2) != 1):
        raise ValueError(f"paged_attention: gate {tuple(gate.shape)} must be [N, H, D] = {(N, H, D)} with unit "
                         "stride in a head")
    if out is None:
        out = torch.empty_like(q)
    if N == 0 or B == 0:
        return out
    g_arg, s_gn, s_gh = (gate, gate.stride(0), gate.stride(1)) if gate is not None else (out, 0, 0)
    G = H // KVH
    tile_n, block_q, block_m, num_splits, num_warps, num_stages = launch_config(
        B, KVH, G, max_query_len, max_seq_len, tuning.device_key(q), tile_n=tile_n, block_q=block_q,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    block_d = triton.next_power_of_2(D)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if num_splits > 1:
        part_o = torch.empty((N, H, num_splits, D), dtype=torch.float32, device=q.device)
        part_m = torch.empty((N, H, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # unused by the kernel
    grid = (triton.cdiv(max(max_query_len, 1), block_q), B, KVH * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_o, part_m, part_l, g_arg,
        *q.stride(), s_gn, s_gh, *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if num_splits > 1 else 0,
        part_m.stride(0), part_m.stride(1),
        page_size, scale * 1.4426950408889634,
        G=G, D=D, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=precision, GATED=gate is not None, num_warps=num_warps, num_stages=num_stages,
        **pdl_args(q.device)
    )
    if num_splits > 1:
        _merge_splits_kernel[(N, H)](
            part_o, part_m, part_l, out, g_arg,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
            *out.stride(), s_gn, s_gh, NUM_SPLITS=num_splits, D=D, BLOCK_D=block_d, GATED=gate is not None,
            num_warps=4, **pdl_args(q.device)
        )
    return out


def paged_attention_gated(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int,
                          max_seq_len: int, scale: float, gate, **config):
    """paged_attention(...) * sigmoid(gate) in one pass (attention's output gate as the epilogue); dispatched
    under its own name so the plain kernel's validation does not cover it."""
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                           max_seq_len, scale, gate=gate, **config)
