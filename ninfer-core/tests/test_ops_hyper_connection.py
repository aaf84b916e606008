"""Hyper-connection ops against transformers' Qwen4Exp gated residual (fp32, random weights)."""

from __future__ import annotations

import pytest
import torch

from ninfer.ops import grouped_rms_norm, hyper_connection_inject, hyper_connection_mix

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")


def _config(**kw):
    return transformers.Qwen4ExpTextConfig(hidden_size=24, hc_count=3, hc_lowrank=5, num_hidden_layers=1,
                                           rms_norm_eps=1e-6, **kw)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))


def test_grouped_rms_norm_matches_transformers():
    hf = modeling.Qwen4ExpTextRMSNorm(72, group_size=24, eps=1e-6)
    _randomise(hf, 1)
    x = torch.randn(5, 72) * 3
    torch.testing.assert_close(grouped_rms_norm(x, hf.weight, 1e-6, 24), hf(x), rtol=1e-6, atol=1e-6)


def test_gated_residual_matches_transformers():
    hf = modeling.Qwen4ExpTextGatedResidual(_config())
    _randomise(hf, 2)
    x = torch.randn(7, 72) * 2
    out = torch.randn(7, 24)
    with torch.no_grad():
        want_mixed, hyper_input, want_w = hf(x)
        want = hyper_input + (out.unsqueeze(-2) * want_w.unsqueeze(-1)).flatten(-2)
    mixed, w = hyper_connection_mix(x, hf.hc_norm.weight, hf.input_mix_weight_down.weight,
                                    hf.input_mix_weight_up.weight, hf.block_inject_weight.weight, 3, 1e-6)
    torch.testing.assert_close(mixed, want_mixed, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hyper_connection_inject(x, out, w), want, rtol=1e-6, atol=1e-6)


def test_final_mixer_matches_transformers():
    hf = modeling.Qwen4ExpTextGatedResidual(_config(), use_combine=False)
    _randomise(hf, 3)
    x = torch.randn(4, 72)
    with torch.no_grad():
        want = hf(x)
    mixed, w = hyper_connection_mix(x, hf.hc_norm.weight, hf.input_mix_weight_down.weight,
                                    hf.input_mix_weight_up.weight, None, 3, 1e-6)
    assert w is None
    torch.testing.assert_close(mixed, want, rtol=1e-6, atol=1e-6)


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="hyper_connection_mix"):
        hyper_connection_mix(torch.zeros(2, 70), torch.zeros(70), torch.zeros(5, 70), torch.zeros(70, 5), None, 3, 1e-6)
    with pytest.raises(ValueError, match="hyper_connection_inject"):
        hyper_connection_inject(torch.zeros(2, 72), torch.zeros(2, 23), torch.zeros(2, 3))
