"""Qwen35Program on CPU against transformers: generation, chunking, batching, commit/abort, pause/resume, usage."""

from __future__ import annotations

import weakref

import pytest
import torch

from ninfer.contract.batch import PendingBatchError, RowDecision
from ninfer.contract.model import Program
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.core.kv_pool import PoolExhausted
from ninfer_qwen35.program import ProgramError, ReplayResume, SnapshotResume
from ninfer_qwen35.testing import float32_program

transformers = pytest.importorskip("transformers")

PROMPTS = ([5, 17, 33, 2, 99, 100, 7, 8, 9, 10, 11], [200, 3, 3, 41], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                                                      16, 17, 18, 19, 20, 21])
GREEDY = SamplingParams(temperature=0.0)


def make_program(tiny, *, max_concurrency=3, num_pages=64, host_budget_bytes=1 << 24, page_size=4, **options):
    _, _, model = tiny
    return float32_program(model, page_size=page_size, num_pages=num_pages, max_concurrency=max_concurrency,
                           host_budget_bytes=host_budget_bytes, **options)


def prefill_all(prog, sid, chunk=64):
    """Run the sequence's remaining input in chunks; commit the first token if one is sampled."""
    batch = None
    while prog.input_remaining(sid):
        assert prog.reserve_units(sid, min(chunk, prog.input_remaining(sid)))
        batch = prog.prefill(sid, chunk)
    if batch is not None:
        prog.commit(batch, [RowDecision(accepted=1)])
        return [batch.rows[0].tokens[0]]
    return []


def decode_steps(prog, sids, steps):
    out = {s: [] for s in sids}
    for _ in range(steps):
        for s in sids:
            assert prog.reserve_units(s, 1)
        batch = prog.decode(sids)
        assert batch.sequence_ids() == tuple(sids) and all(r.produced == 1 for r in batch.rows)
        prog.commit(batch, [RowDecision(accepted=1)] * len(sids))
        for s, row in zip(sids, batch.rows, strict=True):
            out[s].append(row.tokens[0])
    return out


def generate(prog, prompt, n, sampling=GREEDY, chunk=64):
    sid = prog.open_sequence(PreparedPrompt(token_ids=prompt), sampling)
    tokens = prefill_all(prog, sid, chunk)
    tokens += decode_steps(prog, [sid], n - 1)[sid]
    prog.release(sid)
    return tokens


def test_program_satisfies_protocol(tiny):
    assert isinstance(make_program(tiny), Program)


@pytest.fixture(scope="module")
def hf_greedy(tiny):
    prompt = PROMPTS[0]
    with torch.no_grad():
        out = tiny[0].generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("chunk", [64, 3])
def test_greedy_generation_matches_transformers(tiny, hf_greedy, chunk):
    prog = make_program(tiny)
    assert generate(prog, PROMPTS[0], 32, chunk=chunk) == hf_greedy
    assert prog.usage().all_free


def test_chunked_prefill_equals_unchunked_logprobs(tiny):
    prog = make_program(tiny)
    wants = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)
    rows = []
    for chunk in (64, 5, 1):
        sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[2]), wants)
        batch = None
        while prog.input_remaining(sid):
            batch = prog.prefill(sid, chunk)
        rows.append(batch.rows[0])
        prog.commit(batch, [RowDecision(accepted=1, terminal=True)])
        prog.release(sid)
    for row in rows[1:]:
        assert row.tokens == rows[0].tokens
        assert row.logprobs[0] == pytest.approx(rows[0].logprobs[0], abs=1e-4)
        assert [t for t, _ in row.top_logprobs[0]] == [t for t, _ in rows[0].top_logprobs[0]]
    assert len(rows[0].top_logprobs[0]) == 5 and rows[0].top_logprobs[0][0][0] == rows[0].tokens[0]


def test_batched_decode_equals_each_row_alone(tiny):
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    prog = make_program(tiny)
    alone = [generate(prog, p, 12, sampling) for p in PROMPTS]
    sids = [prog.open_sequence(PreparedPrompt(token_ids=p), sampling) for p in PROMPTS]
    got = {s: prefill_all(prog, s, chunk=4) for s in sids}
    for s, toks in decode_steps(prog, sids, 5).items():
        got[s] += toks
    prog.release(sids[1])  # neighbours change half way: the other rows are unaffected
    for s, toks in decode_steps(prog, [sids[2], sids[0]], 6).items():
        got[s] += toks
    assert got[sids[0]] == alone[0] and got[sids[2]] == alone[2] and got[sids[1]] == alone[1][:6]
    prog.release(sids[0])
    prog.release(sids[2])
    assert prog.usage().all_free


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny):
    prog = make_program(tiny)
    a = generate(prog, PROMPTS[1], 10, SamplingParams(temperature=1.0, seed=1))
    b = generate(prog, PROMPTS[1], 10, SamplingParams(temperature=1.0, seed=1))
    c = generate(prog, PROMPTS[1], 10, SamplingParams(temperature=1.0, seed=2))
    assert a == b and a != c


