"""The routed experts' quantized kernels (ninfer.ops.triton.moe_quant) against ``moe_experts_ref`` on the GPU over
the same banks: the Qwen3.5-35B-A3B expert bank (E=256, top-8, H=2048, I=512) in FP8 (Qwen's 128 x 128 blocks) and
NVFP4, bf16 activations, one decode token to a prefill chunk; the reference in fp32 on the upcast activations (its
weights dequantized in fp32); then the whole call with no host sync (what a CUDA graph captures)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
TOL = 1e-2  # two chained bf16 GEMMs, rounded where the unfused ops round


def _bank(case, experts, n, k, fmt):
    from ninfer.ops.quant import QuantizedWeight, quantize_fp8_block, quantize_nvfp4

    quantize = quantize_fp8_block if fmt == "fp8" else quantize_nvfp4
    ws = [quantize(case.randn(n, k, scale=k ** -0.5, dtype=torch.float32)) for _ in range(experts)]
    g = None if fmt == "fp8" else torch.stack([w.global_scale for w in ws])
    return QuantizedWeight(format=ws[0].format, data=torch.stack([w.data for w in ws]),
                           scale=torch.stack([w.scale for w in ws]), global_scale=g, block=ws[0].block)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 8, 512])
def test_a3b_bank(case, tokens, fmt):
    from ninfer.ops.moe import moe_experts_ref, moe_route
    from ninfer.ops.triton.moe_quant import moe_experts_quant

    E, k, H, inter = 256, 8, 2048, 512
    gate_up, down = _bank(case, E, 2 * inter, H, fmt), _bank(case, E, H, inter, fmt)
    x = case.randn(tokens, H)
    weights, ids = moe_route(case.randn(tokens, E, dtype=torch.float32), k)
    weights = weights.to(torch.bfloat16)
    shared, gate = case.randn(tokens, H), case.randn(tokens, 1)
    got = moe_experts_quant(x, gate_up, down, ids, weights, shared=shared, shared_gate=gate)
    want = moe_experts_ref(x.float(), gate_up, down, ids, weights.float(), shared.float(), gate.float())
    case.within(got, want, TOL)
    case.no_host_sync(lambda: moe_experts_quant(x, gate_up, down, ids, weights))
