"""The sampling kernels (ninfer.ops.triton.sampling) on the GPU, bitwise: greedy against torch.argmax
(Qwen3.5's and Qwen3's vocabularies, bf16 and fp32 logits, planted ties: the first index wins, special rows);
the constrained-decoding token mask against apply_token_mask_ref (random and special mask rows, vocabularies
that are not a multiple of 32, in a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
VOCABS = (248320, 151936)  # Qwen3.5, Qwen3
DTYPES = (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_equals_argmax(case, batch, vocab, dtype):
    from ninfer.ops.triton.sampling import greedy

    x = case.randn(batch, vocab, scale=3.0, dtype=dtype)
    tied = x.clone()  # three copies of a new maximum per row: the first index must win
    at = case.randint(vocab, batch, 3)
    tied.scatter_(1, at, (tied.float().amax(-1, keepdim=True) + 1).to(dtype).expand(batch, 3))
    for label, logits in (("random", x), ("3 tied maxima", tied)):
        out = torch.full((batch,), -1, dtype=torch.int64, device=case.device)
        greedy(logits, out=out)
        assert torch.equal(out, logits.argmax(-1)), label


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_special_rows(case, vocab, dtype):
    """An all -inf row, NaN above +inf (the first NaN wins), -0.0 tying +0.0, a row that ends in NaN."""
    from ninfer.ops.triton.sampling import greedy

    special = case.randn(4, vocab, dtype=dtype)
    special[0] = float("-inf")
    special[1, [vocab // 2, vocab - 1]] = float("nan")
    special[1, 7] = float("inf")
    special[2] = 0.0
    special[2, :vocab // 3] = -0.0
    special[3, vocab // 2:] = float("nan")
    out = greedy(special)
    assert torch.equal(out, special.argmax(-1)), out.tolist()


def _random_masks(case, batch: int, vocab: int) -> torch.Tensor:
    """int32 [batch, ceil(vocab / 32)]: random bits, with every 4th row all refused, all allowed (-1 words) or
    allowing a random ~1 % of tokens, and junk bits past the vocabulary in the last word."""
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31, (batch, words), generator=case.gen, device=case.device,
                         dtype=torch.int64).to(torch.int32)
    for b in range(1, batch, 4):
        kind = (b // 4) % 3
        if kind == 0:
            mask[b] = 0
        elif kind == 1:
            mask[b] = -1
        else:
            allowed = torch.zeros(words * 32, dtype=torch.int64, device=case.device)
            allowed[case.randint(vocab, max(vocab // 100, 1))] = 1
            shifted = allowed.view(words, 32) << torch.arange(32, device=case.device)
            mask[b] = ((shifted.sum(-1) + 2**31) % 2**32 - 2**31).to(torch.int32)
    if vocab % 32:
        mask[:, -1] |= -1 << (vocab % 32)
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab", (248320, 1000, 77))
@pytest.mark.parametrize("rows", (1, 3, 8, 32), ids=lambda b: f"B{b}")
def test_apply_token_mask_equals_reference(case, rows, vocab, dtype):
    """The mask kernel against apply_token_mask_ref, bitwise, in place; B up to 8 rows x 4 positions (verify)."""
    from ninfer.ops.sampling import apply_token_mask_ref
    from ninfer.ops.triton.sampling import apply_token_mask

    logits = case.randn(rows, vocab, scale=3.0, dtype=dtype)
    mask = _random_masks(case, rows, vocab)
    want = apply_token_mask_ref(logits.clone(), mask)
    got = logits.clone()
    assert apply_token_mask(got, mask) is got
    assert torch.equal(got, want)
    allowed = want != float("-inf")
    assert torch.equal(got[allowed], logits[allowed])  # an allowed logit is untouched


def test_apply_token_mask_in_a_cuda_graph(case):
    """Captured once, replayed with new mask contents: equal to eager calls (no host work in the launch)."""
    from ninfer.ops.sampling import apply_token_mask_ref
    from ninfer.ops.triton.sampling import apply_token_mask

    rows, vocab = 8, 248320
    logits = case.randn(rows, vocab, dtype=torch.float32)
    mask = _random_masks(case, rows, vocab)
    apply_token_mask(logits.clone(), mask)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_token_mask(logits, mask)
    for _ in range(3):
        fresh, fresh_mask = case.randn(rows, vocab, dtype=torch.float32), _random_masks(case, rows, vocab)
        logits.copy_(fresh)
        mask.copy_(fresh_mask)
        graph.replay()
        assert torch.equal(logits, apply_token_mask_ref(fresh, fresh_mask))