def test_commit_abort_invariants(tiny):
    prog = make_program(tiny)
    ref = generate(prog, PROMPTS[0], 8)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), GREEDY)
    got = prefill_all(prog, sid)
    got += decode_steps(prog, [sid], 3)[sid]
    batch = prog.decode([sid])
    with pytest.raises(ProgramError, match="unconsumed PendingBatch"):
        prog.decode([sid])
    with pytest.raises(ProgramError, match="unconsumed"):
        prog.release(sid)
    with pytest.raises(PendingBatchError, match="outside 1..1"):
        prog.commit(batch, [RowDecision(accepted=2)])
    assert not batch.consumed  # a rejected decision list leaves the batch pending
    other = make_program(tiny)
    with pytest.raises(PendingBatchError, match="not produced by this Program"):
        other.commit(batch, [RowDecision(accepted=1)])
    prog.abort_pending(batch)
    with pytest.raises(PendingBatchError, match="consumed twice"):
        prog.commit(batch, [RowDecision(accepted=1)])
    # The accepted frontier is unchanged; the state is rebuilt from the ledger, then decode resumes exactly.
    assert prog.input_remaining(sid) == len(PROMPTS[0]) + len(got) - 1
    assert prefill_all(prog, sid, chunk=5) == []
    got += decode_steps(prog, [sid], 4)[sid]
    assert got == ref
    # A cancelled row accepts zero: same rollback, the ledger keeps only accepted tokens.
    batch = prog.decode([sid])
    prog.commit(batch, [RowDecision(accepted=0, cancelled=True)])
    assert prog.input_remaining(sid) > 0
    prog.release(sid)
    assert prog.usage().all_free
    with pytest.raises(ProgramError, match="unknown sequence"):
        prog.release(sid)


def test_reservations_are_per_unit_and_exact(tiny):
    prog = make_program(tiny, num_pages=6, page_size=4)  # 24 positions
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[2]), GREEDY)  # 21 tokens
    assert prog.reserve_units(sid, 8)
    u = prog.usage()
    assert u.kv_pages_used == 2 and u.reserved_pages == 2  # only this unit's pages
    assert prog.reserve_units(sid, 8) and prog.usage().kv_pages_used == 2  # asking again is a no-op
    prog.prefill(sid, 8)
    assert prog.usage().reserved_pages == 0
    other = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[1]), GREEDY)
    assert prog.reserve_units(other, 4)
    before = prog.usage()
    assert not prog.reserve_units(sid, 13)  # needs 4 more pages, 3 free: nothing taken
    assert prog.usage() == before
    with pytest.raises(PoolExhausted, match="do not fit"):
        prog.prefill(sid, 13)
    with pytest.raises(ValueError, match="max_model_len"):
        prog.reserve_units(sid, 100)
    prog.release(other)
    prog.release(sid)
    assert prog.usage().all_free


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_pause_resume_gives_identical_continuation(tiny, mode):
    sampling = SamplingParams(temperature=0.8, seed=11)
    prog = make_program(tiny)
    ref = generate(prog, PROMPTS[0], 14, sampling)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), sampling)
    got = prefill_all(prog, sid, chunk=4) + decode_steps(prog, [sid], 5)[sid]
    assert prog.can_snapshot(sid)
    state = prog.pause(sid, mode)
    assert isinstance(state, SnapshotResume if mode == "snapshot" else ReplayResume)
    u = prog.usage()
    assert u.state_slots_used == 0 and u.kv_pages_used == 0 and u.host_bytes_used == state.host_bytes
    assert (state.host_bytes > 0) == (mode == "snapshot")
    sid = prog.resume(state)
    with pytest.raises(ProgramError, match="already resumed"):
        prog.resume(state)
    assert prog.input_remaining(sid) == (0 if mode == "snapshot" else len(PROMPTS[0]) + len(got) - 1)
    assert prog.usage().host_bytes_used == 0
    got += prefill_all(prog, sid, chunk=7)
    got += decode_steps(prog, [sid], 14 - len(got))[sid]
    assert got == ref
    prog.release(sid)
    assert prog.usage().all_free


