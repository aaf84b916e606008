"""Logit adjustments (ninfer.ops.penalties, models.common.penalties) against references written independently:
repetition as HF's ``RepetitionPenaltyLogitsProcessor`` (gather, multiply the negative / divide the positive,
scatter) over prompt and output, presence / frequency as OpenAI documents them over the output; the sampler's
token histories kept up to date from growing ledgers, verification positions seeing their drafts, logit_bias
and min_tokens; the Triton kernel under the interpreter."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.request import SamplingParams
from ninfer.models.common.context import RowSampling, SequenceRecord
from ninfer.models.common.penalties import LogitAdjust
from ninfer.models.common.sampler import Sampler
from ninfer.ops.penalties import apply_penalties, apply_penalties_ref

V = 97


def hf_repetition(scores: torch.Tensor, input_ids: list[int], penalty: float) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor on one row [V], as that library writes it."""
    ids = torch.tensor(input_ids, dtype=torch.long)
    score = torch.gather(scores, 0, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return scores.scatter(0, ids, score)


def openai_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for j in set(output):
        c = output.count(j)
        out[j] = out[j] - c * frequency - presence
    return out


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: RowSampling) -> torch.Tensor:
    """vLLM's order: logit_bias, min_tokens (not here), then repetition over prompt + output, then the rest."""
    x = logits.clone()
    for t, b in p.logit_bias:
        x[t] += b
    if p.repetition_penalty != 1.0 and prompt + output:
        x = hf_repetition(x, prompt + output, p.repetition_penalty)
    return openai_penalties(x, output, p.presence_penalty, p.frequency_penalty)


def _seq(sid: int, ledger: list[int], prompt_len: int, **params) -> SequenceRecord:
    return SequenceRecord(id=sid, slot=sid, prompt_len=prompt_len, ledger=list(ledger),
                          sampling=RowSampling.resolve(SamplingParams(**params), None))


def _ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=gen).tolist()


KNOBS = [dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
         dict(presence_penalty=-0.5, frequency_penalty=-1.5, repetition_penalty=0.8),
         dict(repetition_penalty=2.0, presence_penalty=2.0, logit_bias={3: 5.0, 10: -100.0})]


@pytest.mark.parametrize("knobs", KNOBS, ids=range(len(KNOBS)))
def test_penalties_equal_the_references_as_the_history_grows(knobs):
    gen = torch.Generator().manual_seed(7)
    prompt = _ids(gen, 12)
    seq = _seq(1, prompt, len(prompt), temperature=0.0, **knobs)
    adjust = LogitAdjust(torch.device("cpu"))
    for step in range(6):  # the ledger grows by several tokens between draws (a verify unit's acceptance)
        logits = torch.randn(1, V, generator=gen) * 3
        want = reference(logits[0], prompt, seq.ledger[len(prompt):], seq.sampling)
        adjust.adjust([seq], logits, [seq.generated])
        torch.testing.assert_close(logits[0], want, rtol=1e-6, atol=1e-6)
        seq.ledger.extend(_ids(gen, 1 + step % 3) + [prompt[0]])


def test_a_row_is_adjusted_alone_as_beside_others_and_forget_rebuilds_it():
    gen = torch.Generator().manual_seed(3)
    rows = [_seq(i, _ids(gen, 9), 5, temperature=0.0, **k) for i, k in enumerate(KNOBS)]
    plain = _seq(9, _ids(gen, 4), 2, temperature=0.0)
    logits = torch.randn(5, V, generator=gen)
    adjust = LogitAdjust(torch.device("cpu"))
    batch = logits[[0, 4, 1, 2, 3]].clone()
    adjust.adjust([rows[0], plain, *rows[1:]], batch, [4] * 5)
    for k, seq in enumerate(rows):
        alone = logits[k:k + 1].clone()
        LogitAdjust(torch.device("cpu")).adjust([seq], alone, [4])
        assert torch.equal(alone[0], batch[[0, 2, 3, 4][k]])
    assert torch.equal(batch[1], logits[4])  # no adjustment: untouched
    # A released sequence's history row goes to the next one, rebuilt from its own ledger.
    adjust.forget(rows[0].id)
    other = _seq(20, _ids(gen, 9), 3, temperature=0.0, repetition_penalty=1.5)
    x = logits[:1].clone()
    adjust.adjust([other], x, [6])
    torch.testing.assert_close(x[0], reference(logits[0], other.ledger[:3], other.ledger[3:], other.sampling))


