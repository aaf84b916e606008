"""The quantized weight formats' definitions (ninfer.ops.quant): e2m1 packing, block-scaled FP8 and NVFP4 made
from float weights and read back, row views of fused parents, and the reference linear paths."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.quant import A16_ONLY, ALLOW_A4, ALLOW_A8, intersect
from ninfer.ops.quant import (
    E2M1_VALUES,
    QuantizedWeight,
    linear_quant_ref,
    pack_e2m1,
    quantize_activation_fp8,
    quantize_fp8_block,
    quantize_nvfp4,
    unpack_e2m1,
)


def test_e2m1_codes_round_trip_and_round_half_to_even():
    values = torch.tensor(E2M1_VALUES).reshape(1, 16)
    assert torch.equal(unpack_e2m1(pack_e2m1(values)), values)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -0.75, -5.0, 0.1, 2.2, 0, 0, 0, 0]])
    assert unpack_e2m1(pack_e2m1(ties)).tolist()[0][:12] == [0, 1, 1, 2, 2, 4, 4, 6, -1, -4, 0, 2]
    # the even element is the low nibble
    assert pack_e2m1(torch.tensor([[1.0, 6.0]])).item() == 0x72


@pytest.mark.parametrize("make,tol", [(lambda w: quantize_fp8_block(w), 0.04),
                                      (lambda w: quantize_fp8_block(w, (1, w.shape[1])), 0.04),
                                      (lambda w: quantize_nvfp4(w), 0.12),
                                      (lambda w: quantize_nvfp4(w, (72, 128)), 0.12)])
def test_formats_reproduce_the_weight(make, tol):
    w = torch.randn(200, 256, generator=torch.Generator().manual_seed(0))
    q = make(w)
    assert q.shape == (200, 256)
    assert ((q.dequantize() - w).norm() / w.norm()).item() < tol
    x = torch.randn(3, 256)
    ref = x @ q.dequantize().T
    torch.testing.assert_close(linear_quant_ref(x, q), ref, rtol=1e-5, atol=1e-4)
    # W8A8 adds the activation's rounding: within e4m3's relative step of the product's scale
    a8 = linear_quant_ref(x, q.with_activation("a8"))
    assert ((a8 - ref).norm() / ref.norm()).item() < 0.05


def test_fp8_block_scale_is_amax_over_448():
    w = torch.zeros(130, 128)
    w[0, 0], w[129, 5] = 448.0 * 3, -2.0
    q = quantize_fp8_block(w)
    assert torch.equal(q.scale, torch.tensor([[3.0], [2.0 / 448]]))
    assert q.dequantize()[0, 0].item() == 1344.0 and q.dequantize()[129, 5].item() == -2.0


def test_row_views_and_stacking_keep_each_shards_scales():
    w = torch.randn(256, 128)
    q = quantize_fp8_block(w)
    assert torch.equal(QuantizedWeight.cat([q.rows(0, 128), q.rows(128, 256)]).dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="cut through a block"):
        q.rows(0, 100)
    n = quantize_nvfp4(w, (100, 156))
    assert n.global_scale[0] != n.global_scale[-1]
    torch.testing.assert_close(n.rows(100, 256).dequantize(), n.dequantize()[100:])
    with pytest.raises(ValueError, match="different formats"):
        QuantizedWeight.cat([q, n])


def test_planes_are_checked():
    q = quantize_fp8_block(torch.randn(128, 128))
    with pytest.raises(ValueError, match="do not match"):
        QuantizedWeight(format="fp8_e4m3_block", data=q.data, scale=q.scale.to(torch.bfloat16), block=(128, 128))
    n = quantize_nvfp4(torch.randn(8, 32))
    with pytest.raises(ValueError, match="global_scale float32"):
        QuantizedWeight(format="nvfp4", data=n.data, scale=n.scale, global_scale=None, block=(1, 16))


def test_activation_quantization_is_per_token_group():
    x = torch.randn(4, 300)
    q, s = quantize_activation_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 3)
    torch.testing.assert_close(s[:, 0], x[:, :128].abs().amax(-1) / 448)


def test_permits_intersect():
    assert intersect([ALLOW_A8, ALLOW_A4]) == ALLOW_A8
    assert intersect([ALLOW_A8, A16_ONLY]) == A16_ONLY
    assert intersect([]) == ALLOW_A4


@pytest.mark.parametrize("quantize", [quantize_fp8_block, quantize_nvfp4])
def test_an_expert_bank_is_its_experts_stacked(quantize):
    experts = [quantize(torch.randn(256, 128)) for _ in range(3)]
    stack = [torch.stack(p) if p[0] is not None else None
             for p in zip(*[(q.data, q.scale, q.global_scale) for q in experts], strict=True)]
    bank = QuantizedWeight(format=experts[0].format, data=stack[0], scale=stack[1], global_scale=stack[2],
                           block=experts[0].block)
    assert bank.shape == (3, 256, 128) and bank.nbytes == sum(q.nbytes for q in experts)
    assert torch.equal(bank.dequantize(), torch.stack([q.dequantize() for q in experts]))
    assert torch.equal(bank.expert(1).dequantize(), experts[1].dequantize())


def test_blocks_fit_asks_every_piece_but_the_first_to_start_on_a_block():
    from ninfer.contract.quant import blocks_fit

    assert blocks_fit([128, 256, 32], 128) and not blocks_fit([128, 32, 128], 128)
    assert blocks_fit([64], 128)  # one piece: nothing to straddle
    # a bank stacked per expert from [gate; up] pieces of 64 rows in 128-row matrices: each up starts at 64
    assert not blocks_fit([64, 64, 64, 64], 128, 128) and blocks_fit([128, 128, 128, 128], 128, 256)
