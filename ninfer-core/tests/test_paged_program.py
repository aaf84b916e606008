"""PagedProgram with no recurrent state (a StateImage of zero fields) and one KV pool: the shared parts alone.

The toy model is attention-like: a token's hidden is a recency-weighted sum of the embeddings of every
position up to it, read back from the sequence's KV pages, so every output depends on the paged history
and a wrong page, a missing copy-on-write or a lost Snapshot page changes tokens. Its greedy continuation has a
closed form (``reference``), which every path must reproduce.
"""

import subprocess
import sys

import pytest
import torch

from ninfer.contract.batch import RowDecision
from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.forward_batch import ForwardBatch, PagedKVViews
from ninfer.models.common.context import ProgramError
from ninfer.models.common.paged_program import PagedProgram

V, D = 48, 8
SPEC = KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=D, dtype="float32", page_size=4)
GREEDY = SamplingParams(temperature=0.0)


def mix(rows: torch.Tensor) -> torch.Tensor:
    """sum over q of 0.5 ** (p - q) * rows[q], for the last position p."""
    return (rows * 0.5 ** torch.arange(rows.shape[0] - 1, -1, -1, dtype=rows.dtype)[:, None]).sum(0)


class RecencyAttention:
    """embed [V, D], head [D, V]; hidden(position p) = ``mix`` of the K rows of positions 0..p of the sequence's pages."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(V, D, generator=gen)
        self.head = torch.randn(D, V, generator=gen)

    def forward(self, batch: ForwardBatch, views: PagedKVViews) -> torch.Tensor:
        ((k_cache, _v_cache),) = views.kv
        flat = k_cache.view(-1, D)
        flat[batch.slot_mapping] = self.embed[batch.input_ids]
        ps, qsl, out = views.page_size, batch.query_start_loc.tolist(), []
        for b in range(batch.num_seqs):
            table = batch.block_tables[b].long()
            for p in batch.positions[qsl[b]:qsl[b + 1]].tolist():
                q = torch.arange(p + 1)
                out.append(mix(flat[table[q // ps] * ps + q % ps]))
        return torch.stack(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head).float()


class RecencyProgram(PagedProgram):
    """A native Program built from the shared parts: its pool, its views, its model calls."""

    def __init__(self, model: RecencyAttention, *, static_decode: bool = False, num_pages: int = 32,
                 max_concurrency: int = 3, host_budget_bytes: int = 1 << 20) -> None:
        super().__init__(state_layout=StateImageLayout(fields=()), kv_pool=SPEC, device="cpu",
                         max_concurrency=max_concurrency, vocab_size=V,
                         capacity=ProgramCapacity(kv_pages=num_pages, host_budget_bytes=host_budget_bytes))
        self.model = model
        self.views = PagedKVViews(kv=self.pool.caches(), page_size=self.page_size)
        self.start_graphs(cuda_graphs=False, static_decode=static_decode)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.views)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)


def reference(model: RecencyAttention, ledger: list[int], n: int) -> list[int]:
    """Greedy continuation straight from the definition (no pages)."""
    ledger, out = list(ledger), []
    for _ in range(n):
        tok = int(model.logits(mix(model.embed[ledger])[None])[0].argmax())
        out.append(tok)
        ledger.append(tok)
    return out


def prefill_all(prog, sid, chunk=5) -> list[int]:
    got = []
    while prog.input_remaining(sid):
        n = min(chunk, prog.input_remaining(sid))
        assert prog.reserve_units(sid, n)
        batch = prog.prefill(sid, n)
        if batch is not None:
            got.append(batch.rows[0].tokens[0])
            prog.commit(batch, [RowDecision(accepted=1)])
    return got


def decode_steps(prog, sids, steps) -> dict[int, list[int]]:
    got = {s: [] for s in sids}
    for _ in range(steps):
        for s in sids:
            assert prog.reserve_units(s, 1)
        batch = prog.decode(sids)
        for row in batch.rows:
            got[row.sequence_id].append(row.tokens[0])
        prog.commit(batch, [RowDecision(accepted=1)] * len(sids))
    return got


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25]]


@pytest.mark.parametrize("static_decode", [False, True])
def test_greedy_decode_matches_the_definition(static_decode):
    model = RecencyAttention()
    prog = RecencyProgram(model, static_decode=static_decode)
    assert (prog.graphs is not None) == static_decode
    sids = [prog.open_sequence(PreparedPrompt(token_ids=p), GREEDY) for p in PROMPTS]
    first = {s: prefill_all(prog, s) for s in sids}
    steps = decode_steps(prog, sids, 9)  # across page boundaries
    for s, p in zip(sids, PROMPTS, strict=True):
        assert first[s] + steps[s] == reference(model, p, 10)
    usage = prog.usage()
    assert usage.state_slots_used == 3 and usage.kv_pages_used == sum(-(-(len(p) + 9) // 4) for p in PROMPTS)
    for s in sids:
        prog.release(s)
    usage = prog.usage()
    assert (usage.state_slots_used, usage.kv_pages_used, usage.reserved_pages) == (0, 0, 0)


def test_pause_resume_and_rollback_continue_exactly():
    """Snapshot and Replay resumes, and a rolled-back row, continue with the uninterrupted tokens (seeded draws)."""
    model = RecencyAttention(1)
    sampled = SamplingParams(temperature=0.9, seed=3)

    def run(interrupt) -> list[int]:
        prog = RecencyProgram(model)
        sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), sampled)
        got = prefill_all(prog, sid) + decode_steps(prog, [sid], 4)[sid]
        sid = interrupt(prog, sid)
        got += prefill_all(prog, sid)  # the Replay rebuild samples nothing: the history already has tokens
        return got + decode_steps(prog, [sid], 6)[sid]

    def snapshot(prog, sid):
        state = prog.pause(sid, "snapshot")
        assert state.host_bytes == prog.host_bytes_used == 4 * SPEC.nbytes_per_page  # no StateImage bytes
        return prog.resume(state)

    def replay(prog, sid):
        return prog.resume(prog.demote(prog.pause(sid, "snapshot")))

    def aborted(prog, sid):
        assert prog.reserve_units(sid, 1)
        prog.abort_pending(prog.decode([sid]))
        assert prog.input_remaining(sid) == 13
        return sid

    plain = run(lambda prog, sid: sid)
    assert len(plain) == 11
    for interrupt in (snapshot, replay, aborted):
        assert run(interrupt) == plain, interrupt.__name__


def test_fork_shares_pages_and_copies_on_write():
    """The fork samples other tokens than its greedy parent into their shared tail page: each gets its own copy."""
    model = RecencyAttention(2)

    def forked(parent_continues: bool):
        prog = RecencyProgram(model)
        a = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), GREEDY)  # 9 tokens: a shared tail page
        got_a = prefill_all(prog, a) + decode_steps(prog, [a], 1)[a]
        pages = prog.usage().kv_pages_used
        b = prog.fork(a, SamplingParams(temperature=2.0, seed=5))
        assert prog.usage().kv_pages_used == pages
        if not parent_continues:
            prog.release(a)
            return None, decode_steps(prog, [b], 5)[b]
        steps = decode_steps(prog, [a, b], 5)
        assert prog.usage().kv_pages_used > pages  # the shared tail page was copied
        return got_a + steps[a], steps[b]

    got_a, got_b = forked(True)
    assert got_a == reference(model, PROMPTS[0], 7)
    assert got_b == forked(False)[1] and got_b != got_a[2:]


def test_pipelined_decode_equals_sequential():
    model = RecencyAttention(3)
    prog = RecencyProgram(model, static_decode=True)
    sids = [prog.open_sequence(PreparedPrompt(token_ids=p), SamplingParams(temperature=0.8, seed=i))
            for i, p in enumerate(PROMPTS[:2])]
    for s in sids:
        prefill_all(prog, s)
    got = {s: [] for s in sids}
    for s in sids:
        assert prog.reserve_units(s, 2)
    unit = prog.launch_decode(sids)
    for _ in range(6):
        nxt = prog.launch_decode(sids, after=unit)
        batch = prog.collect(unit)
        for row in batch.rows:
            got[row.sequence_id].append(row.tokens[0])
        prog.commit(batch, [RowDecision(accepted=1)] * 2)
        for s in sids:
            assert prog.reserve_units(s, 2)
        unit = nxt
    prog.commit(prog.collect(unit), [RowDecision(accepted=1)] * 2)

    seq = RecencyProgram(model)
    sids2 = [seq.open_sequence(PreparedPrompt(token_ids=p), SamplingParams(temperature=0.8, seed=i))
             for i, p in enumerate(PROMPTS[:2])]
    for s in sids2:
        prefill_all(seq, s)
    steps = decode_steps(seq, sids2, 6)
    assert [got[s] for s in sids] == [steps[s] for s in sids2]


def test_score_window_matches_the_definition():
    model = RecencyAttention(4)
    prog = RecencyProgram(model)
    ids = [3, 9, 27, 1, 40, 2, 2, 17, 33, 5, 8]
    lp = prog.score_window(ids, 2, chunk=3, logits_rows=2)
    want = [float(model.logits(mix(model.embed[ids[:i]])[None]).log_softmax(-1)[0, ids[i]])
            for i in range(2, len(ids))]
    assert lp.tolist() == pytest.approx(want, abs=1e-5)
    assert prog.usage().kv_pages_used == 0 and prog.usage().state_slots_used == 0  # temporary slot and pages


def test_contract_misuse_is_refused():
    prog = RecencyProgram(RecencyAttention(), max_concurrency=1)
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        prog.open_sequence(PreparedPrompt(token_ids=[1, V]), GREEDY)
    sid = prog.open_sequence(PreparedPrompt(token_ids=[1, 2]), GREEDY)
    with pytest.raises(ProgramError, match="no free StateImage slot"):
        prog.open_sequence(PreparedPrompt(token_ids=[1, 2]), GREEDY)
    with pytest.raises(ProgramError, match="not decode-ready"):
        prog.decode([sid])
    with pytest.raises(ProgramError, match="unknown sequence id"):
        prog.input_remaining(sid + 1)
    with pytest.raises(TypeError, match="abstract"):
        PagedProgram(state_layout=StateImageLayout(fields=()), kv_pool=SPEC, device="cpu", max_concurrency=1,
                     capacity=ProgramCapacity(kv_pages=4), vocab_size=V)


def test_the_shared_parts_import_no_plugin():
    modules = ["ninfer.models.common.paged_program", "ninfer.models.common.context", "ninfer.core.cuda_graphs",
               "ninfer.core.readback", "ninfer.core.batch_assembly"]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ninfer_qwen35', 'ninfer_convert', "
            "'ninfer_serve')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
