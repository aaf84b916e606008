"""Qwen4Exp's elementwise kernels (ninfer.ops.triton.hyper_connection: norm, gates, mix, inject; and the
sigmoid-gated GDN output norm of ninfer.ops.triton.norm) against their fp32 references at the published Qwen4Exp widths, bf16, on the GPU: 4
streams of 2560, GDN heads of 48 x 128; one decode row, eight, and a prefill chunk."""

from __future__ import annotations

import pytest
import torch

from benchmarks.shapes import QWEN4EXP_SHAPES

pytestmark = pytest.mark.gpu
TOL = 5e-3  # a bf16 output: one rounding is about 2e-3 relative at most
C = QWEN4EXP_SHAPES["qwen4exp-published"]
S, H, EPS = C["hc_count"], C["hidden_size"], C["rms_norm_eps"]


def test_grouped_rms_norm(case, tokens):
    from ninfer.ops.hyper_connection import grouped_rms_norm_ref
    from ninfer.ops.triton.hyper_connection import grouped_rms_norm

    x, w = case.randn(tokens, S * H), case.randn(S * H, scale=0.1)
    want = grouped_rms_norm_ref(x.float(), w.float(), EPS, H)
    case.within(grouped_rms_norm(x, w, EPS, H), want, TOL)
    # a row slice of a wider buffer is read through its stride
    wide = case.randn(tokens, S * H + 64)
    case.within(grouped_rms_norm(wide[:, 32:32 + S * H], w, EPS, H),
                grouped_rms_norm_ref(wide[:, 32:32 + S * H].float(), w.float(), EPS, H), TOL, "strided")


def test_stream_mix(case, tokens):
    from ninfer.ops.hyper_connection import stream_mix_ref
    from ninfer.ops.triton.hyper_connection import stream_mix

    mix, normed = case.randn(tokens, S * H), case.randn(tokens, S * H)
    case.within(stream_mix(mix, normed, S), stream_mix_ref(mix.float(), normed.float(), S), TOL)


def test_hyper_connection_gates(case, tokens):
    from ninfer.ops.hyper_connection import hyper_connection_gates_ref
    from ninfer.ops.triton.hyper_connection import hyper_connection_gates

    low, logits = case.randn(tokens, C["hc_lowrank"], scale=4.0), case.randn(tokens, S, scale=4.0)
    act, w = hyper_connection_gates(low, logits, S)
    want_act, want_w = hyper_connection_gates_ref(low.float(), logits.float(), S)
    case.within(act, want_act, TOL)
    case.within(w, want_w, TOL, "injection weights")
    case.within(hyper_connection_gates(low, None, S)[0], want_act, TOL, "final mixer")
    case.no_host_sync(lambda: hyper_connection_gates(low, logits, S))


def test_hyper_connection_inject(case, tokens):
    from ninfer.ops.hyper_connection import hyper_connection_inject_ref
    from ninfer.ops.triton.hyper_connection import hyper_connection_inject

    x, out, w = case.randn(tokens, S * H), case.randn(tokens, H), 2 * torch.sigmoid(case.randn(tokens, S))
    got = hyper_connection_inject(x, out, w)
    case.within(got, hyper_connection_inject_ref(x.float(), out.float(), w.float()), TOL)
    case.no_host_sync(lambda: hyper_connection_inject(x, out, w))


def test_rms_norm_gated_sigmoid(case, tokens):
    from ninfer.ops.norm import rms_norm_gated_ref
    from ninfer.ops.triton.norm import rms_norm_gated_sigmoid

    hv, dv = C["linear_num_value_heads"], C["linear_value_head_dim"]
    x, z, w = case.randn(tokens, hv, dv), case.randn(tokens, hv, dv), 1.0 + case.randn(dv, scale=0.1)
    out = case.nans(tokens, hv, dv)
    rms_norm_gated_sigmoid(x, z, w, EPS, out=out)
    case.within(out, rms_norm_gated_ref(x.float(), z.float(), w.float(), EPS, activation="sigmoid"), TOL)
