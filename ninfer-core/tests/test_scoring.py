"""score_window: chunked causal scoring over a temporary slot and pages, logits in row blocks (CPU)."""

import contextlib

import pytest
import torch

from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.device import Device
from ninfer.core.kv_pool import PagedKVPool
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.context import ProgramError
from ninfer.models.common.scoring import score_window

V = 16
CPU = Device("cpu")
SPEC = KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=1, dtype="float32", page_size=4)
HEAD = torch.randn(V, V, generator=torch.Generator().manual_seed(0))


def _stores(pages=8):
    return StateImageStorage(StateImageLayout(fields=()), 1, CPU), PagedKVPool(SPEC, pages, CPU)


def _score(ids, score_from, states, pool, calls=None, **kw):
    """A model whose hidden row of a token is the running sum of the ids so far, read back from its pages."""

    def forward(batch):
        if calls is not None:
            calls.append(batch.input_ids.shape[0])
        flat = pool.caches()[0][0].view(-1)
        flat[batch.slot_mapping] = batch.input_ids.float()
        table = batch.block_tables[0].long()
        return torch.stack([flat[table[torch.arange(p + 1) // 4] * 4 + torch.arange(p + 1) % 4].sum()
                            for p in batch.positions.tolist()])[:, None]

    return score_window(ids, score_from, forward=forward, logits=lambda h: torch.cos(h * HEAD[0]) @ HEAD,
                        states=states, pool=pool, max_model_len=32, vocab_size=V, launches=contextlib.nullcontext(),
                        **kw)


def test_chunks_and_row_blocks_give_the_one_shot_scores():
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    want = torch.stack([(torch.cos(torch.tensor(float(sum(ids[:i]))) * HEAD[0]) @ HEAD).log_softmax(-1)[ids[i]]
                        for i in range(2, len(ids))])
    states, pool = _stores()
    calls = []
    got = _score(ids, 2, states, pool, calls, chunk=5, logits_rows=3)
    assert calls == [5, 5, 3] and torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(_score(ids, 2, states, pool), want, atol=1e-5)
    assert pool.allocator.num_used == 0 and states.num_used == 0  # the temporary slot and pages are back


def test_bad_windows_are_refused_and_a_failed_forward_frees_its_pages():
    states, pool = _stores(pages=2)
    with pytest.raises(ValueError, match="score_from must be in 1..3"):
        _score([1, 2, 3], 0, states, pool)
    with pytest.raises(ValueError, match="exceeds max_model_len 32"):
        _score([1] * 33, 1, states, pool)
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        _score([1, V], 1, states, pool)
    with pytest.raises(ProgramError, match="needs a free StateImage slot and 3 KV pages"):
        _score([1] * 9, 1, states, pool)

    def boom(batch):
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError, match="forward failed"):
        score_window([1, 2, 3], 1, forward=boom, logits=lambda h: h, states=states, pool=pool, max_model_len=32,
                     vocab_size=V, launches=contextlib.nullcontext())
    assert pool.allocator.num_used == 0 and states.num_used == 0


def test_top_alternatives_and_ranks_come_from_the_same_rows():
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    rows = torch.stack([(torch.cos(torch.tensor(float(sum(ids[:i]))) * HEAD[0]) @ HEAD).log_softmax(-1)
                        for i in range(1, len(ids))])
    states, pool = _stores()
    plain = _score(ids, 1, states, pool, logits_rows=3)
    got = _score(ids, 1, states, pool, logits_rows=3, top=3)
    assert torch.equal(got.logprobs, plain)  # asking for alternatives changes no logprob
    want_lp, want_ids = rows.topk(3, dim=1)
    assert torch.allclose(got.top_logprobs, want_lp, atol=1e-5) and torch.equal(got.top_ids, want_ids)
    chosen = rows.gather(1, torch.tensor(ids[1:])[:, None])
    assert torch.equal(got.ranks, (rows > chosen).sum(1) + 1)
    assert _score(ids, 1, states, pool, top=0).top_ids.shape == (len(ids) - 1, 0)
    with pytest.raises(ValueError, match="top must be in 0..16"):
        _score(ids, 1, states, pool, top=17)
    assert pool.allocator.num_used == 0 and states.num_used == 0
