"""The routed experts' quantized kernels (ninfer.ops.triton.moe_quant) against ``moe_experts_ref`` over the same
banks, through Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by the root conftest without CUDA), fp32
activations at toy widths: FP8 in Qwen's 128 x 128 blocks (one K tile per block), per-channel scales (one block
spans K) and blocks narrower than a tile row, and NVFP4 (per-16 scales, one global scale per expert and shard);
with the shared expert joined in the slot sum. The published widths in bf16 are the GPU test
``tests/gpu/test_moe_quant.py``."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from ninfer.ops.moe import moe_experts_ref, moe_route  # noqa: E402
from ninfer.ops.quant import QuantizedWeight, quantize_fp8_block, quantize_nvfp4  # noqa: E402
from ninfer.ops.triton.moe_quant import fits, moe_experts_quant  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _bank(experts: int, n: int, k: int, block: tuple[int, int] | None, seed: int) -> QuantizedWeight:
    """A bank of random experts in FP8 with ``block``, or NVFP4 (``block`` None) with two shards' global scales."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    mats = [torch.randn(n, k, generator=gen, device=DEV) * 0.2 for _ in range(experts)]
    ws = [quantize_fp8_block(m, block) if block else quantize_nvfp4(m, (n // 2, n - n // 2)) for m in mats]
    g = None if block else torch.stack([w.global_scale for w in ws])
    return QuantizedWeight(format=ws[0].format, data=torch.stack([w.data for w in ws]),
                           scale=torch.stack([w.scale for w in ws]), global_scale=g, block=ws[0].block)


@pytest.mark.parametrize("block", [(128, 128), (1, 10_000), (32, 32), None],
                         ids=["fp8-qwen", "fp8-per-channel", "fp8-narrow", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_the_kernels_match_the_reference(block, tokens):
    E, H, inter, k = 6, 96, 80, 2
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    per_channel = block is not None and block[1] > 1000
    gate_up = _bank(E, 2 * inter, H, (1, H) if per_channel else block, 1)
    down = _bank(E, H, inter, (1, inter) if per_channel else block, 2)
    x = torch.randn(tokens, H, generator=gen, device=DEV)
    weights, ids = moe_route(torch.randn(tokens, E, generator=gen, device=DEV), k)
    assert fits(x, gate_up, down)
    torch.testing.assert_close(moe_experts_quant(x, gate_up, down, ids, weights),
                               moe_experts_ref(x, gate_up, down, ids, weights), rtol=1e-5, atol=1e-5)
    shared, gate = torch.randn(tokens, H, generator=gen, device=DEV), torch.randn(tokens, 1, generator=gen, device=DEV)
    torch.testing.assert_close(moe_experts_quant(x, gate_up, down, ids, weights, shared=shared, shared_gate=gate),
                               moe_experts_ref(x, gate_up, down, ids, weights, shared, gate), rtol=1e-5, atol=1e-5)


def test_what_the_kernels_do_not_take():
    """A K block narrower than any tile (16), banks of two formats and dense banks are not theirs: dispatch keeps
    the reference."""
    x = torch.zeros(2, 96, device=DEV)
    assert not fits(x, _bank(2, 160, 96, (8, 8), 3), _bank(2, 96, 80, (8, 8), 4))
    assert not fits(x, _bank(2, 160, 96, None, 3), _bank(2, 96, 80, (16, 16), 4))
    assert not fits(x, torch.zeros(2, 160, 96), torch.zeros(2, 96, 80))
    with pytest.raises(ValueError, match="do not fit its tiles"):
        moe_experts_quant(x, _bank(2, 160, 96, (8, 8), 3), _bank(2, 96, 80, (8, 8), 4), torch.zeros(2, 1).long(),
                        torch.ones(2, 1))
