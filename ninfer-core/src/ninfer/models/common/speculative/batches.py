"""The ForwardBatches of a speculative decode unit: the verify batch (R = 1 + k tokens per row) and the
chained draft steps that follow it (one token per row at a position that depends on the accepted count).

Block tables cover every position the unit may touch (verify and chained drafts: ``span`` positions from
each row's frontier); an entry past the pages a row holds points at the Program's scratch page, and so does
the KV slot of a position there. That only happens at max_model_len (the engine reserves the span below
it), where the positions past the limit produce tokens no request can accept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.core.forward_batch import ForwardBatch


def block_table(tables: Sequence[Sequence[int]], positions: int, *, page_size: int, scratch_page: int
                ) -> torch.Tensor:
    """int32 [B, pages covering ``positions``] (host): each row's pages, then the scratch page."""
    width = -(-positions // page_size)
    table = torch.full((len(tables), width), scratch_page, dtype=torch.int32)
    for b, pages in enumerate(tables):
        n = min(len(pages), width)
        table[b, :n] = torch.tensor(list(pages[:n]), dtype=torch.int32)
    return table


def verify_batch(tokens: Sequence[Sequence[int]], starts: Sequence[int], slots: Sequence[int],
                 tables: Sequence[Sequence[int]], *, span: int, page_size: int, scratch_page: int,
                 device: torch.device) -> ForwardBatch:
    """B rows of R tokens each (row b at positions starts[b]..starts[b]+R-1 in ``slots[b]``), logits for all."""
    B, R = len(tokens), len(tokens[0])
    if any(len(t) != R for t in tokens) or R > span:
        raise ValueError(f"a verify batch needs R <= span tokens in every row, got {[len(t) for t in tokens]}")
    table = block_table(tables, max(starts) + span, page_size=page_size, scratch_page=scratch_page)
    width = table.shape[1]
    start = torch.tensor(list(starts), dtype=torch.int64)
    positions = start[:, None] + torch.arange(R, dtype=torch.int64)[None, :]       # [B, R]
    pages = table.long().gather(1, positions // page_size)
    slot_mapping = pages * page_size + positions % page_size
    return ForwardBatch(
        input_ids=torch.tensor([list(t) for t in tokens], dtype=torch.int64).flatten().to(device),
        positions=positions.flatten().to(device),
        query_start_loc=(torch.arange(B + 1, dtype=torch.int32) * R).to(device),
        seq_lens=(start + R).to(torch.int32).to(device),
        state_slots=torch.tensor(list(slots), dtype=torch.int64).to(device),
        has_initial_state=torch.ones(B, dtype=torch.bool, device=device), block_tables=table.to(device),
        slot_mapping=slot_mapping.flatten().to(device), logits_indices=torch.arange(B * R, device=device),
        max_query_len=R, max_seq_len=width * page_size, all_initial_state=True)


def chained_batch(base: torch.Tensor, step: int, input_ids: torch.Tensor, block_tables: torch.Tensor,
                  state_slots: torch.Tensor, page_size: int) -> ForwardBatch:
    """Chained draft step ``step`` (1..k-1): one token per row at position base + step, where ``base`` [B] (device)
    is the position whose draft pass made the first draft (after a verify: start + accepted). Computed on the
    device (no host sync; graph-capturable); ``block_tables`` must cover base + step (``block_table``)."""
    B = base.shape[0]
    positions = base + step
    pages = block_tables.long().gather(1, (positions // page_size)[:, None])[:, 0]
    dev = positions.device
    return ForwardBatch(
        input_ids=input_ids, positions=positions, query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev),
        seq_lens=(positions + 1).to(torch.int32), state_slots=state_slots,
        has_initial_state=torch.ones(B, dtype=torch.bool, device=dev), block_tables=block_tables,
        slot_mapping=pages * page_size + positions % page_size, logits_indices=torch.arange(B, device=dev),
        max_query_len=1, max_seq_len=block_tables.shape[1] * page_size, all_initial_state=True, static=True)
