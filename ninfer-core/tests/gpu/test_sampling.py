"""The greedy kernel (ninfer.ops.triton.sampling) against torch.argmax, bitwise, on the GPU: Qwen3.5's and
Qwen3's vocabularies, bf16 and fp32 logits, planted ties (the first index wins) and special rows."""

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
