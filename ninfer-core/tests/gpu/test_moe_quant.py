"""The routed experts' FP8 kernels (ninfer.ops.triton.moe_quant) against ``moe_experts_ref`` on the GPU over the
same FP8 banks: the Qwen3.5-35B-A3B expert bank (E=256, top-8, H=2048, I=512) in Qwen's 128 x 128 blocks, bf16
activations, one decode token to a prefill chunk; the reference in fp32 on the upcast activations (its weights
dequantized in fp32); then the whole call with no host sync (what a CUDA graph captures)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
TOL = 1e-2  # two chained bf16 GEMMs, rounded where the unfused ops round


def _bank(case, experts, n, k):
    from ninfer.ops.quant import QuantizedWeight, quantize_fp8_block

    ws = [quantize_fp8_block(case.randn(n, k, scale=k ** -0.5, dtype=torch.float32)) for _ in range(experts)]
    return QuantizedWeight(format=ws[0].format, data=torch.stack([w.data for w in ws]),
                           scale=torch.stack([w.scale for w in ws]), block=ws[0].block)


@pytest.mark.parametrize("tokens", [1, 8, 512])
def test_a3b_bank_in_fp8(case, tokens):
    from ninfer.ops.moe import moe_experts_ref, moe_route
    from ninfer.ops.triton.moe_quant import moe_experts_fp8

    E, k, H, inter = 256, 8, 2048, 512
    gate_up, down = _bank(case, E, 2 * inter, H), _bank(case, E, H, inter)
    x = case.randn(tokens, H)
    weights, ids = moe_route(case.randn(tokens, E, dtype=torch.float32), k)
    weights = weights.to(torch.bfloat16)
    shared, gate = case.randn(tokens, H), case.randn(tokens, 1)
    got = moe_experts_fp8(x, gate_up, down, ids, weights, shared=shared, shared_gate=gate)
    want = moe_experts_ref(x.float(), gate_up, down, ids, weights.float(), shared.float(), gate.float())
    case.within(got, want, TOL)
    case.no_host_sync(lambda: moe_experts_fp8(x, gate_up, down, ids, weights))
