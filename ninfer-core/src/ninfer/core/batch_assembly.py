"""Packing one unit's rows (new tokens, start position, StateImage slot, KV pages) into a ForwardBatch."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ninfer.core.forward_batch import ForwardBatch


@attrs.frozen(kw_only=True)
class RowInput:
    """One sequence's part of a unit: ``tokens`` new inputs at positions start.. in ``slot`` and ``pages``."""

    tokens: Sequence[int]
    start: int
    slot: int
    pages: Sequence[int]
    want_logits: bool


def build_forward_batch(rows: Sequence[RowInput], page_size: int, device: torch.device) -> ForwardBatch:
    """Pack ``rows`` back to back; block tables are padded with each row's first page (any valid id)."""
    lens = [len(r.tokens) for r in rows]
    if not rows or min(lens) < 1:
        raise ValueError("a unit needs at least one row and one token per row")
    starts = torch.tensor([r.start for r in rows], dtype=torch.int64)
    qlens = torch.tensor(lens, dtype=torch.int64)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int64)
    torch.cumsum(qlens, 0, out=qsl[1:])
    seq_lens = starts + qlens
    width = max(len(r.pages) for r in rows)
    tables = torch.tensor([list(r.pages) + [r.pages[0]] * (width - len(r.pages)) for r in rows], dtype=torch.int64)
    if width * page_size < int(seq_lens.max()):
        raise ValueError("block table shorter than the positions it must hold")
    positions = torch.cat([torch.arange(r.start, r.start + n, dtype=torch.int64) for r, n in zip(rows, lens, strict=True)])
    row_of = torch.repeat_interleave(torch.arange(len(rows)), qlens)
    slot_mapping = tables[row_of, positions // page_size] * page_size + positions % page_size
    logits_indices = torch.tensor([int(qsl[i + 1]) - 1 for i, r in enumerate(rows) if r.want_logits],
                                  dtype=torch.int64)
    ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.int64)
    return ForwardBatch(
        input_ids=ids.to(device), positions=positions.to(device), query_start_loc=qsl.to(torch.int32).to(device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        state_slots=torch.tensor([r.slot for r in rows], dtype=torch.int64).to(device),
        has_initial_state=(starts > 0).to(device), block_tables=tables.to(torch.int32).to(device),
        slot_mapping=slot_mapping.to(device), logits_indices=logits_indices.to(device),
        max_query_len=max(lens), max_seq_len=int(seq_lens.max()), all_initial_state=bool((starts > 0).all()))
