"""QSA block selection (Qwen4Exp's sparse attention indexer) over a paged store of raw indexer keys.

The indexer splits a sequence into blocks of ``compress_ratio`` consecutive tokens. A block is complete for a
query once all its tokens are visible (positions <= the query's). Each complete block has one key: the mean of its
tokens' raw keys (fp32, rounded to the keys' dtype), RMS-normed with (1 + w) and rotated at the position of its
first token. A query scores block b as sum over its index heads of relu(q_h . k_b) / sqrt(D), fp32, and keeps its
``block_topk`` best complete blocks (all of them while there are no more than that; of equal scores, the earlier
block). The attention then reads those blocks' tokens plus the open tail (the visible tokens after the last
complete block): ``paged_attention`` with ``selected_blocks``, or ``qsa_attention_static``.

Blocks are runs of token indices (cache rows). Without ``key_positions`` a token's rotary position is its index
(text RoPE). A sequence with media (MRoPE) rotates by the (t, h, w) positions each token was given, so the caller
pages them beside the keys (``key_positions``) and names the axis each frequency slot reads (``rope_axes``, as
``ninfer.ops.rope.mrope_axes``): a block key then rotates at its first token's (t, h, w). Text tokens' positions
are (p, p, p), which rotate exactly as p alone.
"""

from __future__ import annotations

import math

import torch

from ninfer.ops.dispatch import triton_kernel
from ninfer.ops.norm import rms_norm
from ninfer.ops.rope import apply_rope, rope_angles_cos_sin

# Rows of queries scored at once: bounds the [rows, blocks] score temporaries of a long prefill.
_SCORE_ELEMS = 1 << 24


def _check(q, index_keys, block_tables, seq_lens, query_start_loc, k_norm, rope_inv_freq, rotary_dim,
           compress_ratio, block_topk, key_positions, rope_axes) -> None:
    B = seq_lens.shape[0]
    di = index_keys.shape[-1] if index_keys.dim() == 3 else None
    if q.dim() != 3 or index_keys.dim() != 3 or q.shape[2] != di or k_norm.shape != (di,) \
            or block_tables.dim() != 2 or block_tables.shape[0] != B or query_start_loc.shape != (B + 1,):
        raise ValueError(f"qsa_select: q {tuple(q.shape)} (want [N, heads, D]), index_keys "
                         f"{tuple(index_keys.shape)} (want [pages, page_size, D]), k_norm {tuple(k_norm.shape)}, "
                         f"block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}, "
                         f"query_start_loc {tuple(query_start_loc.shape)} do not fit")
    if rotary_dim <= 0 or rotary_dim > di or rotary_dim != 2 * rope_inv_freq.numel():
        raise ValueError(f"qsa_select: rotary_dim {rotary_dim} must be 2 * len(rope_inv_freq) "
                         f"({rope_inv_freq.numel()}) and fit the index head ({di})")
    if compress_ratio < 1 or block_topk < 1:
        raise ValueError(f"qsa_select: compress_ratio {compress_ratio} and block_topk {block_topk} must be positive")
    if (key_positions is None) != (rope_axes is None):
        raise ValueError("qsa_select: key_positions and rope_axes go together (MRoPE block keys need both)")
    if key_positions is not None and (
            key_positions.shape != (*index_keys.shape[:2], 3) or key_positions.dtype.is_floating_point
            or rope_axes.shape != rope_inv_freq.shape):
        raise ValueError(f"qsa_select: key_positions {tuple(key_positions.shape)} {key_positions.dtype} must be "
                         f"integer [{index_keys.shape[0]}, {index_keys.shape[1]}, 3] (paged as index_keys) and "
                         f"rope_axes {tuple(rope_axes.shape)} one entry per frequency slot ({rope_inv_freq.numel()})")


