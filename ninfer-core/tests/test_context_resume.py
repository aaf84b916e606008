"""PausedStates: Snapshot and Replay ResumeStates, host-byte accounting, demote and discard (CPU)."""

import pytest
import torch

from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateField, StateImageLayout
from ninfer.core.device import Device
from ninfer.core.kv_pool import PagedKVPool
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.context import (
    KVHistoryStore,
    PausedStates,
    ProgramError,
    RowSampling,
    SequenceRecord,
    SnapshotResume,
)

CPU = Device("cpu")
SPEC = KVPoolSpec(name="main", layers=2, kv_heads=1, head_dim=2, dtype="float32", page_size=4)


def _store(fields=(StateField(name="h", dtype="float32", shape=(4,), layers=1),), budget=1 << 20):
    states = StateImageStorage(StateImageLayout(fields=fields), 2, CPU)
    pool = PagedKVPool(SPEC, 6, CPU)
    return PausedStates(7, states, KVHistoryStore(pool), budget), states, pool


def _resident(states, pool, computed=6) -> SequenceRecord:
    seq = SequenceRecord(id=1, slot=states.allocate(), prompt_len=3, ledger=list(range(computed + 1)),
                         sampling=RowSampling.resolve(SamplingParams(seed=9), None), computed=computed,
                         pages=pool.allocator.allocate(2))
    states.buffer[seq.slot] = torch.arange(states.image_bytes, dtype=torch.uint8)
    pool.storage[:, :, seq.pages] = torch.randn(pool.storage[:, :, seq.pages].shape)
    return seq


def test_snapshot_resumes_the_same_state_in_fresh_slots_and_pages():
    store, states, pool = _store()
    seq = _resident(states, pool)
    image, kv = states.buffer[seq.slot].clone(), pool.storage[:, :, seq.pages].clone()
    assert store.snapshot_bytes(seq) == states.image_bytes + 2 * pool.nbytes_per_page
    state = store.pause(seq, "snapshot")
    assert isinstance(state, SnapshotResume) and store.host_bytes_used == state.host_bytes == store.snapshot_bytes(seq)
    pool.allocator.free(seq.pages)  # the Program releases the paused sequence
    states.free(seq.slot)
    pool.storage.zero_()
    states.buffer.zero_()
    back = store.resume(state, lambda: 5)
    assert back.id == 5 and back.computed == 6 and back.ledger == seq.ledger and back.sampling == seq.sampling
    assert torch.equal(states.buffer[back.slot], image) and torch.equal(pool.storage[:, :, back.pages], kv)
    assert store.host_bytes_used == 0
    with pytest.raises(ProgramError, match="already resumed or discarded"):
        store.resume(state, lambda: 6)


def test_replay_demote_discard_and_budget():
    store, states, pool = _store(fields=(), budget=2 * SPEC.nbytes_per_page)  # no StateImage fields
    seq = _resident(states, pool, computed=6)
    assert store.can_snapshot(seq) and store.snapshot_bytes(seq) == 2 * SPEC.nbytes_per_page
    snap = store.pause(seq, "snapshot")
    assert not store.can_snapshot(seq)  # the budget is held by the first Snapshot
    with pytest.raises(ProgramError, match="snapshot needs"):
        store.pause(seq, "snapshot")
    with pytest.raises(ValueError, match="pause mode"):
        store.pause(seq, "swap")
    replay = store.demote(snap)
    assert store.host_bytes_used == 0 and replay.ledger == snap.ledger and replay.frontier == 6
    with pytest.raises(ProgramError, match="already resumed or discarded"):
        store.discard(snap)
    with pytest.raises(ProgramError, match="no Snapshot to revoke"):
        store.demote(replay)
    pool.allocator.free(seq.pages)
    states.free(seq.slot)
    back = store.resume(replay, lambda: 2)
    assert back.computed == 0 and len(back.pages) == 2  # the rebuild to position 6 plus the first new unit
    other = store.pause(back, "replay")
    store.discard(other)
    with pytest.raises(ProgramError, match="not produced by this Program"):
        PausedStates(8, states, KVHistoryStore(pool), 0).discard(other)


def test_resume_waits_for_room_and_keeps_the_state():
    store, states, pool = _store()
    seq = _resident(states, pool)
    state = store.pause(seq, "replay")
    hog = pool.allocator.allocate(pool.allocator.num_free)  # the sequence's pages are still held too
    assert store.resume(state, lambda: 3) is None
    pool.allocator.free(hog + seq.pages)
    assert store.resume(state, lambda: 3).id == 3
