"""QSA's sparse attention on the GPU (``ninfer.ops.qsa.qsa_attention_static``): each query reads only its chosen
blocks and its open tail, gathered through its block table, in static shapes (a CUDA graph captures it).

A program takes one query row, one KV head (its G query heads as the rows of one tile) and one split of the
query's key list: the ``topk`` chosen blocks, then the tail block, ``block_size`` keys each, walked in tiles of
``TILE_N`` keys with an online softmax. Keys a query may not read (an unused slot, -1; the tail past the query)
load nothing. With several splits the partial states merge as paged attention's do (``_merge_splits_kernel``),
the output gate applied there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.attention import _decode_splits, _gate, _merge_splits_kernel

_TILE_N = 32  # keys per tile: eight blocks of four


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
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        s = tl.where(row_ok[:, None] & ok[None, :], s, float("-inf"))
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
            g = tl.load(g_ptr + n * s_gn + head[:, None] * s_gh + dd[None, :], mask=out_mask, other=0.0)
            o = _gate(o, g, o_ptr.dtype.element_ty)
        tl.store(o_ptr + n * s_on + head[:, None] * s_oh + dd[None, :], o.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(po_ptr + n * s_pon + head[:, None] * s_poh + split * s_pos + dd[None, :], acc, mask=out_mask)
        tl.store(pm_ptr + n * s_pmn + head * s_pmh + split, m_i, mask=row_ok)
        tl.store(pl_ptr + n * s_pmn + head * s_pmh + split, l_i, mask=row_ok)


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
