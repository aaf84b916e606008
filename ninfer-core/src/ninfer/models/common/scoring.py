"""Causal scoring of one fresh window outside the generation path (temporary StateImage slot and KV pages)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import attrs
import torch

from ninfer.contract.errors import NoRoomToScore
from ninfer.core.batch_assembly import RowInput, build_forward_batch
from ninfer.core.forward_batch import ForwardBatch
from ninfer.core.kv_pool import PagedKVPool, pages_for
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.context.errors import ProgramError


class _NoRoom(ProgramError, NoRoomToScore):
    """No free slot or pages for the window: a ProgramError that an engine may also wait out."""


@attrs.frozen(kw_only=True)
class WindowScores:
    """A window's scores with the alternatives (``score_window(..., top=k)``), one row per scored token:
    ``logprobs[j]`` as without ``top``; ``ranks[j]``: 1 + how many vocabulary entries are more likely than the
    token; ``top_logprobs[j]`` / ``top_ids[j]``: the ``k`` most likely entries, best first."""

    logprobs: torch.Tensor  # [m] fp32
    ranks: torch.Tensor  # [m] int64
    top_logprobs: torch.Tensor  # [m, k] fp32
    top_ids: torch.Tensor  # [m, k] int64


def score_window(token_ids: Sequence[int], score_from: int, *, forward: Callable[[ForwardBatch], torch.Tensor],
                 logits: Callable[[torch.Tensor], torch.Tensor], states: StateImageStorage, pool: PagedKVPool,
                 max_model_len: int, vocab_size: int, launches: contextlib.AbstractContextManager,
                 chunk: int = 1024, logits_rows: int = 256, top: int | None = None) -> torch.Tensor | WindowScores:
    """fp32 log p(token_ids[i] | token_ids[:i]) for i in score_from..n-1, as one fresh causal window.

    ``forward`` runs a ForwardBatch to final hidden rows and ``logits`` projects hidden rows, as the
    Program's model does; both run inside ``launches`` (the Program's launch scope). The window runs on
    a temporary StateImage slot and KV pages of ``pool``, in prefill chunks of ``chunk`` positions;
    logits are formed ``logits_rows`` at a time, so the scoring staging ([logits_rows, vocab] fp32)
    exists only during this call. With ``top`` (0 or more) the result is a ``WindowScores``: each token's rank
    and the ``top`` most likely entries, taken from the same log-softmax rows as its logprob.
    """
    n = len(token_ids)
    if not 1 <= score_from <= n:
        raise ValueError(f"score_from must be in 1..{n}, got {score_from}")
    if n > max_model_len:
        raise ValueError(f"scoring window of {n} tokens exceeds max_model_len {max_model_len}")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} outside the model vocabulary 0..{vocab_size - 1}")
    if top is not None and not 0 <= top <= vocab_size:
        raise ValueError(f"top must be in 0..{vocab_size}, got {top}")
    page_size = pool.page_size
    need = pages_for(n, page_size)
    if states.num_free == 0 or need > pool.allocator.num_free:
        raise _NoRoom(f"scoring window of {n} tokens needs a free StateImage slot and {need} KV pages "
                           f"({states.num_free} slots, {pool.allocator.num_free} pages free)")
    slot = states.allocate()
    pages = pool.allocator.allocate(need)
    dev = states.device.torch
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=dev)
    out = torch.empty(n - score_from, dtype=torch.float32, device=dev)
    if top is not None:
        ranks = torch.empty(n - score_from, dtype=torch.int64, device=dev)
        top_lp = torch.empty(n - score_from, top, dtype=torch.float32, device=dev)
        top_ids = torch.empty(n - score_from, top, dtype=torch.int64, device=dev)
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
                    chosen = lp.gather(1, ids[p + 1:q + 1, None])
                    rows = slice(p + 1 - score_from, q + 1 - score_from)
                    out[rows] = chosen[:, 0]
                    if top is not None:
                        ranks[rows] = (lp > chosen).sum(1) + 1
                        if top:
                            top_lp[rows], top_ids[rows] = lp.topk(top, dim=1)
    finally:
        pool.allocator.free(pages)
        states.free(slot)
    if top is None:
        return out
    return WindowScores(logprobs=out, ranks=ranks, top_logprobs=top_lp, top_ids=top_ids)
