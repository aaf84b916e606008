"""Paged auxiliary fields (``PagedField``) of a KV pool: their accounting, views, copy-on-write and host copies, and
a PagedProgram whose model keeps its whole history in an aux field, so that a lost or misplaced aux page changes
tokens: greedy decode, Snapshot resume, fork copy-on-write and a host replica restore all continue exactly."""

import pytest
import torch

from ninfer.contract.batch import RowDecision
from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, PagedField, StateImageLayout
from ninfer.core.device import Device
from ninfer.core.forward_batch import ForwardBatch, PagedKVViews
from ninfer.core.kv_pool import HostPages, PagedKVPool
from ninfer.models.common.paged_program import PagedProgram

CPU = Device.parse("cpu")
KEYS = PagedField(name="keys", layers=2, shape=(3,), dtype="float32")
FLAGS = PagedField(name="flags", layers=1, shape=(2, 2), dtype="int32")
SPEC = KVPoolSpec(name="main", layers=2, kv_heads=1, head_dim=4, dtype="float32", page_size=4, aux=(KEYS, FLAGS))


def test_paged_fields_are_validated_and_counted():
    plain = KVPoolSpec(name="main", layers=2, kv_heads=1, head_dim=4, dtype="float32", page_size=4)
    assert KEYS.nbytes_per_token == 2 * 3 * 4 and FLAGS.nbytes_per_token == 4 * 4
    assert SPEC.nbytes_per_token == plain.nbytes_per_token + 24 + 16
    assert SPEC.nbytes_per_page == 4 * SPEC.nbytes_per_token == PagedKVPool.page_bytes(SPEC)
    # The K/V dtype of a pool may be overridden; the aux fields keep their own.
    assert PagedKVPool.page_bytes(SPEC, torch.bfloat16) == PagedKVPool.page_bytes(plain, torch.bfloat16) + 4 * 40
    with pytest.raises(ValueError, match="shape"):
        PagedField(name="x", layers=1, shape=(0,), dtype="float32")
    with pytest.raises(ValueError):
        PagedField(name="x", layers=1, shape=(2,), dtype="float99")
    with pytest.raises(ValueError, match="duplicate"):
        KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=2, aux=(KEYS, KEYS))
    with pytest.raises(ValueError, match="PagedField"):
        KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=2, aux=("keys",))


def test_pool_without_aux_is_unchanged():
    spec = KVPoolSpec(name="main", layers=2, kv_heads=2, head_dim=4, dtype="float32", page_size=4)
    pool = PagedKVPool(spec, num_pages=5, device=CPU)
    assert pool.aux_storage == () and pool.nbytes == pool.storage.numel() * 4 == 5 * PagedKVPool.page_bytes(spec)
    host = pool.read_to_host([0, 3])
    assert isinstance(host, HostPages) and host.aux == () and host.kv.shape == pool.host_shape(2)


def test_aux_views_copy_on_write_and_host_round_trip():
    pool = PagedKVPool(SPEC, num_pages=7, device=CPU)
    keys, flags = pool.aux_caches("keys"), pool.aux_caches("flags")
    assert [k.shape for k in keys] == [(7, 4, 3)] * 2 and [f.shape for f in flags] == [(7, 4, 2, 2)]
    assert flags[0].dtype == torch.int32 and pool.nbytes == 7 * SPEC.nbytes_per_page
    with pytest.raises(KeyError, match="no aux field 'nope'"):
        pool.aux_caches("nope")
    # Distinct contents everywhere, written through the views.
    pool.storage.copy_(torch.randn(pool.storage.shape))
    for k in keys:
        k.copy_(torch.randn(k.shape))
    flags[0].copy_(torch.randint(0, 1000, flags[0].shape, dtype=torch.int32))
    pool.copy_page(2, 5)
    assert all(torch.equal(k[5], k[2]) for k in keys) and torch.equal(flags[0][5], flags[0][2])
    assert torch.equal(pool.storage[:, :, 5], pool.storage[:, :, 2])

    pages = [6, 0, 3, 1]
    pool.transfer_block_bytes = 3 * pool.nbytes_per_page  # two transfer blocks
    want = [pool.storage[:, :, pages].clone(), *(t[:, pages].clone() for t in pool.aux_storage)]
    host = pool.read_to_host(pages)
    assert host.num_pages == 4 and host.nbytes == 4 * SPEC.nbytes_per_page
    assert torch.equal(host.kv, want[0]) and all(torch.equal(h, w) for h, w in zip(host.aux, want[1:], strict=True))
    with pytest.raises(ValueError, match="HostPages"):
        pool.read_pages(pages, torch.empty(pool.host_shape(4)))
    pool.storage.zero_()
    for t in pool.aux_storage:
        t.zero_()
    back = [4, 2, 5, 0]
    pool.write_pages(back, host)
    assert torch.equal(pool.storage[:, :, back], want[0])
    assert all(torch.equal(t[:, back], w) for t, w in zip(pool.aux_storage, want[1:], strict=True))
    with pytest.raises(ValueError, match="aux"):
        pool.write_pages(back, HostPages(kv=host.kv, aux=host.aux[:1]))