def test_verification_positions_see_the_drafts_before_them():
    """Position j of a verify unit is adjusted as plain decoding would be after accepting drafts 1..j."""
    gen = torch.Generator().manual_seed(5)
    seqs = [_seq(1, _ids(gen, 10), 6, temperature=0.0, frequency_penalty=0.9, repetition_penalty=1.4,
                 presence_penalty=0.3, min_tokens=6, stop_token_ids=(8,)),
            _seq(2, _ids(gen, 7), 7, temperature=0.0),
            _seq(3, _ids(gen, 8), 3, temperature=0.0, repetition_penalty=1.2, logit_bias={5: 1.0})]
    drafts = [[4, 4, 9], [1, 2, 3], [seqs[2].ledger[-1], 7, 7]]
    R = 4
    logits = torch.randn(3 * R, V, generator=gen)
    verify = logits.clone()
    indices = [s.generated for s in seqs]
    Sampler(torch.device("cpu")).adjust_verify(seqs, drafts, verify, indices)
    for b, seq in enumerate(seqs):
        for j in range(R):
            ahead = _seq(seq.id, seq.ledger + drafts[b][:j], seq.prompt_len, temperature=0.0,
                         frequency_penalty=seq.sampling.frequency_penalty,
                         presence_penalty=seq.sampling.presence_penalty,
                         repetition_penalty=seq.sampling.repetition_penalty,
                         logit_bias=dict(seq.sampling.logit_bias), min_tokens=seq.sampling.min_tokens,
                         stop_token_ids=seq.sampling.end_ids)
            plain = logits[b * R + j:b * R + j + 1].clone()
            LogitAdjust(torch.device("cpu")).adjust([ahead], plain, [indices[b] + j])
            assert torch.equal(verify[b * R + j], plain[0]), (b, j)
    # min_tokens: row 0 has generated 4; draws 4 and 5 refuse token 8, draws 6 on do not
    assert verify[0 * R + 1, 8] == float("-inf") and verify[0 * R + 2, 8] != float("-inf")


def test_logit_bias_bans_and_forces_and_min_tokens_refuses_the_end_tokens():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    best = int(logits[0].argmax())
    seqs = [_seq(1, [1, 2], 2, temperature=0.0, logit_bias={best: -100.0}),
            _seq(2, [1, 2], 2, temperature=0.0, logit_bias={11: 100.0}),
            _seq(3, [1, 2], 2, temperature=0.0, min_tokens=3, stop_token_ids=(int(logits[2].argmax()), 4))]
    sampler = Sampler(torch.device("cpu"))
    tokens, _ = sampler.wait(sampler.launch(seqs, logits.clone(), [0, 0, 2]))
    assert tokens[0] != best and tokens[1] == 11 and tokens[2] != int(logits[2].argmax())
    tokens, _ = sampler.wait(sampler.launch(seqs[2:], logits[2:].clone(), [3]))  # min_tokens reached
    assert tokens == [int(logits[2].argmax())]


def test_sampling_params_validate_the_new_fields():
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5, min_tokens=3,
                   max_tokens=3, logit_bias={1: -100, 2: 100.0})
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(repetition_penalty=0.0),
                dict(repetition_penalty=float("inf")), dict(logit_bias={1: 101.0}), dict(logit_bias={-1: 1.0}),
                dict(logit_bias={1: float("nan")}), dict(logit_bias={i: 1.0 for i in range(301)}),
                dict(min_tokens=-1), dict(min_tokens=5, max_tokens=4)):
        with pytest.raises((ValueError, TypeError)):
            SamplingParams(**bad)
    row = RowSampling.resolve(SamplingParams(min_tokens=2, stop_token_ids=(5,)), None)
    assert row.adjusted and not row.counts_tokens and row.end_ids == (5,)
    assert not RowSampling.resolve(SamplingParams(repetition_penalty=1.0, presence_penalty=0.0), None).adjusted


def test_apply_penalties_checks_shapes():
    counts = torch.zeros(2, V, dtype=torch.int32)
    with pytest.raises(ValueError, match="apply_penalties"):
        apply_penalties(torch.zeros(2, V), torch.tensor([0]), torch.tensor([0]), counts,
                        torch.zeros(2, V + 1, dtype=torch.bool), *torch.ones(3, 1))


def test_triton_kernel_equals_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    from ninfer.ops.triton import penalties as t_penalties

    gen = torch.Generator().manual_seed(11)
    vocab = 3000  # two blocks, the second cut short
    logits = torch.randn(5, vocab, generator=gen) * 4
    counts = torch.randint(0, 3, (3, vocab), generator=gen, dtype=torch.int32) * (torch.rand(3, vocab) < 0.1)
    prompt = torch.rand(3, vocab, generator=gen) < 0.05
    sel, hist = torch.tensor([4, 0, 2]), torch.tensor([1, 1, 0])
    knobs = torch.tensor([[0.5, 1.0, 1.3], [-1.0, 0.0, 0.7], [0.0, 2.0, 1.0]])
    want = apply_penalties_ref(logits.clone(), sel, hist, counts.int(), prompt, *knobs.T)
    got = t_penalties.apply_penalties(logits.clone(), sel, hist, counts.int().contiguous(), prompt, *knobs.T)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
