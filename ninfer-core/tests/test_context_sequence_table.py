"""SequenceTable: opening, forking, reserving, settling and releasing sequences over real stores (CPU)."""

import pytest
import torch

from ninfer.contract.batch import PendingRow, RowDecision
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateField, StateImageLayout
from ninfer.core.device import Device
from ninfer.core.kv_pool import PagedKVPool
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.context import KVHistoryStore, ProgramError, SequenceTable

CPU = Device("cpu")
SPEC = KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=2, dtype="float32", page_size=4)
ONE_FIELD = StateImageLayout(fields=(StateField(name="h", dtype="float32", shape=(3,), layers=2),))
GREEDY = SamplingParams(temperature=0.0)


def _table(layout=StateImageLayout(fields=()), slots=2, pages=8, max_model_len=20):
    states = StateImageStorage(layout, slots, CPU)
    pool = PagedKVPool(SPEC, pages, CPU)
    return SequenceTable(states, KVHistoryStore(pool), max_model_len=max_model_len, vocab_size=10), states, pool


def _prefilled(table, tokens=(1, 2, 3, 4, 5)) -> int:
    """A sequence whose prompt is computed and whose first sampled token is committed: decode-ready."""
    sid = table.open(PreparedPrompt(token_ids=tokens), GREEDY)
    seq = table.get(sid)
    assert table.reserve(sid, len(tokens))
    seq.computed = len(tokens)
    seq.pending = True
    table.commit([seq], [PendingRow(sequence_id=sid, tokens=(7,))], [RowDecision(accepted=1)])
    return sid


def test_open_checks_the_prompt_and_binds_a_slot_without_pages():
    table, states, pool = _table()  # a StateImage of no fields: slots are identities only
    assert states.image_bytes == 0
    with pytest.raises(ValueError, match="does not fit max_model_len 20"):
        table.open(PreparedPrompt(token_ids=[1] * 20), GREEDY)
    with pytest.raises(ValueError, match=r"outside the model vocabulary 0\.\.9"):
        table.open(PreparedPrompt(token_ids=[1, 10]), GREEDY)
    a = table.open(PreparedPrompt(token_ids=[1, 2]), GREEDY)
    b = table.open(PreparedPrompt(token_ids=[3]), SamplingParams(seed=4))
    assert a != b and table.get(a).pages == [] and pool.allocator.num_used == 0 and states.num_free == 0
    assert table.get(b).sampling.seed == 4 and table.get(a).input_remaining == 2
    with pytest.raises(ProgramError, match="no free StateImage slot for a new sequence"):
        table.open(PreparedPrompt(token_ids=[1]), GREEDY)
    with pytest.raises(ProgramError, match="unknown sequence id"):
        table.get(99)


def test_reserve_commit_and_rollback():
    table, _, pool = _table()
    with pytest.raises(ValueError, match="at least one token"):
        table.reserve(table.open(PreparedPrompt(token_ids=[1]), GREEDY), 0)
    sid = _prefilled(table)
    seq = table.get(sid)
    assert (seq.ledger[-1], seq.computed, len(seq.pages), seq.input_remaining) == (7, 5, 2, 0)
    with pytest.raises(ValueError, match="exceed max_model_len"):
        table.reserve(sid, 16)
    assert table.reserve(sid, 4) and len(seq.pages) == 3 and table.reserved_pages() == 1
    # a unit ran one position and produced two tokens; accepting one leaves state past it: roll back
    seq.computed += 1
    seq.pending = True
    table.commit([seq], [PendingRow(sequence_id=sid, tokens=(8, 9))], [RowDecision(accepted=1, terminal=True)])
    assert seq.ledger[-2:] == [7, 8] and seq.computed == 0 and seq.pages == [] and pool.allocator.num_used == 0
    assert seq.input_remaining == 6  # the accepted history is re-run (Replay)


def test_abort_voids_a_chained_row_and_release_frees_everything():
    table, states, pool = _table()
    sid = _prefilled(table)
    seq = table.get(sid)
    seq.pending, seq.launched = True, 1
    with pytest.raises(ProgramError, match="unconsumed PendingBatch row"):
        table.release(sid)
    table.abort([seq])
    assert not seq.pending and seq.void_ahead and seq.computed == 0 and seq.pages == []
    seq.launched = 0
    table.release(sid)
    assert pool.allocator.num_used == 0 and states.num_used == 0 and sid not in table.records


def test_fork_copies_the_image_and_shares_the_frontier_pages():
    table, states, pool = _table(ONE_FIELD)
    sid = _prefilled(table)
    src = table.get(sid)
    states.view("h")[src.slot] = torch.arange(6.0).view(2, 3)
    assert table.reserve(sid, 3)  # a reservation is not shared
    child = table.get(table.fork(sid, SamplingParams(temperature=0.5, seed=1)))
    assert torch.equal(states.view("h")[child.slot], states.view("h")[src.slot]) and child.slot != src.slot
    assert child.pages == src.pages[:2] and all(pool.allocator.refcount(p) == 2 for p in child.pages)
    assert (child.ledger, child.computed, child.prompt_len) == (src.ledger, src.computed, src.prompt_len)
    assert child.sampling.temperature == 0.5 and src.sampling.greedy
    src.launched = 1
    with pytest.raises(ProgramError, match="unconsumed"):
        table.fork(sid)
