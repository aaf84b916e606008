"""Qwen4Exp's elementwise Triton kernels (ninfer.ops.triton.hyper_connection: the per-stream norm, the mix's
activation with the injection weights, the streams' gated mean, the injection; the sigmoid-gated GDN output norm of ninfer.ops.triton.norm) against their torch
references through Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by the root conftest without CUDA),
fp32 at toy widths; the published widths in bf16 are their GPU tests (``tests/gpu/test_hyper_connection.py``).
Composed, the kernels give ``hyper_connection_mix`` / ``hyper_connection_inject`` what the references do."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from ninfer.ops import hyper_connection as hc  # noqa: E402
from ninfer.ops.triton import hyper_connection as t_hc  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
S, H = 3, 40  # a stream wider than no power of two: the masked tail of every tile is exercised
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV)


@pytest.mark.parametrize("rows", [1, 5])
def test_grouped_rms_norm(rows):
    x, w = _randn(rows, S * H, seed=0), _randn(S * H, seed=1) * 0.1
    torch.testing.assert_close(t_hc.grouped_rms_norm(x, w, 1e-6, H), hc.grouped_rms_norm_ref(x, w, 1e-6, H),
                               rtol=1e-6, atol=1e-6)
    wide = _randn(rows, S * H + 8, seed=2)[:, 4:4 + S * H]  # rows strided in a wider buffer
    torch.testing.assert_close(t_hc.grouped_rms_norm(wide, w, 1e-6, H), hc.grouped_rms_norm_ref(wide, w, 1e-6, H),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 7"):
        t_hc.grouped_rms_norm(x, w, 1e-6, 7)


@pytest.mark.parametrize("rows", [1, 5])
def test_stream_mix(rows):
    mix, normed = _randn(rows, S * H, seed=3), _randn(rows, S * H, seed=4)
    torch.testing.assert_close(t_hc.stream_mix(mix, normed, S), hc.stream_mix_ref(mix, normed, S),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5])
def test_inject(rows):
    x, out, w = _randn(rows, S * H, seed=5), _randn(rows, H, seed=6), torch.sigmoid(_randn(rows, S, seed=7)) * 2
    torch.testing.assert_close(t_hc.hyper_connection_inject(x, out, w), hc.hyper_connection_inject_ref(x, out, w),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        t_hc.hyper_connection_inject(x, out[:, 1:], w)


@pytest.mark.parametrize("rows", [1, 5])
def test_gates(rows):
    low, logits = _randn(rows, 13, seed=16) * 3, _randn(rows, S, seed=17) * 3  # 13: a masked tail
    act, w = t_hc.hyper_connection_gates(low, logits, S)
    want_act, want_w = hc.hyper_connection_gates_ref(low, logits, S)
    torch.testing.assert_close(act, want_act, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-6)
    act, none = t_hc.hyper_connection_gates(low[:, 1:], None, S)  # the final mixer: no injection; strided rows
    assert none is None
    torch.testing.assert_close(act, hc.hyper_connection_gates_ref(low[:, 1:], None, S)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=f"must be \\[N, R\\] and \\[N, {S}\\]"):
        t_hc.hyper_connection_gates(low, logits[:, 1:], S)


def test_rms_norm_gated_sigmoid():
    from ninfer.ops.norm import rms_norm_gated_ref
    from ninfer.ops.triton.norm import rms_norm_gated, rms_norm_gated_sigmoid

    x, z, w = _randn(4, 3, 24, seed=8), _randn(4, 3, 24, seed=9), 1.0 + _randn(24, seed=10) * 0.1
    torch.testing.assert_close(rms_norm_gated_sigmoid(x, z, w, 1e-6),
                               rms_norm_gated_ref(x, z, w, 1e-6, activation="sigmoid"), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rms_norm_gated(x, z, w, 1e-6), rms_norm_gated_ref(x, z, w, 1e-6), rtol=1e-6, atol=1e-6)


def test_the_mix_through_the_kernels_is_the_references(monkeypatch):
    """``hyper_connection_mix`` and ``hyper_connection_inject`` with every elementwise part on its kernel (as CUDA
    runs them) against the same calls on the references."""
    x, norm = _randn(5, S * H, seed=11), _randn(S * H, seed=12) * 0.1
    down, up, inject = _randn(8, S * H, seed=13) * 0.2, _randn(S * H, 8, seed=14) * 0.2, _randn(S, S * H, seed=15)
    want_mixed, want_w = hc.hyper_connection_mix(x, norm, down, up, inject, S, 1e-6)
    want_y = hc.hyper_connection_inject(x, want_mixed, want_w)
    kernels = {"grouped_rms_norm": t_hc.grouped_rms_norm, "stream_mix": t_hc.stream_mix,
               "hyper_connection_inject": t_hc.hyper_connection_inject,
               "hyper_connection_gates": t_hc.hyper_connection_gates}
    monkeypatch.setattr(hc, "triton_kernel", lambda module, name, tensor: kernels[name])
    mixed, w = hc.hyper_connection_mix(x, norm, down, up, inject, S, 1e-6)
    torch.testing.assert_close(mixed, want_mixed, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hc.hyper_connection_inject(x, mixed, w), want_y, rtol=1e-5, atol=1e-6)
