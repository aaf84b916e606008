"""Paged-attention inputs for kernel tests and benchmarks: sequences' K/V pages scattered over a cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def paged_attention_inputs(seqs: Sequence[tuple[int, int]], *, page: int, heads: int, kv_heads: int, head_dim: int,
                           randn: Callable[..., torch.Tensor], randperm: Callable[[int], torch.Tensor],
                           device: torch.device | str) -> tuple:
    """``paged_attention``'s positional inputs (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
    max_query_len, max_seq_len, scale) for sequences given as (query length, earlier context): each sequence's
    pages drawn at random (``randperm``) from a cache with seven spare pages, values from ``randn(*shape)``."""
    seq_lens = [q + c for q, c in seqs]
    pages = [-(-s // page) for s in seq_lens]
    n_pages = sum(pages) + 7
    perm = randperm(n_pages).to(torch.int32)
    block_tables = torch.zeros(len(seqs), max(pages), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(pages):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    k_cache = randn(n_pages, page, kv_heads, head_dim)
    v_cache = randn(n_pages, page, kv_heads, head_dim)
    q_lens = [q for q, _ in seqs]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    q = randn(starts[-1], heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, lens, query_start_loc, max(q_lens), max(seq_lens), head_dim ** -0.5
