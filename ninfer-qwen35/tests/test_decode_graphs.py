"""DecodeGraphs.load: the packed static inputs hold exactly what each step's rows say (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from ninfer_qwen35.program import cuda_graphs
from ninfer_qwen35.program.cuda_graphs import DecodeGraphs


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


@pytest.mark.gpu
def test_cuda_graph_decode_step_syncs_once(monkeypatch):
    """A graph decode step (load, replay, greedy sampling with and without logprobs) never syncs while it is
    launched, and collecting it waits on one event: the tokens' copy to the host."""
    import warnings

    from benchmarks.decode_step import build_program
    from ninfer.contract.batch import RowDecision
    from ninfer.contract.prompt import PreparedPrompt
    from ninfer.contract.request import SamplingParams

    # a published shape: the Triton kernels were validated at real head sizes, not the tiny test ones
    _, program = build_program("0.8b", "cuda", max_batch=2, context=16, steps=40, graphs=True,
                               dtype=torch.bfloat16)
    assert program.graphs is not None and program.graphs.graphs, program.graph_error
    settings = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), SamplingParams(temperature=0.0)]
    sids = []
    for k, sp in enumerate(settings):
        sid = program.open_sequence(PreparedPrompt(token_ids=list(range(3 + k, 19 + k))), sp)
        assert program.reserve_units(sid, 16)
        program.commit(program.prefill(sid, 16), [RowDecision(accepted=1)])
        sids.append(sid)
    waits = []
    event_sync = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda ev: (waits.append(ev), event_sync(ev))[1])
    for rows in (sids, sids[:1], sids[1:], sids):  # across page boundaries and memberships
        for _ in range(6):
            for sid in rows:
                assert program.reserve_units(sid, 1)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    unit = program.launch_decode(rows)
                    waits.clear()
                    batch = program.collect(unit)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            assert syncs == [] and len(waits) == 1, (syncs, waits)
            program.commit(batch, [RowDecision(accepted=1)] * len(rows))
