"""Causal attention over a paged KV cache: the K/V write and attention for decode rows and prefill chunks.

A cache is [num_pages, page_size, kv_heads, head_dim]; token t of sequence i lives in page
block_tables[i, t // page_size] at offset t % page_size. Query head h reads kv head h // (H // KVH).
"""

from __future__ import annotations

import torch

from ninfer.ops.dispatch import triton_kernel


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    kvh, d = k_cache.shape[2:]
    k_cache.view(-1, kvh, d)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, kvh, d)[slot_mapping] = v.to(v_cache.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V [N, KVH, D] at flat cache slots slot_mapping[N] (page * page_size + offset)."""
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or v_cache.shape != k_cache.shape \
            or slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)} do not fit")
    kernel = triton_kernel("attention", "write_kv", k)
    if kernel is not None:
        return kernel(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def _check_norm_rope_write_kv(q, k, v, q_weight, k_weight, positions, inv_freq, k_cache, slot_mapping,
                              axes=None) -> None:
    N, D = q.shape[0], q.shape[-1]
    mrope = axes is not None and positions.shape == (3, N) and axes.shape == inv_freq.shape
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or k.shape[0] != N or k.shape[1:] != k_cache.shape[2:] \
            or k.shape[2] != D or q_weight.shape != (D,) or k_weight.shape != (D,) \
            or (positions.shape != (N,) and not mrope) or slot_mapping.shape != (N,) or 2 * inv_freq.numel() > D:
        raise ValueError(f"norm_rope_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"norm weights {tuple(q_weight.shape)} / {tuple(k_weight.shape)}, positions "
                         f"{tuple(positions.shape)} (axes {None if axes is None else tuple(axes.shape)}), inv_freq "
                         f"{tuple(inv_freq.shape)}, cache {tuple(k_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)} do not fit")


def _norm_rope_write_kv_steps(norm, rope, store, q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache,
                              v_cache, slot_mapping, axes) -> torch.Tensor:
    """The op as its unfused sequence, with the given rms_norm / apply_rope / write_kv implementations."""
    from ninfer.ops.rope import rope_angles_cos_sin

    _check_norm_rope_write_kv(q, k, v, q_weight, k_weight, positions, inv_freq, k_cache, slot_mapping, axes)
    cos, sin = rope_angles_cos_sin(positions, inv_freq, q.dtype, axes)
    rot = 2 * inv_freq.numel()
    store(rope(norm(k, k_weight, eps), cos, sin, rot), v, k_cache, v_cache, slot_mapping)
    return rope(norm(q, q_weight, eps), cos, sin, rot)


def norm_rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                           axes: torch.Tensor | None = None) -> torch.Tensor:
    from ninfer.ops.norm import rms_norm_ref
    from ninfer.ops.rope import apply_rope_ref

    return _norm_rope_write_kv_steps(rms_norm_ref, apply_rope_ref, write_kv_ref, q, k, v, q_weight, k_weight, eps,
                                     positions, inv_freq, k_cache, v_cache, slot_mapping, axes)


def norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                       axes: torch.Tensor | None = None) -> torch.Tensor:
    """The attention inputs of Qwen3.5 in one op: the per-head (1 + w) RMSNorm of q [N, H, D] and k [N, KVH, D],
    rotary embedding at ``positions`` (rates ``inv_freq``, the first 2 * len(inv_freq) dims), and the store of
    the new k and v [N, KVH, D] at ``slot_mapping``. Returns the new q [N, H, D]. Normed values and cos/sin are
    rounded to q's dtype before the rotation, as the unfused sequence does. MRoPE: ``positions`` [3, N] (t, h, w)
    and ``axes`` (``ninfer.ops.rope.mrope_axes``: the row each frequency slot reads).

    Without the fused kernel this is that sequence of dispatched ops (rms_norm, apply_rope, write_kv). The MRoPE
    form of the kernel is its own entry (``norm_rope_write_kv_mrope``, listed since its GPU test passed).
    """
    if axes is None:
        kernel = triton_kernel("attention", "norm_rope_write_kv", q)
        if kernel is not None:
            return kernel(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping)
    else:
        kernel = triton_kernel("attention", "norm_rope_write_kv_mrope", q)
        if kernel is not None:
            return kernel(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping,
                          axes)
    from ninfer.ops.norm import rms_norm
    from ninfer.ops.rope import apply_rope

    return _norm_rope_write_kv_steps(rms_norm, apply_rope, write_kv, q, k, v, q_weight, k_weight, eps, positions,
                                     inv_freq, k_cache, v_cache, slot_mapping, axes)


def _selection_mask(selected: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """bool [qlen, seq_len]: the keys each query may read beyond causality, the tokens of its selected blocks
    ``selected`` [qlen, topk] (-1 unused) and its open tail (the positions after its last complete block)."""
    n_blocks = int(k_pos.shape[0]) // block_size + 2  # every block a key can sit in, plus one column for -1
    picked = torch.zeros(selected.shape[0], n_blocks, dtype=torch.bool, device=selected.device)
    picked.scatter_(1, torch.where(selected >= 0, selected.long(), n_blocks - 1), True)
    picked[:, -1] = False
    tail_start = torch.div(q_pos + 1, block_size, rounding_mode="floor") * block_size
    in_block = torch.div(k_pos, block_size, rounding_mode="floor")
    return picked[:, in_block] | (k_pos[None, :] >= tail_start[:, None])


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                        max_seq_len: int, scale: float, *, selected_blocks: torch.Tensor | None = None,
                        block_size: int | None = None) -> torch.Tensor:
    N, H, D = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    group = H // kvh
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        qlen = hi - lo
        if qlen == 0:
            continue
        pages = block_tables[i, :-(-seq_len // page)].long()
        keys = k_cache[pages].reshape(-1, kvh, D)[:seq_len].float().repeat_interleave(group, dim=1)
        values = v_cache[pages].reshape(-1, kvh, D)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), keys) * scale  # [H, qlen, seq_len]
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if selected_blocks is not None:
            hidden |= ~_selection_mask(selected_blocks[lo:hi], q_pos, k_pos, block_size)
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, gate: torch.Tensor | None = None, *, selected_blocks: torch.Tensor | None = None,
                    block_size: int | None = None) -> torch.Tensor:
    """o[N, H, D] for packed queries q[N, H, D] (sequence i owns rows query_start_loc[i]:[i+1]).

    Query j of sequence i sits at position seq_lens[i] - qlen_i + j and attends keys 0..that position of
    the same sequence (its K/V already written with write_kv). Softmax in fp32. Covers decode (qlen 1),
    whole prompts and prefill chunks with earlier context. With ``gate`` [N, H, D] the result is
    o * sigmoid(gate) (Qwen3.5's output gate), the same as applying it to the plain output.

    Sparse (QSA): with ``selected_blocks`` int32 [N, topk] (``ninfer.ops.qsa.qsa_select``; -1 unused) and
    ``block_size``, the query at position p reads key k <= p only if k >= ((p + 1) // block_size) * block_size
    (the open tail) or k // block_size is one of its selected blocks. This form runs the reference everywhere.
    """
    B = seq_lens.shape[0]
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] \
            or block_tables.shape[0] != B or query_start_loc.shape != (B + 1,):
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, block_tables "
                         f"{tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}, query_start_loc "
                         f"{tuple(query_start_loc.shape)} do not fit")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"paged_attention: gate {tuple(gate.shape)} must have q's shape {tuple(q.shape)}")
    if selected_blocks is not None or block_size is not None:
        if selected_blocks is None or block_size is None or block_size < 1 or selected_blocks.dim() != 2 \
                or selected_blocks.shape[0] != q.shape[0] or selected_blocks.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"paged_attention: selected_blocks "
                             f"{None if selected_blocks is None else (tuple(selected_blocks.shape), selected_blocks.dtype)}"
                             f" (want int [N, topk] for {q.shape[0]} queries) and block_size {block_size} (positive) "
                             "go together")
        # No sparse kernel yet: the reference, on any device.
        o = paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                max_seq_len, scale, selected_blocks=selected_blocks, block_size=block_size)
        return o if gate is None else o * torch.sigmoid(gate)
    if gate is not None:
        kernel = triton_kernel("attention", "paged_attention_gated", q)
        if kernel is not None:
            return kernel(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                          max_seq_len, scale, gate)
        o = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                            max_seq_len, scale)
        return o * torch.sigmoid(gate)
    kernel = triton_kernel("attention", "paged_attention", q)
    if kernel is not None:
        return kernel(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                      scale)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                               max_seq_len, scale)
