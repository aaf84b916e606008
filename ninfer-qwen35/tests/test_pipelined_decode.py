"""PipelinedDecode on the real Program (CPU): a step chained on the previous step's uncollected tokens
gives exactly what sequential decode gives; void rows (terminal, cancelled, aborted, released) leave
nothing behind."""

from __future__ import annotations

import pytest

from ninfer.contract.batch import RowDecision
from ninfer.contract.model import PipelinedDecode
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer_qwen35.program import ProgramError
from ninfer_qwen35.testing import float32_program, model_from_hf

transformers = pytest.importorskip("transformers")

PROMPTS = ([5, 17, 33, 2, 99, 100, 7, 8, 9, 10, 11], [200, 3, 3, 41], [1, 2, 3, 4, 5, 6, 7, 8, 9])
GREEDY = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, logprobs=True, top_logprobs=2)
TOP_K = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=5)  # sampled from top-k candidates


@pytest.fixture(scope="module")
def hf(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def model(tiny):
    return tiny[2]


def program(model, **options):
    return float32_program(model, page_size=4, num_pages=64, max_concurrency=3, host_budget_bytes=1 << 24,
                           **options)


def open_ready(prog, sampling):
    """Open every prompt and prefill it; returns ids and the first tokens (committed)."""
    sids, first = [], {}
    for p in PROMPTS:
        sid = prog.open_sequence(PreparedPrompt(token_ids=p), sampling)
        assert prog.reserve_units(sid, len(p))
        batch = prog.prefill(sid, len(p))
        prog.commit(batch, [RowDecision(accepted=1)])
        sids.append(sid)
        first[sid] = [batch.rows[0].tokens[0]]
    return sids, first


def rows_of(batch):
    return {r.sequence_id: (r.tokens, r.logprobs, r.top_logprobs) for r in batch.rows}


def sequential(prog, sids, steps):
    out = []
    for _ in range(steps):
        for s in sids:
            assert prog.reserve_units(s, 1)
        batch = prog.decode(sids)
        prog.commit(batch, [RowDecision(accepted=1)] * len(sids))
        out.append(rows_of(batch))
    return out


def chained(prog, sids, steps):
    """Each step is launched behind the previous one before the previous one is collected."""
    out = []
    for s in sids:
        assert prog.reserve_units(s, 1)
    unit = prog.launch_decode(sids)
    for k in range(steps):
        nxt = None
        if k + 1 < steps:
            for s in sids:
                assert prog.reserve_units(s, 1)
            nxt = prog.launch_decode(sids, after=unit)
        batch = prog.collect(unit)
        prog.commit(batch, [RowDecision(accepted=1)] * len(sids))
        out.append(rows_of(batch))
        unit = nxt
    return out


def compare_run(prog, run, sampling, steps):
    """First tokens and ``steps`` decode steps of every prompt through ``run``; everything freed after."""
    assert isinstance(prog, PipelinedDecode)
    sids, first = open_ready(prog, sampling)
    out = (first, run(prog, sids, steps))
    for s in sids:
        prog.release(s)
    assert prog.usage().all_free
    return out


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, TOP_K], ids=["greedy", "seeded", "top-k"])
@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "graph-buffers"])
def test_chained_steps_equal_sequential_decode(model, sampling, static_decode):
    runs = [compare_run(program(model, static_decode=static_decode), run, sampling, 7) for run in (sequential, chained)]
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, TOP_K], ids=["greedy", "seeded", "top-k"])
def test_chained_graph_replays_equal_sequential_decode_on_cuda(hf, sampling):
    """On the GPU the chained step's inputs are the previous step's device tokens copied into the captured
    graph's input buffer, and the host reads each step's tokens through a pinned copy and an event."""
    model = model_from_hf(hf, device="cuda")
    runs = []
    for run in (sequential, chained):
        prog = program(model, device="cuda", cuda_graphs=True)
        assert prog.graphs is not None and prog.graphs.graphs, prog.graph_error
        runs.append(compare_run(prog, run, sampling, 12))
    assert runs[0] == runs[1]


def test_terminal_cancelled_and_released_rows_are_left_out(model):
    prog = program(model)
    a, b, c = sids = open_ready(prog, GREEDY)[0]
    for s in sids:
        assert prog.reserve_units(s, 1)
    unit = prog.launch_decode(sids)
    for s in sids:
        assert prog.reserve_units(s, 1)
    nxt = prog.launch_decode(sids, after=unit)
    batch = prog.collect(unit)
    # a ends on this token, b is cancelled, c goes on.
    prog.commit(batch, [RowDecision(accepted=1, terminal=True), RowDecision(accepted=0, cancelled=True),
                        RowDecision(accepted=1)])
    prog.release(a)  # while its chained row is still launched
    with pytest.raises(ProgramError):
        prog.prefill(b, 4)  # b's chained row is outstanding: no other unit yet
    later = prog.collect(nxt)
    assert later.sequence_ids() == (c,)
    prog.commit(later, [RowDecision(accepted=1)])
    assert prog.input_remaining(b) > 0  # rolled back: its accepted history is replayed before decoding
    assert prog.input_remaining(c) == 0
    for s in (b, c):
        prog.release(s)
    assert prog.usage().all_free


def test_abort_of_the_first_step_voids_the_chained_one(model):
    prog = program(model)
    sids = open_ready(prog, GREEDY)[0]
    for s in sids:
        assert prog.reserve_units(s, 1)
    unit = prog.launch_decode(sids)
    nxt = prog.launch_decode(sids, after=unit)
    prog.abort_pending(prog.collect(unit))
    assert prog.collect(nxt).rows == ()
    for s in sids:
        assert prog.input_remaining(s) > 0
        prog.release(s)
    assert prog.usage().all_free


def test_pipelined_contract_errors(model):
    prog = program(model)
    a, b, c = open_ready(prog, GREEDY)[0]
    unit = prog.launch_decode([a, b])
    with pytest.raises(ProgramError, match="in order"):
        prog.launch_decode([b, a], after=unit)
    with pytest.raises(ProgramError, match="unconsumed"):
        prog.launch_decode([a])  # a already has a launched row
    nxt = prog.launch_decode([a, b], after=unit)
    with pytest.raises(ProgramError, match="not decode-ready"):
        prog.launch_decode([a, b], after=unit)  # a third row in flight
    batch = prog.collect(unit)
    with pytest.raises(ProgramError, match="collected twice"):
        prog.collect(unit)
    prog.commit(batch, [RowDecision(accepted=1)] * 2)
    prog.commit(prog.collect(nxt), [RowDecision(accepted=1)] * 2)
    for s in (a, b, c):
        prog.release(s)
    assert prog.usage().all_free
