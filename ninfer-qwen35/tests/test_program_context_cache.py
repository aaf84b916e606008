"""Qwen35Program's ContextStore on CPU: save points, checkpoints, restores (device and host), exact accounting.

Every restore is checked against the same prompt computed from scratch: greedy tokens equal, logprobs
within fp32 tolerance (a different chunking changes the summation order only).
"""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.batch import RowDecision
from ninfer.contract.context import ContextStore
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer_qwen35.program import ProgramError
from ninfer_qwen35.testing import float32_program

pytest.importorskip("transformers")

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8, 9, 10, 11, 12, 13, 41, 42, 43, 44, 45]
WANTS = SamplingParams(temperature=0.0, logprobs=True)


def make(tiny, **options):
    _, _, model = tiny
    defaults = dict(page_size=4, num_pages=96, max_concurrency=3, host_budget_bytes=1 << 24, checkpoint_slots=6,
                    cache_host_budget_bytes=1 << 24)
    return float32_program(model, **{**defaults, **options})


def run(prog, sid, steps, chunk=64):
    """Prefill what remains, then decode ``steps`` tokens; returns (tokens, logprobs)."""
    toks, lps = [], []
    while prog.input_remaining(sid):
        assert prog.reserve_units(sid, min(chunk, prog.input_remaining(sid)))
        batch = prog.prefill(sid, chunk)
        if batch is not None:
            prog.commit(batch, [RowDecision(accepted=1)])
            toks.append(batch.rows[0].tokens[0])
            lps.append(batch.rows[0].logprobs[0])
    while len(toks) < steps:
        assert prog.reserve_units(sid, 1)
        batch = prog.decode([sid])
        prog.commit(batch, [RowDecision(accepted=1)])
        toks.append(batch.rows[0].tokens[0])
        lps.append(batch.rows[0].logprobs[0])
    return toks, lps


def fresh(prog, prompt, steps):
    sid = prog.open_sequence(PreparedPrompt(token_ids=prompt), WANTS)
    out = run(prog, sid, steps)
    prog.release(sid)
    return out


def restored(prog, prompt, checkpoint_id, steps, points=()):
    assert prog.lease(checkpoint_id) is not None
    sid = prog.open_cached(PreparedPrompt(token_ids=prompt), WANTS, checkpoint_id)
    prog.unlease(checkpoint_id)
    assert sid is not None
    prog.plan_saves(sid, points)
    out = run(prog, sid, steps)
    return sid, out


def same(a, b):
    assert a[0] == b[0]
    assert a[1] == pytest.approx(b[1], abs=1e-4)


def retire_all(prog):
    prog.published()  # drained: nothing still to adopt
    for ck in list(prog.checkpoints.records):
        prog.retire(ck)


def test_program_is_a_context_store(tiny):
    assert isinstance(make(tiny), ContextStore)


def test_prompt_end_checkpoint_first_token_by_decode_and_identical_prompt_restores(tiny):
    prog = make(tiny)
    ref = fresh(prog, PROMPT, 8)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPT), WANTS)
    prog.plan_saves(sid, [8, len(PROMPT) - 1])
    got = run(prog, sid, 8)
    same(got, ref)  # the last prompt token ran as the first decode input: same tokens
    (grid, end) = prog.published()
    assert (grid.kind, grid.length, end.kind, end.length) == ("grid", 8, "prompt", len(PROMPT) - 1)
    assert end.tokens == tuple(PROMPT[:-1]) and end.on_device and not end.on_host
    prog.release(sid)
    # The identical prompt restores everything but its last token and is decode-ready at once.
    sid2, again = restored(prog, PROMPT, end.id, 8)
    same(again, ref)
    prog.release(sid2)
    # A prompt sharing the first 10 tokens restores the grid checkpoint (8) and computes the rest.
    other = PROMPT[:10] + [200, 201, 202]
    sid3, out = restored(prog, other, grid.id, 6)
    same(out, fresh(prog, other, 6))
    prog.release(sid3)
    assert prog.usage().idle and not prog.usage().all_free
    retire_all(prog)
    assert prog.usage().all_free and prog.cache_usage().empty