# -- a Program whose history lives only in an aux field -------------------------------------------------
V, D = 48, 8
HIST = PagedField(name="history", layers=1, shape=(D,), dtype="float32")
AUX_SPEC = KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=2, dtype="float32", page_size=4, aux=(HIST,))
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def mix(rows: torch.Tensor) -> torch.Tensor:
    return (rows * 0.5 ** torch.arange(rows.shape[0] - 1, -1, -1, dtype=rows.dtype)[:, None]).sum(0)


class AuxRecency(PagedProgram):
    """hidden(p) = ``mix`` of the embeddings of positions 0..p, stored in and read back from the aux field only
    (the K/V are never touched)."""

    def __init__(self, seed: int = 0, **capacity) -> None:
        super().__init__(state_layout=StateImageLayout(fields=()), kv_pool=AUX_SPEC, device="cpu", max_concurrency=3,
                         vocab_size=V, capacity=ProgramCapacity(kv_pages=32, host_budget_bytes=1 << 20, **capacity))
        gen = torch.Generator().manual_seed(seed)
        self.embed, self.head = torch.randn(V, D, generator=gen), torch.randn(D, V, generator=gen)
        (self.history,) = self.pool.aux_caches("history")
        self.views = PagedKVViews(kv=self.pool.caches(), page_size=self.page_size)
        self.start_graphs(cuda_graphs=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        flat, ps = self.history.view(-1, D), self.page_size
        flat[batch.slot_mapping] = self.embed[batch.input_ids]
        qsl, out = batch.query_start_loc.tolist(), []
        for b in range(batch.num_seqs):
            table = batch.block_tables[b].long()
            for p in batch.positions[qsl[b]:qsl[b + 1]].tolist():
                q = torch.arange(p + 1)
                out.append(mix(flat[table[q // ps] * ps + q % ps]))
        return torch.stack(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head).float()

    def reference(self, ledger: list[int], n: int) -> list[int]:
        ledger, out = list(ledger), []
        for _ in range(n):
            out.append(int(self.logits(mix(self.embed[ledger])[None])[0].argmax()))
            ledger.append(out[-1])
        return out


def run(prog, sid, steps) -> list[int]:
    got = []
    while prog.input_remaining(sid):
        n = min(5, prog.input_remaining(sid))
        assert prog.reserve_units(sid, n)
        batch = prog.prefill(sid, n)
        if batch is not None:
            got.append(batch.rows[0].tokens[0])
            prog.commit(batch, [RowDecision(accepted=1)])
    while len(got) < steps:
        assert prog.reserve_units(sid, 1)
        batch = prog.decode([sid])
        got.append(batch.rows[0].tokens[0])
        prog.commit(batch, [RowDecision(accepted=1)])
    return got


def test_program_keeps_aux_history_through_snapshot_fork_and_host_replica():
    prog = AuxRecency(checkpoint_slots=2, cache_host_budget_bytes=1 << 20)
    want = prog.reference(PROMPT, 8)
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPT), GREEDY)
    got = run(prog, sid, 3)
    # Snapshot: the host copy holds the aux pages (its bytes count them); the resumed pages are fresh ones.
    state = prog.pause(sid, "snapshot")
    assert state.host_bytes == 3 * AUX_SPEC.nbytes_per_page
    prog.history.zero_()  # nothing on the device survives but the host copy
    sid = prog.resume(state)
    got += run(prog, sid, 2)
    assert got == want[:5]
    # Fork: parent and child share the tail page; the child's first write copies it (aux included), the parent
    # then writes its own in place. Both continue as the uninterrupted history.
    child = prog.fork(sid, GREEDY)
    pages = prog.usage().kv_pages_used
    assert run(prog, child, 3) == want[5:] and prog.usage().kv_pages_used > pages
    got += run(prog, sid, 3)
    assert got == want
    prog.release(child)
    prog.release(sid)

    # A host replica of a checkpoint, after its device copy is evicted, restores the aux history.
    sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPT), GREEDY)
    prog.plan_saves(sid, [len(PROMPT) - 1])
    run(prog, sid, 1)
    prog.release(sid)
    (ck,) = prog.published()
    demoted = prog.evict(ck.id, to_host=True)
    assert demoted.on_host and not demoted.on_device and prog.usage().kv_pages_used == 0
    prog.history.zero_()
    assert prog.lease(ck.id) is not None
    sid = prog.open_cached(PreparedPrompt(token_ids=PROMPT + [want[0]]), GREEDY, ck.id)
    prog.unlease(ck.id)
    assert run(prog, sid, 4) == want[1:5]
