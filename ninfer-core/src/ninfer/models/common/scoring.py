"""Causal scoring of one fresh window outside the generation path (temporary StateImage slot and KV pages)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from ninfer.core.batch_assembly import RowInput, build_forward_batch
from ninfer.core.forward_batch import ForwardBatch
from ninfer.core.kv_pool import PagedKVPool, pages_for
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.context.errors import ProgramError


def score_window(token_ids: Sequence[int], score_from: int, *, forward: Callable[[ForwardBatch], torch.Tensor],
                 logits: Callable[[torch.Tensor], torch.Tensor], states: StateImageStorage, pool: PagedKVPool,
                 max_model_len: int, vocab_size: int, launches: contextlib.AbstractContextManager,
                 chunk: int = 1024, logits_rows: int = 256) -> torch.Tensor:
    """fp32 log p(token_ids[i] | token_ids[:i]) for i in score_from..n-1, as one fresh causal window.

    ``forward`` runs a ForwardBatch to final hidden rows and ``logits`` projects hidden rows, as the
    Program's model does; both run inside ``launches`` (the Program's launch scope). The window runs on
    a temporary StateImage slot and KV pages of ``pool``, in prefill chunks of ``chunk`` positions;
    logits are formed ``logits_rows`` at a time, so the scoring staging ([logits_rows, vocab] fp32)
    exists only during this call.
    """
    n = len(token_ids)
    if not 1 <= score_from <= n:
        raise ValueError(f"score_from must be in 1..{n}, got {score_from}")
    if n > max_model_len:
        raise ValueError(f"scoring window of {n} tokens exceeds max_model_len {max_model_len}")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} outside the model vocabulary 0..{vocab_size - 1}")
    page_size = pool.page_size
    need = pages_for(n, page_size)
    if states.num_free == 0 or need > pool.allocator.num_free:
        raise ProgramError(f"scoring window of {n} tokens needs a free StateImage slot and {need} KV pages "
                           f"({states.num_free} slots, {pool.allocator.num_free} pages free)")
    slot = states.allocate()
    pages = pool.allocator.allocate(need)
    dev = states.device.torch
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=dev)
    out = torch.empty(n - score_from, dtype=torch.float32, device=dev)
    try:
        with torch.inference_mode(), launches:
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                batch = build_forward_batch([RowInput(tokens=list(token_ids[start:end]), start=start, slot=slot,
                                                      pages=pages, want_logits=False)], page_size, dev)
                hidden = forward(batch)
                # position p predicts token p + 1
                lo, hi = max(start, score_from - 1), min(end, n - 1)
                for p in range(lo, hi, logits_rows):
                    q = min(p + logits_rows, hi)
                    lp = logits(hidden[p - start:q - start]).float().log_softmax(-1)
                    out[p + 1 - score_from:q + 1 - score_from] = lp.gather(1, ids[p + 1:q + 1, None])[:, 0]
    finally:
        pool.allocator.free(pages)
        states.free(slot)
    return out
