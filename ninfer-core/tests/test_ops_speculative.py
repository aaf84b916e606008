"""Draft verification (``ninfer.ops.speculative``): greedy equals plain greedy, sampled verification is lossless.

The lossless checks are chi-square tests on a 6-token vocabulary over 40,000 verifications drawn from a fixed
seed (so each run draws the same numbers: the test cannot fail one run in ten): the first emitted token follows
the target's first distribution, and after an accepted draft the second follows the target's second, for
argmax drafts (q one-hot) and for sampled drafts with their q.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.ops.sampling import sample
from ninfer.ops.speculative import target_probs, verify

V = 6
N = 40_000
CHI2_DF5_1E4 = 25.74  # chi-square critical value, 5 degrees of freedom, significance 1e-4


def knobs(n: int, temperature: float = 1.0):
    return (torch.full((n,), temperature), torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n))


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draws(gen: torch.Generator, n: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    noise = torch.empty((n, R, V)).exponential_(generator=gen)
    return noise, torch.rand((n, R), generator=gen)


@pytest.fixture
def target():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn((3, V), generator=gen) * 1.5
    logits[1, 4] = float("-inf")  # a token the target (e.g. a grammar mask) forbids
    return logits


@pytest.mark.parametrize("drafter", ["argmax", "sampled"])
def test_sampled_verification_is_lossless(target, drafter):
    gen = torch.Generator().manual_seed(7)
    R = 3
    logits = target.expand(N, R, V).contiguous()
    p = target_probs(target[None], *knobs(1))[0]
    q = torch.softmax(torch.randn((R - 1, V), generator=gen), -1)  # the drafter's own distributions
    if drafter == "argmax":
        drafts = q.argmax(-1).expand(N, R - 1).contiguous()
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(R - 1)], 1)
        draft_probs = q.expand(N, R - 1, V).contiguous()
    noise, uniform = draws(gen, N, R)
    tokens, accepted = verify(logits, drafts, torch.full((N,), R - 1), *knobs(N), noise, uniform, draft_probs)
    assert chi_square(tokens[:, 0], p[0]) < CHI2_DF5_1E4
    second = tokens[accepted >= 1, 1]
    assert second.numel() > 2_000
    assert chi_square(second, p[1]) < CHI2_DF5_1E4
    # each row emits its accepted drafts, then one token; nothing after
    n = accepted + 1
    assert bool((tokens[torch.arange(R)[None, :] >= n[:, None]] == -1).all())
    assert bool((tokens[:, :-1][torch.arange(R - 1)[None, :] < accepted[:, None]] ==
                 drafts[torch.arange(R - 1)[None, :] < accepted[:, None]]).all())


def test_greedy_accepts_the_drafts_plain_greedy_would_have_made():
    gen = torch.Generator().manual_seed(3)
    B, R = 64, 4
    logits = torch.randn((B, R, V), generator=gen)
    best = logits.argmax(-1)
    drafts = best[:, :-1].clone()
    wrong = torch.rand((B, R - 1), generator=gen) < 0.3
    drafts[wrong] = (drafts[wrong] + 1) % V
    num = torch.randint(0, R, (B,), generator=gen)
    noise, uniform = draws(gen, B, R)
    tokens, accepted = verify(logits, drafts, num, *knobs(B, 0.0), noise, uniform)
    for b in range(B):
        a = 0
        while a < num[b] and drafts[b, a] == best[b, a]:
            a += 1
        assert accepted[b] == a
        assert tokens[b, :a + 1].tolist() == [*drafts[b, :a].tolist(), best[b, a].item()]


def test_no_drafts_draws_what_plain_sampling_draws():
    B = 16
    gens = [torch.Generator().manual_seed(100 + b) for b in range(B)]
    logits = torch.randn((B, 1, V), generator=torch.Generator().manual_seed(5))
    temperature, top_k, top_p, min_p = torch.full((B,), 0.8), torch.full((B,), 4), torch.full((B,), 0.9), torch.zeros(B)
    noise = torch.stack([torch.empty(V).exponential_(generator=g) for g in gens])[:, None]
    tokens, accepted = verify(logits, torch.empty((B, 0), dtype=torch.long), torch.zeros(B, dtype=torch.long),
                              temperature, top_k, top_p, min_p, noise, torch.rand(B, 1))
    plain = sample(logits[:, 0], temperature, top_k, top_p, min_p,
                   [torch.Generator().manual_seed(100 + b) for b in range(B)])
    assert accepted.tolist() == [0] * B and tokens[:, 0].tolist() == plain.tolist()


def test_a_forbidden_draft_is_never_emitted(target):
    """A draft the target gives probability 0 (e.g. a grammar mask) is rejected, and its replacement is allowed."""
    gen = torch.Generator().manual_seed(11)
    n, R = 2_000, 3
    logits = target.expand(n, R, V).contiguous()
    drafts = torch.tensor([[0, 4]]).expand(n, 2).contiguous()  # token 4 has -inf at row 1
    noise, uniform = draws(gen, n, R)
    tokens, accepted = verify(logits, drafts, torch.full((n,), 2), *knobs(n), noise, uniform)
    assert bool((accepted < 2).all()) and not bool((tokens[:, 1] == 4).any())


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="verify"):
        verify(torch.zeros(2, 3, V), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long),
               *knobs(2), torch.zeros(2, 3, V), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="num_drafts"):
        verify(torch.zeros(2, 3, V), torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 3]),
               *knobs(2), torch.ones(2, 3, V), torch.zeros(2, 3))
