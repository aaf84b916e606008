"""Sampling: greedy, filters, per-row generators independent of neighbours; logprobs of the raw model."""

import pytest
import torch

from ninfer.ops import logprobs, sample
from ninfer.ops.sampling import greedy


def params(B, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (torch.full((B,), float(temperature)), torch.full((B,), top_k, dtype=torch.int64),
            torch.full((B,), float(top_p)), torch.full((B,), float(min_p)))


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, *params(4, temperature=0.0), [None] * 4), logits.argmax(-1))


def test_greedy_op_is_argmax():
    """The first index of the maximum, NaN counting as the maximum (torch's argmax), in any float dtype."""
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    logits[1, [7, 3, 200]] = 5.0
    logits[2] = float("-inf")
    logits[3, [250, 40]] = float("nan")
    logits[4, 9] = float("inf")
    assert greedy(logits).tolist() == [int(logits[0].argmax()), 3, 0, 40, 9]
    assert torch.equal(greedy(logits.bfloat16()), logits.bfloat16().argmax(-1))
    with pytest.raises(ValueError, match="greedy"):
        greedy(logits[0])


def test_filters_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for kw, allowed in [({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}), ({"top_p": 0.4}, {0}),
                        ({"min_p": 0.2}, {0, 1, 2}), ({"min_p": 0.7}, {0})]:
        gen = torch.Generator().manual_seed(1)
        seen = {int(sample(logits, *params(1, **kw), [gen])) for _ in range(300)}
        assert seen == allowed, (kw, seen)


def test_draws_follow_the_distribution():
    p = torch.tensor([0.6, 0.3, 0.1])
    gen = torch.Generator().manual_seed(0)
    logits = (p.log() * 2.0)[None].repeat(2000, 1)  # temperature 2 undoes the *2
    tokens = sample(logits, *params(2000, temperature=2.0), [gen] * 2000)
    freq = torch.bincount(tokens, minlength=3).float() / 2000
    torch.testing.assert_close(freq, p, atol=0.04, rtol=0)


def test_a_row_depends_only_on_its_own_seed():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)

    def run(rows, seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return [sample(logits[rows], *params(len(rows), temperature=0.9, top_p=0.95), gens).tolist()
                for _ in range(5)]

    together = run([0, 1, 2], [11, 12, 13])
    alone = run([1], [12])
    assert [step[1] for step in together] == [step[0] for step in alone]
    assert run([0, 1, 2], [11, 12, 13]) == together


def test_top_k_candidates_path_draws_what_the_full_sort_draws():
    """With every sampled row's top_k <= max_top_k, filtering the top-k candidates gives the same tokens as
    sorting the vocabulary (same noise, same race), rows with different settings and greedy rows mixed."""
    torch.manual_seed(3)
    B, V = 5, 3000
    logits = torch.randn(B, V) * 3
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9])
    top_k = torch.tensor([5, 40, 0, 40, 17])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.02])
    for seed in range(40):
        def draw(seed=seed, **kw):
            gens = [torch.Generator().manual_seed(seed * 10 + r) for r in range(B)]
            return sample(logits, temperature, top_k, top_p, min_p, gens, **kw)

        full = draw()
        assert torch.equal(draw(max_top_k=40), full), seed
        assert torch.equal(draw(max_top_k=64), full), seed  # a looser bound changes nothing
        assert full[2] == logits[2].argmax()
    with pytest.raises(ValueError, match="max_top_k"):
        sample(logits, temperature, top_k, top_p, min_p, [None] * B, max_top_k=0)


def test_logprobs_use_the_raw_distribution():
    logits = torch.randn(2, 30)
    tokens = torch.tensor([3, 7])
    lp, ids, top = logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, ref[[0, 1], [3, 7]])
    torch.testing.assert_close(top, ref.topk(5, -1).values)
    assert torch.equal(ids, ref.topk(5, -1).indices)
    assert logprobs(logits, tokens, 0)[1].shape == (2, 0)
    with pytest.raises(ValueError, match="top_n"):
        logprobs(logits, tokens, 31)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="sample"):
        sample(torch.randn(2, 5), *params(3), [None] * 2)


@pytest.mark.gpu
def test_cuda_rows_depend_only_on_their_own_generator():
    logits = torch.randn(3, 1000, device="cuda")

    def run(rows, seeds):
        gens = [torch.Generator("cuda").manual_seed(s) for s in seeds]
        p = [x.cuda() for x in params(len(rows), temperature=0.8, top_k=50, top_p=0.9, min_p=0.01)]
        return [sample(logits[rows], *p, gens).tolist() for _ in range(4)]

    together = run([0, 1, 2], [1, 2, 3])
    assert [s[2] for s in together] == [s[0] for s in run([2], [3])]