def block_keys(keys: torch.Tensor, k_norm: torch.Tensor, eps: float, rope_inv_freq: torch.Tensor,
               rotary_dim: int, compress_ratio: int, positions: torch.Tensor | None = None,
               rope_axes: torch.Tensor | None = None) -> torch.Tensor:
    """[blocks, D]: the pooled, normed and rotated key of each complete block of one sequence's raw keys
    ``keys`` [L, D]. Token t sits at position t, or at ``positions[t]`` [L, 3] (t, h, w) read through
    ``rope_axes`` (MRoPE)."""
    nb = keys.shape[0] // compress_ratio
    pooled = keys[:nb * compress_ratio].view(nb, compress_ratio, -1).float().mean(1).to(keys.dtype)
    normed = rms_norm(pooled, k_norm, eps)
    if positions is None:
        starts = torch.arange(nb, device=keys.device) * compress_ratio
    else:  # each block's first token's (t, h, w): [3, nb]
        starts = positions[:nb * compress_ratio:compress_ratio].T.long()
    cos, sin = rope_angles_cos_sin(starts, rope_inv_freq, keys.dtype, rope_axes)
    return apply_rope(normed[:, None, :], cos, sin, rotary_dim)[:, 0]


def qsa_select(q: torch.Tensor, index_keys: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, k_norm: torch.Tensor, eps: float, rope_inv_freq: torch.Tensor,
               rotary_dim: int, compress_ratio: int, block_topk: int, *, key_positions: torch.Tensor | None = None,
               rope_axes: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [N, block_topk]: the blocks each packed query keeps, ascending, -1 after them.

    ``q`` [N, heads, D]: the indexer queries, already q-normed and rotated at their positions (sequence i owns
    rows query_start_loc[i]:[i+1]; its query j sits at position seq_lens[i] - qlen_i + j). ``index_keys``
    [num_pages, page_size, D]: one layer's raw indexer keys, token t of sequence i at page block_tables[i,
    t // page_size], row t % page_size, written for every token up to seq_lens[i] before the call. ``k_norm``,
    ``eps``: the block keys' RMSNorm ((1 + w)); ``rope_inv_freq`` [rotary_dim // 2]: the attention's rotary rates
    (``ninfer.ops.rope_inv_freq``). Block b covers tokens [b * compress_ratio, (b + 1) * compress_ratio).

    MRoPE: ``key_positions`` [num_pages, page_size, 3] integer, paged as ``index_keys``: each token's (t, h, w)
    rotary positions (written with its key), and ``rope_axes`` [rotary_dim // 2] (``ninfer.ops.rope.mrope_axes``):
    each block key rotates at its first token's; ``q`` comes rotated at the queries' own. Without them token t's
    position is t.
    """
    _check(q, index_keys, block_tables, seq_lens, query_start_loc, k_norm, rope_inv_freq, rotary_dim,
           compress_ratio, block_topk, key_positions, rope_axes)
    N, heads, D = q.shape
    page = index_keys.shape[1]
    out = torch.full((N, block_topk), -1, dtype=torch.int32, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    root = math.sqrt(D)
    slots = torch.arange(block_topk, device=q.device)
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        qlen = hi - lo
        if qlen > seq_len:
            raise ValueError(f"qsa_select: sequence {i} has {qlen} queries but only {seq_len} tokens")
        # Blocks complete for each query: those ending at or before its position.
        complete = torch.div(torch.arange(seq_len - qlen + 1, seq_len + 1, device=q.device), compress_ratio,
                             rounding_mode="floor")
        # While a query has no more complete blocks than the budget it keeps them all.
        out[lo:hi] = torch.where(slots[None, :] < complete[:, None], slots[None, :], -1).to(torch.int32)
        nb = seq_len // compress_ratio
        if qlen == 0 or nb <= block_topk:
            continue
        pages = block_tables[i, :-(-seq_len // page)].long()
        keys = index_keys[pages].reshape(-1, D)[:seq_len]
        positions = None if key_positions is None else key_positions[pages].reshape(-1, 3)[:seq_len]
        kb = block_keys(keys, k_norm, eps, rope_inv_freq, rotary_dim, compress_ratio, positions,
                        rope_axes).float().T  # [D, nb]
        step = max(1, _SCORE_ELEMS // nb)
        for r in range(0, qlen, step):
            qs = q[lo + r:lo + min(r + step, qlen)].float()
            scores = torch.relu(qs[:, 0] @ kb)
            for h in range(1, heads):
                scores += torch.relu(qs[:, h] @ kb)
            scores /= root
            _keep_top(scores, complete[r:r + qs.shape[0]].tolist(), block_topk, out[lo + r:lo + r + qs.shape[0]])
    return out


def _keep_top(scores: torch.Tensor, complete: list[int], block_topk: int, out: torch.Tensor) -> None:
    """Write into ``out`` the ascending top ``block_topk`` of each row of ``scores`` [rows, blocks] among its
    complete blocks, for the rows with more complete blocks than that.

    Relu scores tie at zero often (every index head negative). A tie goes to the earlier block (a stable sort),
    as in ``qsa_select_static``, so eager and graph-captured decode choose alike. (transformers keeps torch.topk's
    order, which its algorithm and the row's length decide; the sets differ only at such a tie.) The rows of one
    complete count (consecutive, as positions are) share one sort.
    """
    r = 0
    while r < len(complete):
        c = complete[r]
        end = r + 1
        while end < len(complete) and complete[end] == c:
            end += 1
        if c > block_topk:
            top = torch.sort(scores[r:end, :c], dim=1, descending=True, stable=True).indices[:, :block_topk]
            out[r:end] = top.sort(dim=1).values.to(torch.int32)
        r = end


def qsa_select_static(q: torch.Tensor, index_keys: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, k_norm: torch.Tensor, eps: float,
                      rope_inv_freq: torch.Tensor, rotary_dim: int, compress_ratio: int, block_topk: int,
                      max_blocks: int, *, key_positions: torch.Tensor | None = None,
                      rope_axes: torch.Tensor | None = None) -> torch.Tensor:
    """``qsa_select`` with static shapes and no host reads, so a CUDA graph can capture it: int32 [N, block_topk],
    each query's kept blocks ascending, -1 after them.

    ``max_blocks`` (a host int) bounds the complete blocks of every row: each sequence's block keys are built for
    blocks 0..max_blocks-1 through its block table (tokens past seq_lens read whatever the pages hold and are masked
    out, as are the blocks a query cannot see yet); blocks at or past max_blocks are never chosen, so the caller
    must make it cover the longest sequence. A tie goes to the earlier block, as in ``qsa_select``.
    """
    _check(q, index_keys, block_tables, seq_lens, query_start_loc, k_norm, rope_inv_freq, rotary_dim,
           compress_ratio, block_topk, key_positions, rope_axes)
    if max_blocks < 0:
        raise ValueError(f"qsa_select_static: max_blocks {max_blocks} must not be negative")
    N = q.shape[0]
    out = torch.full((N, block_topk), -1, dtype=torch.int32, device=q.device)
    if N == 0 or max_blocks == 0:
        return out
    M = max_blocks
    seq, pos = query_positions(query_start_loc, seq_lens, N)
    complete = torch.div(pos + 1, compress_ratio, rounding_mode="floor")  # [N]
    args = (q, index_keys, block_tables, seq, pos, k_norm, eps, rope_inv_freq, rotary_dim, compress_ratio, M,
            key_positions, rope_axes)
    kernel = triton_kernel("qsa", "qsa_block_scores", q)
    scores = kernel(*args) if kernel is not None else qsa_block_scores_ref(*args)
    out[:, :min(block_topk, M)] = top_blocks(scores, complete, min(block_topk, M))
    return out


def qsa_block_scores_ref(q: torch.Tensor, index_keys: torch.Tensor, block_tables: torch.Tensor, seq: torch.Tensor,
                         pos: torch.Tensor, k_norm: torch.Tensor, eps: float, rope_inv_freq: torch.Tensor,
                         rotary_dim: int, compress_ratio: int, max_blocks: int, key_positions: torch.Tensor | None,
                         rope_axes: torch.Tensor | None) -> torch.Tensor:
    """fp32 [N, max_blocks]: query n's score of blocks 0..max_blocks-1 of its sequence ``seq[n]`` (the
    ``query_positions``; ``pos`` [N] its position), those it can see (b < (pos + 1) // compress_ratio) as
    ``qsa_select`` scores them, the others unspecified. The reference builds every row's block keys in runs of
    blocks that bound the gathered keys' temporaries; the Triton kernel builds only the blocks a query sees."""
    N, heads, D = q.shape
    B, M = block_tables.shape[0], max_blocks
    scores = torch.empty(N, M, dtype=torch.float32, device=q.device)
    run = max(1, _SCORE_ELEMS // max(1, max(B, N) * compress_ratio * D))
    qf = q.float()
    for b0 in range(0, M, run):
        b1 = min(M, b0 + run)
        kb = _block_keys_paged(index_keys, block_tables, b0, b1, k_norm, eps, rope_inv_freq, rotary_dim,
                               compress_ratio, key_positions, rope_axes)
        kq = kb[seq].transpose(1, 2)  # [N, D, b1 - b0]
        part = torch.relu(torch.bmm(qf[:, 0:1], kq))[:, 0]
        for h in range(1, heads):
            part += torch.relu(torch.bmm(qf[:, h:h + 1], kq))[:, 0]
        scores[:, b0:b1] = part / math.sqrt(D)
    return scores


def top_blocks(scores: torch.Tensor, complete: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, k]: each row's best ``k`` blocks among its first ``complete`` [N] of ``scores`` fp32 [N, M] (relu
    sums, >= 0), ties to the earlier block, ascending, -1 after. One topk, not a sort of all M blocks: each block
    gets a unique int64 key, the score's bits above (+ 0.0 turns a -0.0 into +0.0, so the fp32 bits of a
    non-negative score order as its value) and the block's distance from the end below; blocks not yet complete
    get -1."""
    M = scores.shape[1]
    blocks = torch.arange(M, device=scores.device)
    key = ((scores + 0.0).view(torch.int32).long() << 32) | (M - 1 - blocks)
    key = torch.where(blocks[None, :] < complete[:, None], key, -1)
    top = key.topk(k, dim=1).values
    chosen = torch.where(top >= 0, M - 1 - (top & 0xFFFFFFFF), M).sort(dim=1).values  # unused slots last
    return torch.where(chosen < M, chosen, -1).to(torch.int32)


def _block_keys_paged(index_keys: torch.Tensor, block_tables: torch.Tensor, b0: int, b1: int, k_norm: torch.Tensor,
                      eps: float, rope_inv_freq: torch.Tensor, rotary_dim: int, compress_ratio: int,
                      key_positions: torch.Tensor | None, rope_axes: torch.Tensor | None) -> torch.Tensor:
    """fp32 [B, b1 - b0, D]: ``block_keys`` of blocks b0..b1-1 of every row of ``block_tables``, static shapes.
    Pages past the table's width or unassigned (< 0) read page 0: the caller masks those blocks."""
    num_pages, page, D = index_keys.shape
    B, m, dev = block_tables.shape[0], b1 - b0, index_keys.device
    tok = torch.arange(b0 * compress_ratio, b1 * compress_ratio, device=dev)
    col = torch.div(tok, page, rounding_mode="floor").clamp_(max=block_tables.shape[1] - 1)
    pages = block_tables.to(dev).long()[:, col].clamp_(0, num_pages - 1)  # [B, m * ratio]
    slot = (tok % page)[None, :].expand(B, -1)
    keys = index_keys[pages, slot]  # [B, m * ratio, D]
    pooled = keys.float().view(B, m, compress_ratio, D).mean(2).to(keys.dtype)
    normed = rms_norm(pooled.reshape(B * m, D), k_norm, eps)
    if key_positions is None:
        starts = (torch.arange(b0, b1, device=dev) * compress_ratio).repeat(B)
    else:  # each block's first token's (t, h, w): [3, B * m]
        first = (pages[:, ::compress_ratio], slot[:, ::compress_ratio])
        starts = key_positions[first].reshape(B * m, 3).T.long()
    cos, sin = rope_angles_cos_sin(starts, rope_inv_freq, keys.dtype, rope_axes)
    return apply_rope(normed[:, None, :], cos, sin, rotary_dim)[:, 0].float().view(B, m, D)


def query_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_queries: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence [N], position [N]) of each packed query, int64, from the device tensors alone (no host read):
    sequence i's queries are the last ``query_start_loc[i + 1] - query_start_loc[i]`` of its ``seq_lens[i]``."""
    dev = seq_lens.device
    rows = torch.arange(num_queries, device=dev)
    qsl = query_start_loc.to(dev).long()
    seq = torch.searchsorted(qsl[1:], rows, right=True).clamp_(max=seq_lens.shape[0] - 1)
    return seq, seq_lens.long()[seq] - (qsl[seq + 1] - rows)


def qsa_attention_static(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, selected_blocks: torch.Tensor,
                         block_size: int, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention`` with ``selected_blocks`` in static shapes and no host reads (what a CUDA graph captures):
    o [N, H, D] for packed queries q [N, H, D] over each one's chosen blocks ``selected_blocks`` int32 [N, topk]
    (-1 unused; complete blocks, as ``qsa_select`` keeps them) and its open tail, fp32 softmax, then
    ``o * sigmoid(gate)`` with ``gate``. Every query gathers exactly ``(topk + 1) * block_size`` keys through its
    block table, the tokens it may not read masked: it reads the selection's tokens, not the whole context. Its
    Triton kernel (``ninfer.ops.triton.qsa``) walks the same list with an online softmax."""
    N, H, D = q.shape
    num_pages, page, kvh = k_cache.shape[:3]
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape[3] != D or H % kvh or v_cache.shape != k_cache.shape \
            or selected_blocks.dim() != 2 or selected_blocks.shape[0] != N or block_size < 1 \
            or (gate is not None and gate.shape != q.shape):
        raise ValueError(f"qsa_attention_static: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}, selected_blocks {tuple(selected_blocks.shape)}, block_size "
                         f"{block_size}, gate {None if gate is None else tuple(gate.shape)} do not fit")
    kernel = triton_kernel("qsa", "qsa_attention_static", q)
    if kernel is not None:
        return kernel(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, selected_blocks, block_size,
                      scale, gate)
    return qsa_attention_static_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, selected_blocks,
                                    block_size, scale, gate)


def qsa_attention_static_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                             selected_blocks: torch.Tensor, block_size: int, scale: float,
                             gate: torch.Tensor | None = None) -> torch.Tensor:
    N, H, D = q.shape
    num_pages, page, kvh = k_cache.shape[:3]
    seq, pos = query_positions(query_start_loc, seq_lens, N)
    dev = q.device
    tail = torch.div(pos + 1, block_size, rounding_mode="floor")  # the open tail's block: it ends at the query
    blocks = torch.cat([selected_blocks.long(), tail[:, None]], dim=1)  # [N, topk + 1]
    key_pos = blocks[:, :, None] * block_size + torch.arange(block_size, device=dev)
    readable = ((blocks[:, :, None] >= 0) & (key_pos <= pos[:, None, None])).flatten(1)  # [N, L]
    key_pos = key_pos.flatten(1).clamp_(min=0)
    col = torch.div(key_pos, page, rounding_mode="floor").clamp_(max=block_tables.shape[1] - 1)
    pages = block_tables.long()[seq[:, None], col].clamp_(0, num_pages - 1)
    slot = key_pos % page
    keys, values = k_cache[pages, slot].float(), v_cache[pages, slot].float()  # [N, L, kvh, D]
    # A masked key's weight is 0, but its slot may hold anything (a NaN from unwritten memory): zero its value.
    values = torch.where(readable[:, :, None, None], values, 0.0)
    qg = q.float().view(N, kvh, H // kvh, D)
    scores = torch.einsum("nkgd,nlkd->nkgl", qg, keys) * scale
    scores = scores.masked_fill(~readable[:, None, None, :], float("-inf"))
    o = torch.einsum("nkgl,nlkd->nkgd", scores.softmax(-1), values).reshape(N, H, D).to(q.dtype)
    return o if gate is None else o * torch.sigmoid(gate)