def test_continuation_extends_into_the_next_turn(tiny):
    prog = make(tiny)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPT), WANTS)
    prog.plan_saves(sid, [len(PROMPT) - 1])
    toks, _ = run(prog, sid, 6)
    info = prog.save_continuation(sid, "turn")
    prog.release(sid)
    history = PROMPT + toks
    assert info.kind == "turn" and info.tokens == tuple(history[:-1])  # the last token is the next input
    assert [i.kind for i in prog.published()] == ["prompt"]  # the continuation is the caller's, not republished
    turn2 = history + [150, 151, 152, 153]
    sid2, out = restored(prog, turn2, info.id, 5)
    same(out, fresh(prog, turn2, 5))
    prog.release(sid2)


def test_host_replica_restores_after_device_eviction(tiny):
    prog = make(tiny)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPT), WANTS)
    prog.plan_saves(sid, [len(PROMPT) - 1])
    run(prog, sid, 3)
    prog.release(sid)
    (end,) = prog.published()
    pages_before = prog.usage().kv_pages_used
    assert pages_before == prog.usage().cache_pages == 5  # 17 positions in pages of 4, nothing else held
    demoted = prog.evict(end.id, to_host=True)
    assert demoted.on_host and not demoted.on_device and demoted.generation > end.generation
    u = prog.usage()
    assert u.kv_pages_used == 0 and u.checkpoint_slots_used == 0 and u.cache_host_bytes == demoted.host_bytes
    sid2, out = restored(prog, PROMPT + [7], end.id, 4)
    same(out, fresh(prog, PROMPT + [7], 4))
    prog.release(sid2)
    assert prog.drop_host(end.id) is None  # nothing left: the checkpoint is gone
    assert prog.usage().all_free


def test_saving_a_prefix_copies_no_page_and_a_conflicting_write_copies_one(tiny):
    prog = make(tiny, num_pages=16)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPT), WANTS)
    prog.plan_saves(sid, [6, len(PROMPT) - 1])  # 6: inside the second page
    run(prog, sid, 1, chunk=64)
    src = prog.sequences.get(sid)
    (grid, _) = prog.published()
    # The source kept writing positions 6.. into the checkpoint's tail page in place: 18 positions, 5 pages.
    assert prog.usage().kv_pages_used == 5 and src.pages[1] == prog.checkpoints.get(grid.id).prefix.pages[1]
    free = prog.pool.allocator.num_free
    prog.lease(grid.id)
    sid2 = prog.open_cached(PreparedPrompt(token_ids=PROMPT[:6] + [1, 2, 3]), WANTS, grid.id)
    prog.unlease(grid.id)
    assert prog.pool.allocator.num_free == free  # restoring shares the prefix
    assert prog.reserve_units(sid2, 3)
    assert prog.pool.allocator.num_free == free - 2  # its own copy of the tail page, plus one new page
    copy = prog.sequences.get(sid2).pages[1]
    assert copy != src.pages[1]
    prog.release(sid2)
    prog.release(sid)
    with pytest.raises(ProgramError, match="lease"):
        prog.lease(grid.id)
        prog.retire(grid.id)
    prog.unlease(grid.id)
    retire_all(prog)
    assert prog.usage().all_free


def test_saves_are_skipped_without_a_free_slot_and_plans_are_checked(tiny):
    prog = make(tiny, checkpoint_slots=1)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPT), WANTS)
    with pytest.raises(ProgramError, match="save points"):
        prog.plan_saves(sid, [len(PROMPT)])
    with pytest.raises(ProgramError, match="save points"):
        prog.plan_saves(sid, [8, 4])
    prog.plan_saves(sid, [4, 8])
    run(prog, sid, 2)
    assert [i.length for i in prog.published()] == [4]  # one slot: the second save found none free
    assert prog.save_continuation(sid, "final") is None
    prog.release(sid)
    retire_all(prog)
    assert prog.usage().all_free


def test_scoring_never_touches_the_cache(tiny):
    prog = make(tiny)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPT), WANTS)
    prog.plan_saves(sid, [len(PROMPT) - 1])
    run(prog, sid, 2)
    prog.release(sid)
    prog.published()
    before = prog.cache_usage()
    scores = prog.score_window(PROMPT)
    assert prog.cache_usage() == before  # no lookup, no save, no page or slot taken
    fresh_scores = make(tiny, checkpoint_slots=0).score_window(PROMPT)
    assert torch.allclose(scores, fresh_scores)
