"""Sampler: greedy and counter-seeded draws per row, logprobs rows, PendingRow assembly (CPU)."""

import pytest
import torch

from ninfer.contract.request import SamplingParams
from ninfer.models.common.context import RowSampling, SequenceRecord
from ninfer.models.common.sampler import Sampler, pending_rows
from ninfer.ops.sampling import logprobs


def _seq(sid: int, **params) -> SequenceRecord:
    return SequenceRecord(id=sid, slot=sid, prompt_len=2, ledger=[1, 2],
                          sampling=RowSampling.resolve(SamplingParams(**params), None))


def _draw(sampler, seqs, logits, indices):
    tokens, lp = sampler.wait(sampler.launch(seqs, logits, indices))
    return tokens, lp, pending_rows(seqs, range(len(seqs)), tokens, lp)


def test_a_row_draws_the_same_token_alone_or_beside_others():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    sampled = _seq(1, temperature=1.0, seed=42)
    neighbours = [_seq(2, temperature=0.0), _seq(3, temperature=0.7, top_k=5, seed=1)]
    alone, _, _ = _draw(Sampler(torch.device("cpu")), [sampled], logits[:1], [4])
    batch, lp, rows = _draw(Sampler(torch.device("cpu")), [sampled, *neighbours], logits, [4, 0, 9])
    assert batch[0] == alone[0] and batch[1] == int(logits[1].argmax()) and lp == {}
    assert [r.tokens for r in rows] == [(t,) for t in batch] and rows[0].logprobs is None
    # the draw is a function of (seed, index): another index draws again, the same index repeats
    sampler = Sampler(torch.device("cpu"))
    draws = {_draw(sampler, [sampled], logits[:1], [i])[0][0] for i in range(16)}
    assert len(draws) > 1 and _draw(sampler, [sampled], logits[:1], [4])[0] == alone


def test_logprobs_rows_carry_the_chosen_token_and_their_top_list():
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    seqs = [_seq(1, temperature=0.0, top_logprobs=3), _seq(2, temperature=0.0),
            _seq(3, temperature=0.0, logprobs=True)]
    tokens, lp, rows = _draw(Sampler(torch.device("cpu")), seqs, logits, [0, 0, 0])
    assert sorted(lp) == [0, 2] and rows[1].logprobs is None
    chosen, top_ids, top_lp = logprobs(logits, torch.tensor(tokens), 3)
    assert rows[0].logprobs == (pytest.approx(float(chosen[0])),)
    assert [t for t, _ in rows[0].top_logprobs[0]] == top_ids[0].tolist()
    assert [v for _, v in rows[0].top_logprobs[0]] == pytest.approx(top_lp[0].tolist())
    assert rows[2].logprobs == (pytest.approx(float(chosen[2])),) and rows[2].top_logprobs == ((),)


def test_forget_drops_the_generator():
    sampler = Sampler(torch.device("cpu"))
    seq = _seq(1, temperature=1.0, seed=3)
    gen = sampler.generator(seq, 0)
    assert sampler.generator(seq, 1) is gen
    sampler.forget(1)
    assert sampler.generator(seq, 1) is not gen


def test_verification_draws_what_decode_would_draw_at_each_index():
    """Position i of a verification draws the noise of generated token index + i, as plain sampling does: a
    verification without drafts samples the decode token, and a row's draws ignore its neighbours."""
    from ninfer.ops.speculative import verify

    sampled = _seq(1, temperature=0.9, seed=42)
    greedy = _seq(2, temperature=0.0)
    logits = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.device("cpu"))
    noise, uniform = sampler.verify_draws([sampled, greedy], [5, 0], 3, 64)
    assert not noise[1].any() and not uniform[1].any()
    for i in range(3):
        plain, _, _ = _draw(Sampler(torch.device("cpu")), [sampled], logits[0, i:i + 1], [5 + i])
        p = sampled.sampling
        tokens, _ = verify(logits[:1, i:i + 1], torch.empty((1, 0), dtype=torch.long), torch.zeros(1, dtype=torch.long),
                           torch.tensor([p.temperature]), torch.tensor([p.top_k]), torch.tensor([p.top_p]),
                           torch.tensor([p.min_p]), noise[:1, i:i + 1], uniform[:1, i:i + 1])
        assert tokens[0, 0].item() == plain[0]
    again, _ = sampler.verify_draws([sampled], [5], 3, 64)
    assert torch.equal(again, noise[:1])  # reproducible: a function of (seed, index) only
