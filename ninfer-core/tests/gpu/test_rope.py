"""The rotary embedding kernel (ninfer.ops.triton.rope) against its fp32 reference, bf16, on the GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("which", ["query", "key"])
def test_apply_rope(model, case, tokens, which):
    from ninfer.ops.rope import apply_rope_ref, rope_cos_sin
    from ninfer.ops.triton.rope import apply_rope

    heads = model.heads if which == "query" else model.kv_heads
    x = case.randn(tokens, heads, model.head_dim)
    cos, sin = rope_cos_sin(case.randint(8192, tokens), model.rotary_dim, 1e7, torch.float32)
    out = case.nans(*x.shape)
    apply_rope(x, cos, sin, model.rotary_dim, out=out)
    case.within(out, apply_rope_ref(x.float(), cos, sin, model.rotary_dim), 5e-3)
