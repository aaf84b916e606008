"""The few-row linear kernel (ninfer.ops.triton.linear) against fp32 references at every decode weight shape
of Qwen3.5-9B and -0.8B, bf16, on the GPU: plain projections, the MLP's gate_up with its SwiGLU epilogue, and
the lm_head's fp32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_linear(case, batch, weight_shape):
    from ninfer.ops.triton.linear import linear

    N, K = weight_shape
    x, w = case.randn(batch, K), case.randn(N, K, scale=K ** -0.5)
    out = case.nans(batch, N)
    linear(x, w, out=out)
    case.within(out, F.linear(x.float(), w.float()), 5e-3)
    # The configuration depends on (N, K) only: a row's result does not depend on its batch neighbours.
    assert torch.equal(linear(x[:1], w), out[:1])


def test_swiglu(model, case, batch):
    from ninfer.ops.linear import swiglu_ref
    from ninfer.ops.triton.linear import swiglu

    H, inter = model.hidden, model.inter
    x, w = case.randn(batch, H), case.randn(2 * inter, H, scale=H ** -0.5)
    out = case.nans(batch, inter)
    swiglu(x, w, out=out)
    case.within(out, swiglu_ref(x.float(), w.float()), 5e-3)


def test_linear_fp32_logits(model, case, batch):
    """The lm_head's fp32 output is the kernel's accumulator: close to fp32, and rounded it is the bf16 output."""
    from ninfer.ops.triton.linear import linear

    V, K = model.vocab, model.hidden
    x, w = case.randn(batch, K), case.randn(V, K, scale=K ** -0.5)
    out = case.nans(batch, V, dtype=torch.float32)
    linear(x, w, out=out)
    case.within(out, F.linear(x.float(), w.float()), 1e-5)
    assert torch.equal(out.to(x.dtype), linear(x, w))


def test_linear_moe_head(case, batch):
    """The 35B-A3B lm_head [248320 x 2048] takes a measured configuration of its own (64 columns, 128-wide K
    tiles): its fp32 logits against fp32, and a row alone equal to the row in a batch."""
    from ninfer.ops.triton.linear import default_config, linear

    V, K = 248320, 2048
    assert default_config(V, K)[:3] == (64, 128, 1)
    x, w = case.randn(batch, K), case.randn(V, K, scale=K ** -0.5)
    out = case.nans(batch, V, dtype=torch.float32)
    linear(x, w, out=out)
    case.within(out, F.linear(x.float(), w.float()), 1e-5)
    assert torch.equal(linear(x[:1], w, out=case.nans(1, V, dtype=torch.float32)), out[:1])
