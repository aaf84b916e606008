"""QSA on the GPU in static shapes (a CUDA graph captures them): the indexer's block scores
(``qsa_block_scores``) and the sparse attention (``qsa_attention_static``), where each query reads only its
chosen blocks and its open tail, gathered through its block table.

Scores: a program takes one query and ``BLOCK_B`` consecutive blocks of its sequence; a program whose blocks the
query cannot see yet returns before any load, so a step's work follows each sequence's length, not the graphs'
bound. It builds each block key as the reference does (the mean of the block's raw keys rounded to their dtype,
the (1 + w) RMS norm rounded, NeoX RoPE at the block's first position, or its first token's (t, h, w) through the
MRoPE axes, rounded) and scores it against the query's index heads in one dot: sum of relu / sqrt(D). The rotary
half's partner columns are loaded beside the columns (a second read of the same cached rows).

Attention: a program takes one query row, one KV head (its G query heads as the rows of one tile) and one split of the
query's key list: the ``topk`` chosen blocks, then the tail block, ``block_size`` keys each, walked in tiles of
``TILE_N`` keys with an online softmax. Keys a query may not read (an unused slot, -1; the tail past the query)
load nothing. With several splits the partial states merge as paged attention's do (``_merge_splits_kernel``),
the output gate applied there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.attention import _decode_splits, _gate, _merge_splits_kernel

_TILE_N = 32  # keys per tile: eight blocks of four


@triton.jit
def _online_softmax_tile(q, k, v, visible, qk_scale_log2, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One key tile of a flash-style pass (paged attention's loop body, written out there): the scores of q [M, D]
    against k [T, D] (log2 domain, -inf where not ``visible`` [M, T]) folded into the running maxima ``m_i``, sums
    ``l_i`` and output ``acc`` [M, D] with v [T, D]. A row with no visible key yet keeps exp2(m_old - m_new) at 1
    (finite m_i)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _qsa_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, sel_ptr, seq_ptr, pos_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, g_ptr,
    s_qn, s_qh, s_gn, s_gh, s_kcp, s_kco, s_kch, s_vcp, s_vco, s_vch, s_btb, s_sel, s_on, s_oh,
    s_pon, s_poh, s_pos, s_pmn, s_pmh, page_size, qk_scale_log2,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, TOPK: tl.constexpr,
    BS: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GATED: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    n = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    seq = tl.load(seq_ptr + n)
    pos = tl.load(pos_ptr + n)
    pdl_prologue(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    head = kvh * G + rows
    row_ok = rows < G
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    q = tl.load(q_ptr + n * s_qn + head[:, None] * s_qh + dd[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    tail = (pos + 1) // BS  # the open tail's block: its keys up to the query
    n_tiles: tl.constexpr = ((TOPK + 1) * BS + TILE_N - 1) // TILE_N
    per_split: tl.constexpr = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, TILE_N)
    for t in range(t_lo, t_hi):
        idx = t * TILE_N + cols
        slot = idx // BS  # 0..TOPK-1: a chosen block; TOPK: the tail
        chosen = tl.load(sel_ptr + n * s_sel + slot, mask=slot < TOPK, other=-1).to(tl.int64)
        blk = tl.where(slot < TOPK, chosen, tail)
        key = blk * BS + idx % BS
        ok = (slot <= TOPK) & (blk >= 0) & (key <= pos)
        page = tl.load(bt_ptr + seq * s_btb + key // page_size, mask=ok, other=0).to(tl.int64)
        off = key % page_size
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + page[:, None] * s_kcp + off[:, None] * s_kco + kvh * s_kch + dd[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + page[:, None] * s_vcp + off[:, None] * s_vco + kvh * s_vch + dd[None, :],
                    mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_tile(q, k, v, row_ok[:, None] & ok[None, :], qk_scale_log2, m_i, l_i, acc,
                                            DOT_PRECISION)
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if GATED:
            g = tl.load(g_ptr + n * s_gn + head[:, None] * s_gh + dd[None, :], mask=out_mask, other=0.0)
            o = _gate(o, g, o_ptr.dtype.element_ty)
        tl.store(o_ptr + n * s_on + head[:, None] * s_oh + dd[None, :], o.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(po_ptr + n * s_pon + head[:, None] * s_poh + split * s_pos + dd[None, :], acc, mask=out_mask)
        tl.store(pm_ptr + n * s_pmn + head * s_pmh + split, m_i, mask=row_ok)
        tl.store(pl_ptr + n * s_pmn + head * s_pmh + split, l_i, mask=row_ok)


@triton.jit
def _qsa_block_scores_kernel(
    q_ptr, ik_ptr, bt_ptr, seq_ptr, pos_ptr, w_ptr, inv_ptr, kp_ptr, ax_ptr, out_ptr,
    s_qn, s_qh, s_ikp, s_iks, s_btb, s_kpp, s_kps, s_on, page_size, eps, inv_sqrt_d,
    HEADS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROT: tl.constexpr,
    R: tl.constexpr, BLOCK_B: tl.constexpr, MROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    n = tl.program_id(0).to(tl.int64)
    b0 = tl.program_id(1) * BLOCK_B
    seq = tl.load(seq_ptr + n)
    complete = (tl.load(pos_ptr + n) + 1) // R
    pdl_prologue(USE_PDL)
    if b0 < complete:
        blk = b0 + tl.arange(0, BLOCK_B)
        ok = blk < complete
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < D
        half: tl.constexpr = ROT // 2
        # Column d's rotary partner: d + half in the first half, d - half in the second, itself past ROT.
        partner = tl.where(dd < half, dd + half, tl.where(dd < ROT, dd - half, dd))
        mask = ok[:, None] & d_ok[None, :]
        pooled = tl.zeros((BLOCK_B, BLOCK_D), tl.float32)
        pooled_p = tl.zeros((BLOCK_B, BLOCK_D), tl.float32)
        page0 = tl.zeros((BLOCK_B,), tl.int64)
        for r in tl.static_range(R):
            tok = blk.to(tl.int64) * R + r
            page = tl.load(bt_ptr + seq * s_btb + tok // page_size, mask=ok, other=0).to(tl.int64)
            row = ik_ptr + page * s_ikp + (tok % page_size) * s_iks
            pooled += tl.load(row[:, None] + dd[None, :], mask=mask, other=0.0).to(tl.float32)
            pooled_p += tl.load(row[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
            if r == 0:
                page0 = page
        dt = ik_ptr.dtype.element_ty
        pooled = (pooled / R).to(dt).to(tl.float32)
        pooled_p = (pooled_p / R).to(dt).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(pooled * pooled, axis=1) / D + eps)[:, None]
        w = tl.load(w_ptr + dd, mask=d_ok, other=0.0).to(tl.float32)
        w_p = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
        normed = (pooled * rstd * (1.0 + w[None, :])).to(dt).to(tl.float32)
        normed_p = (pooled_p * rstd * (1.0 + w_p[None, :])).to(dt).to(tl.float32)
        rotary = dd < ROT
        j = tl.where(dd < half, dd, dd - half)  # the frequency slot of column d
        inv = tl.load(inv_ptr + j, mask=rotary, other=0.0).to(tl.float32)
        if MROPE:  # the block's first token's (t, h, w), the axis each frequency slot reads
            axis = tl.load(ax_ptr + j, mask=rotary, other=0)
            start = tl.load(kp_ptr + page0[:, None] * s_kpp + ((blk.to(tl.int64) * R) % page_size)[:, None] * s_kps
                            + axis[None, :], mask=ok[:, None] & rotary[None, :], other=0).to(tl.float32)
        else:
            start = (blk * R).to(tl.float32)[:, None]
        angle = start * inv[None, :]
        cos = tl.cos(angle).to(dt).to(tl.float32)
        sin = tl.sin(angle).to(dt).to(tl.float32)
        sign = tl.where(dd < half, -1.0, 1.0)[None, :]
        key = tl.where(rotary[None, :], (normed * cos + sign * normed_p * sin).to(dt).to(tl.float32), normed)
        rows = tl.arange(0, BLOCK_M)
        qv = tl.load(q_ptr + n * s_qn + rows[:, None] * s_qh + dd[None, :],
                     mask=(rows < HEADS)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        dots = tl.dot(qv, tl.trans(key), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_B]
        score = tl.sum(tl.maximum(dots, 0.0), axis=0) * inv_sqrt_d
        tl.store(out_ptr + n * s_on + blk, score, mask=ok)


def qsa_block_scores(q, index_keys, block_tables, seq, pos, k_norm, eps: float, rope_inv_freq, rotary_dim: int,
                     compress_ratio: int, max_blocks: int, key_positions=None, rope_axes=None):
    """``ninfer.ops.qsa.qsa_block_scores_ref`` (same arguments; blocks a query cannot see are left unwritten) as one
    launch over (query, runs of 16 blocks)."""
    N, heads, D = q.shape
    if index_keys.shape[-1] != D or index_keys.stride(-1) != 1 or q.stride(-1) != 1 or block_tables.stride(1) != 1:
        raise ValueError(f"qsa_block_scores: q {tuple(q.shape)} and index_keys {tuple(index_keys.shape)} must share "
                         "a contiguous head dim, block_tables' rows contiguous")
    out = torch.empty((N, max_blocks), dtype=torch.float32, device=q.device)
    if N == 0 or max_blocks == 0:
        return out
    mrope = key_positions is not None
    kp = (key_positions if key_positions.stride(2) == 1 else key_positions.contiguous()) if mrope else index_keys
    block_b = 16
    _qsa_block_scores_kernel[(N, triton.cdiv(max_blocks, block_b))](
        q, index_keys, block_tables, seq, pos, k_norm, rope_inv_freq.to(torch.float32),
        kp, rope_axes.to(device=q.device, dtype=torch.int32) if mrope else seq, out,
        q.stride(0), q.stride(1), index_keys.stride(0), index_keys.stride(1), block_tables.stride(0),
        kp.stride(0) if mrope else 0, kp.stride(1) if mrope else 0, out.stride(0), index_keys.shape[1], eps,
        1.0 / math.sqrt(D), HEADS=heads, BLOCK_M=max(16, triton.next_power_of_2(heads)), D=D,
        BLOCK_D=triton.next_power_of_2(D), ROT=rotary_dim, R=compress_ratio, BLOCK_B=block_b, MROPE=mrope,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, **pdl_args(q.device))
    return out


def qsa_attention_static(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, selected_blocks,
                         block_size: int, scale: float, gate=None, *, num_splits: int | None = None):
    """``ninfer.ops.qsa.qsa_attention_static`` (same arguments and result) as one kernel launch, plus the merge
    of its splits when there are several (``num_splits``: a power of two; default from the attention tuning
    table's decode program count)."""
    from ninfer.ops.qsa import query_positions

    N, H, D = q.shape
    P, page_size, KVH, Dk = k_cache.shape
    topk = selected_blocks.shape[1] if selected_blocks.dim() == 2 else -1
    if Dk != D or v_cache.shape != k_cache.shape or H % KVH or selected_blocks.shape != (N, topk) \
            or block_size < 1 or (gate is not None and gate.shape != q.shape):
        raise ValueError(f"qsa_attention_static: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}, selected_blocks {tuple(selected_blocks.shape)}, block_size "
                         f"{block_size}, gate {None if gate is None else tuple(gate.shape)} do not fit")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1 \
            or (gate is not None and gate.stride(2) != 1):
        raise ValueError("qsa_attention_static: the head dim of q, gate and the caches and block_tables' rows "
                         "must be contiguous")
    out = torch.empty_like(q)
    if N == 0:
        return out
    seq, pos = query_positions(query_start_loc, seq_lens, N)
    sel = selected_blocks if selected_blocks.stride(1) == 1 else selected_blocks.contiguous()
    G = H // KVH
    if num_splits is None:
        choices = tuning.choices("attention", tuning.device_key(q))
        num_splits = _decode_splits(N, KVH, (topk + 1) * block_size, _TILE_N, choices)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"qsa_attention_static: num_splits must be a power of two, got {num_splits}")
    block_d = triton.next_power_of_2(D)
    g_arg, s_gn, s_gh = (gate, gate.stride(0), gate.stride(1)) if gate is not None else (out, 0, 0)
    if num_splits > 1:
        part_o = torch.empty((N, H, num_splits, D), dtype=torch.float32, device=q.device)
        part_m = torch.empty((N, H, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # unused by the kernel
    _qsa_attention_kernel[(N, KVH * num_splits)](
        q, k_cache, v_cache, block_tables, sel, seq, pos, out, part_o, part_m, part_l, g_arg,
        q.stride(0), q.stride(1), s_gn, s_gh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), sel.stride(0),
        out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2) if num_splits > 1 else 0,
        part_m.stride(0), part_m.stride(1), page_size, scale * 1.4426950408889634,
        G=G, D=D, BLOCK_D=block_d, BLOCK_M=max(16, triton.next_power_of_2(G)), TOPK=topk, BS=block_size,
        TILE_N=_TILE_N, NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        GATED=gate is not None, num_warps=4 if G <= 16 else 8, **pdl_args(q.device))
    if num_splits > 1:
        _merge_splits_kernel[(N, H)](
            part_o, part_m, part_l, out, g_arg, part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_m.stride(0), part_m.stride(1), *out.stride(), s_gn, s_gh, NUM_SPLITS=num_splits, D=D,
            BLOCK_D=block_d, GATED=gate is not None, num_warps=4, **pdl_args(q.device))
    return out
