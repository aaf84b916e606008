"""Norms, linear, SwiGLU and RoPE references against their straightforward definitions."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ninfer.ops import apply_rope, linear, rms_norm, rms_norm_gated, rope_cos_sin, silu_and_mul, swiglu


def test_import_does_not_load_triton():
    code = "import sys, ninfer.ops; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("one_plus", [True, False])
def test_rms_norm(one_plus):
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 32), torch.randn(32)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * ((1 + w) if one_plus else w)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, one_plus=one_plus), want)
    half = rms_norm(x.bfloat16(), w, 1e-6, one_plus=one_plus)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, rtol=2e-2, atol=2e-2)


def test_rms_norm_gated():
    torch.manual_seed(0)
    x, z, w = torch.randn(7, 4, 16), torch.randn(7, 4, 16), torch.randn(16)
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    want = w * normed * z * torch.sigmoid(z)
    torch.testing.assert_close(rms_norm_gated(x, z, w, 1e-6), want)


def test_silu_and_mul():
    x = torch.randn(6, 10)
    g, u = x[:, :5], x[:, 5:]
    torch.testing.assert_close(silu_and_mul(x), g / (1 + torch.exp(-g)) * u)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 3))


def test_swiglu_is_linear_then_silu_and_mul():
    torch.manual_seed(0)
    x, w = torch.randn(4, 12), torch.randn(2 * 7, 12)  # [gate; up] rows
    torch.testing.assert_close(swiglu(x, w), silu_and_mul(x @ w.T))
    with pytest.raises(ValueError, match="gate; up"):
        swiglu(x, w[1:])


def test_linear_fp32_out_is_the_cast_reference():
    """On the reference path an fp32 result is the input-dtype product cast (the Triton path is more precise)."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(40, 32, dtype=torch.bfloat16)
    y = linear(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(x, w).float())
    assert torch.equal(linear(x, w, out_dtype=torch.bfloat16), linear(x, w))
    with pytest.raises(ValueError, match="out_dtype"):
        linear(x, w, out_dtype=torch.float16)


def test_partial_rope_matches_complex_rotation():
    torch.manual_seed(0)
    N, H, D, rd, theta = 9, 3, 32, 8, 10_000.0
    x, pos = torch.randn(N, H, D), torch.arange(100, 100 + N)
    cos, sin = rope_cos_sin(pos, rd, theta, torch.float32)
    y = apply_rope(x, cos, sin, rd)
    # Pair (i, i + rd/2) rotates by angle pos * theta^(-2i/rd).
    want = x.clone()
    for i in range(rd // 2):
        ang = pos.double() * theta ** (-2 * i / rd)
        c, s = ang.cos().float()[:, None], ang.sin().float()[:, None]
        a, b = x[:, :, i], x[:, :, i + rd // 2]
        want[:, :, i], want[:, :, i + rd // 2] = a * c - b * s, b * c + a * s
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[..., rd:], x[..., rd:])
    # Rotation keeps norms and relative positions: <R(p)a, R(p')b> depends only on p - p'.
    assert math.isclose(y.norm().item(), x.norm().item(), rel_tol=1e-5)
    with pytest.raises(ValueError, match="apply_rope"):
        apply_rope(x, cos[:, :2], sin[:, :2], rd)


@pytest.mark.parametrize("mode", ["", "torch", "triton"])
def test_cpu_tensors_always_use_the_references(mode, monkeypatch):
    from ninfer.ops.dispatch import triton_kernel

    monkeypatch.setenv("NINFER_OPS", mode)
    assert triton_kernel("norm", "rms_norm", torch.zeros(1)) is None
