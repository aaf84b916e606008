"""DecodeGraphs.load: the packed static inputs hold exactly what each step's rows say (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from ninfer.core import cuda_graphs
from ninfer.core.cuda_graphs import DecodeGraphs


def _graphs(max_pages: int, max_batch: int = 4) -> DecodeGraphs:
    return DecodeGraphs(lambda batch: batch.input_ids, max_batch=max_batch, max_pages=max_pages, page_size=4,
                        scratch_slot=max_batch, scratch_page=999, device=torch.device("cpu"))


def _check(g: DecodeGraphs, tokens, positions, slots, tables) -> None:
    B = len(tokens)
    b = g.batch(B)
    assert b.input_ids.tolist() == tokens and b.positions.tolist() == positions
    assert b.seq_lens.tolist() == [p + 1 for p in positions] and b.state_slots.tolist() == slots
    assert b.slot_mapping.tolist() == [t[p // 4] * 4 + p % 4 for t, p in zip(tables, positions, strict=True)]
    for i, t in enumerate(tables):
        assert b.block_tables[i, :len(t)].tolist() == t


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_inputs_are_aligned_views_of_one_buffer(max_batch):
    g = _graphs(max_pages=7, max_batch=max_batch)
    base = g._packed.data_ptr()
    inputs = (g.input_ids, g.positions, g.state_slots, g.slot_mapping, g.seq_lens, g.block_tables)
    assert all(t.is_contiguous() and (t.data_ptr() - base) % 64 == 0 for t in inputs)
    assert all(t.untyped_storage().data_ptr() == g._packed.untyped_storage().data_ptr() for t in inputs)


@pytest.mark.parametrize("max_pages", [8, 5000])  # one packed copy / table segments copied on their own
def test_load_tracks_rows_across_steps(max_pages):
    g = _graphs(max_pages)
    assert g.batch(4).state_slots.tolist() == [4] * 4 and g.block_tables.unique().tolist() == [999]
    rng = random.Random(max_pages)
    seqs = {}  # id -> [pages, epoch, position]
    for sid in range(6):
        seqs[sid] = [rng.sample(range(900), 2), 0, rng.randrange(1, 8)]
    for _ in range(40):
        members = rng.sample(sorted(seqs), rng.randint(1, 4))
        for sid in members:
            pages, epoch, pos = seqs[sid]
            pos += 1
            if rng.random() < 0.1:  # truncation: the list shrinks and its epoch moves on
                pages, epoch, pos = pages[:1], epoch + 1, rng.randrange(4)
            while len(pages) * 4 <= pos:
                pages = pages + [rng.randrange(900)]
            seqs[sid] = [pages, epoch, pos]
        tokens = [rng.randrange(512) for _ in members]
        positions = [seqs[s][2] for s in members]
        tables = [list(seqs[s][0]) for s in members]
        g.load(tokens, positions, members, tables, [(s, seqs[s][1]) for s in members])
        _check(g, tokens, positions, members, tables)


def test_split_copies_only_changed_segments(monkeypatch):
    g = _graphs(max_pages=5000)
    g.load([1, 2], [0, 5], [0, 1], [[7], [8, 9]], [(1, 0), (2, 0)])
    monkeypatch.setattr(cuda_graphs, "ONE_COPY_BYTES", 0)
    copies = []
    real = torch.Tensor.copy_

    def spy(dst, src, non_blocking=False):
        copies.append(dst.numel())
        return real(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    g.load([3, 4], [1, 8], [0, 1], [[7], [8, 9, 10]], [(1, 0), (2, 0)])  # row 1 appended one page
    monkeypatch.undo()
    assert copies == [g._tables_at, 4]  # the per-row columns, then the one new table entry
    _check(g, [3, 4], [1, 8], [0, 1], [[7], [8, 9, 10]])
