"""The GDN output norm with Qwen4Exp's gate choice against transformers' gated RMSNorm (fp32)."""

from __future__ import annotations

import pytest
import torch

from ninfer.ops import rms_norm_gated

modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_rms_norm_gated_matches_transformers(activation):
    hf = modeling.Qwen4ExpTextRMSNormGated(16, eps=1e-6, activation=activation)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(16, generator=gen))
    x, z = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 4, 16, generator=gen) * 2
    with torch.no_grad():
        want = hf(x, z)
    torch.testing.assert_close(rms_norm_gated(x, z, hf.weight, 1e-6, activation=activation), want,
                               rtol=1e-6, atol=1e-6)


def test_unknown_gate_is_refused():
    with pytest.raises(ValueError, match="gate activation 'gelu'"):
        rms_norm_gated(torch.zeros(1, 4), torch.zeros(1, 4), torch.ones(4), 1e-6, activation="gelu")