def test_pause_during_prefill_and_resume_that_does_not_fit(tiny):
    prog = make_program(tiny, max_concurrency=1, num_pages=8, page_size=4)
    ref = generate(prog, PROMPTS[2], 6)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[2]), GREEDY)
    prog.reserve_units(sid, 8)
    prog.prefill(sid, 8)
    state = prog.pause(sid, "snapshot")
    blocker = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[1]), GREEDY)
    assert prog.resume(state) is None  # no slot: the ResumeState stays valid
    prog.release(blocker)
    sid = prog.resume(state)
    assert prog.input_remaining(sid) == len(PROMPTS[2]) - 8
    got = prefill_all(prog, sid) + decode_steps(prog, [sid], 5)[sid]
    assert got == ref
    # discard frees what a paused request holds without resuming it
    state = prog.pause(sid, "snapshot")
    assert prog.usage().host_bytes_used == state.host_bytes > 0
    prog.discard(state)
    assert prog.usage().all_free
    with pytest.raises(ProgramError, match="already resumed or discarded"):
        prog.discard(state)


def test_snapshot_refused_beyond_host_budget(tiny):
    prog = make_program(tiny, host_budget_bytes=1024)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), GREEDY)
    prefill_all(prog, sid)
    assert not prog.can_snapshot(sid)
    with pytest.raises(ProgramError, match="host"):
        prog.pause(sid, "snapshot")
    state = prog.pause(sid, "replay")
    prog.discard(state)
    assert prog.usage().all_free


def test_bad_input_is_a_clear_error(tiny):
    prog = make_program(tiny, max_concurrency=1)
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        prog.open_sequence(PreparedPrompt(token_ids=[1, 999]), GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        prog.open_sequence(PreparedPrompt(token_ids=[1] * 300), GREEDY)
    sid = prog.open_sequence(PreparedPrompt(token_ids=[1, 2]), GREEDY)
    with pytest.raises(ProgramError, match="no free StateImage slot"):
        prog.open_sequence(PreparedPrompt(token_ids=[1, 2]), GREEDY)
    with pytest.raises(ProgramError, match="not decode-ready"):
        prog.decode([sid])
    with pytest.raises(ProgramError, match="distinct"):
        prog.decode([sid, sid])
    with pytest.raises(ValueError, match="pause mode"):
        prog.pause(sid, "hibernate")
    prog.release(sid)
    assert prog.usage().all_free


def test_graph_input_buffers_decode_like_eager(tiny):
    """The CUDA-graph static input path (page tables cached per row, epochs on truncation) on CPU."""
    def scenario(prog):
        sids = [prog.open_sequence(PreparedPrompt(token_ids=p), GREEDY) for p in PROMPTS]
        got = {s: prefill_all(prog, s, chunk=8) for s in sids}
        for s, t in decode_steps(prog, sids, 6).items():
            got[s] += t
        prog.release(sids[0])
        batch = prog.decode([sids[2], sids[1]])  # rows swap places; then an abort truncates the pages
        prog.abort_pending(batch)
        prefill_all(prog, sids[1], chunk=5)
        prefill_all(prog, sids[2], chunk=64)
        for s, t in decode_steps(prog, [sids[1], sids[2]], 5).items():
            got[s] += t
        for s in sids[1:]:
            prog.release(s)
        assert prog.usage().all_free
        return [got[s] for s in sids]

    static = make_program(tiny, static_decode=True)
    assert static.graphs is not None and not static.graphs.graphs  # buffers only, nothing captured on CPU
    assert scenario(static) == scenario(make_program(tiny))


class _FailingOnce:
    """The real model, except that one forward call raises after doing its work (a device error stand-in)."""

    def __init__(self, model, fail_at):
        self.model, self.calls, self.fail_at = model, 0, fail_at
        self.config = model.config

    def forward(self, batch, views):
        out = self.model.forward(batch, views)
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return out

    def logits(self, hidden):
        return self.model.logits(hidden)


def test_failed_unit_rolls_back_and_recovers(tiny):
    ref = generate(make_program(tiny), PROMPTS[0], 6)
    _, cfg, model = tiny
    prog = float32_program(_FailingOnce(model, fail_at=3), config=cfg, page_size=4, num_pages=32)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), GREEDY)
    got = prefill_all(prog, sid) + decode_steps(prog, [sid], 1)[sid]  # forward calls 1 and 2
    with pytest.raises(RuntimeError, match="injected"):
        prog.decode([sid])
    assert prog.usage().kv_pages_used == 0 and prog.input_remaining(sid) == len(PROMPTS[0]) + len(got) - 1
    assert prefill_all(prog, sid) == []
    got += decode_steps(prog, [sid], 4)[sid]
    assert got == ref
    prog.release(sid)
    assert prog.usage().all_free


def test_fork_shares_pages_copy_on_write(tiny):
    """A fork shares the KV pages of the committed prefix as a read-only prefix: the parent keeps writing its own
    tail page past the fork's positions, and the fork's first write copies the page."""
    sampled = SamplingParams(temperature=1.0, seed=5)

    def fork_scenario(parent_continues: bool):
        prog = make_program(tiny, page_size=4)
        a = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), GREEDY)  # 11 tokens: tail page shared
        got_a = prefill_all(prog, a) + decode_steps(prog, [a], 3)[a]
        before = prog.usage()
        b = prog.fork(a, sampled)
        after = prog.usage()
        assert after.kv_pages_used == before.kv_pages_used and after.state_slots_used == before.state_slots_used + 1
        if parent_continues:
            # the parent owns the shared tail page: it writes past the fork's prefix in place (no copy), the
            # fork's positions stay intact, and the fork copies the page when it writes
            shared = prog.pool.storage.clone()
            b_pages = list(prog._seq(b).pages)
            used = prog._seq(b).computed - 4 * (len(b_pages) - 1)
            assert 0 < used < 4
            got_a += decode_steps(prog, [a], 1)[a]
            assert prog._seq(a).pages == b_pages and prog.usage().kv_pages_used == before.kv_pages_used
            assert torch.equal(prog.pool.storage[:, :, b_pages[:-1]], shared[:, :, b_pages[:-1]])
            assert torch.equal(prog.pool.storage[:, :, b_pages[-1], :used], shared[:, :, b_pages[-1], :used])
            steps = decode_steps(prog, [a, b], 6)
            got_a += steps[a]
            assert prog.usage().kv_pages_used > before.kv_pages_used  # the shared tail page was copied
        else:
            prog.release(a)
            steps = decode_steps(prog, [b], 6)
        got_b = steps[b]
        for s in ([a, b] if parent_continues else [b]):
            prog.release(s)
        assert prog.usage().all_free
        return got_a, got_b

    got_a, got_b = fork_scenario(parent_continues=True)
    _, alone_b = fork_scenario(parent_continues=False)
    assert got_a == generate(make_program(tiny), PROMPTS[0], 11)  # the parent is untouched by its fork
    assert got_b == alone_b  # and the fork by its parent's writes
    assert got_b != got_a[4:10]  # the fork samples its own continuation


def test_revoked_snapshot_resumes_by_replay_with_identical_continuation(tiny):
    sampling = SamplingParams(temperature=0.8, seed=11)
    prog = make_program(tiny)
    ref = generate(prog, PROMPTS[0], 14, sampling)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), sampling)
    got = prefill_all(prog, sid, chunk=4) + decode_steps(prog, [sid], 5)[sid]
    cost = prog.snapshot_cost(sid)
    assert cost.replay_positions == len(PROMPTS[0]) + len(got) - 1  # the last token is not fed yet
    snap = prog.pause(sid, "snapshot")
    assert snap.host_bytes == cost.host_bytes == prog.usage().host_bytes_used > 0
    state = prog.demote(snap)
    assert type(state) is ReplayResume and state.ledger == snap.ledger and state.frontier == snap.frontier
    assert prog.usage().host_bytes_used == 0
    with pytest.raises(ProgramError, match="already resumed or discarded"):
        prog.resume(snap)  # the revoked Snapshot is no longer valid
    with pytest.raises(ProgramError, match="no Snapshot to revoke"):
        prog.demote(state)
    host_copy = weakref.ref(snap.kv_pages)
    del snap
    assert host_copy() is None  # the Program keeps no reference: the host copy is freed with the old state
    sid = prog.resume(state)
    assert prog.input_remaining(sid) == cost.replay_positions
    got += prefill_all(prog, sid, chunk=7)
    got += decode_steps(prog, [sid], 14 - len(got))[sid]
    assert got == ref
    # a revoked Snapshot can also be discarded; every byte comes back
    prog.discard(prog.demote(prog.pause(sid, "snapshot")))
    assert prog.usage().all_free
