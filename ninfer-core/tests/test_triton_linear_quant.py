"""The quantized-linear kernels (ninfer.ops.triton.linear_quant) against the torch references of ninfer.ops.quant,
on the CPU through Triton's interpreter (float8 loads, stores, conversions and fp8 dots work there).

Tiny shapes with ragged edges (a partial scale block in N and K, a partial tile, split-K with a short last
slice, two row blocks); fp16 inputs (the interpreter has no bf16 arithmetic). Real shapes, bf16 and the CUDA
graph are the GPU tests' job (ninfer-core/tests/gpu/test_linear_quant.py).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from ninfer.contract.quant import A8  # noqa: E402
from ninfer.ops.quant import (  # noqa: E402
    QuantizedWeight,
    linear_quant_ref,
    quantize_activation_fp8,
    quantize_fp8_block,
    quantize_nvfp4,
)
from ninfer.ops.triton import linear_quant as lq  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _randn(*shape, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def _rel(out, ref) -> float:
    assert torch.isfinite(out).all()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _ref32(x, w):
    """The weight-only product in fp32: fp16 x upcast, the weight's definition in fp32."""
    return linear_quant_ref(x.float(), w, out_dtype=torch.float32)


@pytest.mark.parametrize("block,N,K", [((128, 128), 200, 384), ((128, 128), 136, 272), ((1, 320), 40, 320),
                                       ((32, 64), 72, 192)])
def test_linear_fp8_rows(block, N, K):
    """FP8 weight-only few-row product: per-K-tile scales (square blocks, a partial block in N and K), one
    scale per row applied in the epilogue (per-channel), split-K, 20 rows = two row blocks; fp32 output is the
    accumulator; a row alone equals the row in a batch."""
    from ninfer.ops.launch import arrival_counters

    w = quantize_fp8_block(_randn(N, K, seed=1, scale=K ** -0.5), block)
    x = _randn(20, K, seed=2, dtype=torch.float16)
    ref = _ref32(x, w)
    for split in (1, 3):
        y = lq.linear_fp8(x, w, block_n=64, block_k=64, split_k=split)
        assert y.dtype == torch.float16 and y.shape == (20, N)
        assert _rel(y, ref) < 2e-3  # fp16 rounding of the output
        y32 = lq.linear_fp8(x, w, out_dtype=torch.float32, block_n=64, block_k=64, split_k=split)
        assert y32.dtype == torch.float32 and _rel(y32, ref) < 1e-5
        assert torch.equal(lq.linear_fp8(x[5:6], w, block_n=64, block_k=64, split_k=split), y[5:6])
    assert int(arrival_counters(x.device, 8).abs().sum()) == 0
    x3 = _randn(2, 3, K, seed=3, dtype=torch.float16)  # leading dims are rows
    assert _rel(lq.linear_fp8(x3, w, block_n=16, block_k=32), _ref32(x3, w)) < 2e-3


@pytest.mark.parametrize("N,K", [(48, 256), (40, 96)])
def test_linear_nvfp4_rows(N, K):
    """NVFP4 weight-only few-row product with per-row global scales (two shards of different range), K tiles of
    64 (two scale groups) and 32, split-K, two row blocks."""
    w = quantize_nvfp4(torch.cat([_randn(N // 2, K, seed=4), _randn(N // 2, K, seed=5, scale=7.0)]),
                       shards=(N // 2, N // 2))
    x = _randn(20, K, seed=6, dtype=torch.float16)
    ref = _ref32(x, w)
    for bk, split in ((64, 1), (32, 2), (64, 3)):
        y = lq.linear_nvfp4(x, w, block_n=32, block_k=bk, split_k=split)
        assert y.shape == (20, N) and _rel(y, ref) < 2e-3
        assert _rel(lq.linear_nvfp4(x, w, out_dtype=torch.float32, block_n=32, block_k=bk, split_k=split), ref) < 1e-5
        assert torch.equal(lq.linear_nvfp4(x[:1], w, block_n=32, block_k=bk, split_k=split), y[:1])


def test_few_rows_fp32_inputs_take_dequant():
    w = quantize_fp8_block(_randn(64, 128, seed=7))
    x = _randn(3, 128, seed=8)
    assert torch.equal(lq.linear_fp8(x, w), linear_quant_ref(x, w))
    w4 = quantize_nvfp4(_randn(64, 128, seed=9))
    assert torch.equal(lq.linear_nvfp4(x, w4), linear_quant_ref(x, w4))


@pytest.mark.parametrize("K", [300, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_activation_fp8(K, dtype):
    """Scales equal to the reference's bitwise (a partial group, an all-zero group, a large value); codes too on
    CUDA. The interpreter's own fp32 -> e4m3 cast (Triton 3.6) is not round-to-nearest-even: it rounds exact
    ties up and drops the carry when rounding up onto the next power of two (124.9 -> 64, not 128). Under it,
    every code that differs must be one of those two slips of the cast, given the reference's x / scale."""
    x = _randn(16, K, seed=10, scale=3.0, dtype=dtype)
    x[1, 128:256] = 0
    x[2, 7] = 1000.0
    q, s = lq.quantize_activation_fp8(x)
    q_ref, s_ref = quantize_activation_fp8(x)
    assert torch.equal(s, s_ref)
    if DEV == "cuda":
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        return
    got, want = q.float(), q_ref.float()
    v = x.float() / s_ref.repeat_interleave(128, 1)[:, :K]
    tie = (v - got).abs() == (v - want).abs()
    carry = (got.abs() * 2 == want.abs()) & (torch.log2(want.abs()).frac() == 0)
    slips = got != want
    assert slips.float().mean() < 0.05 and not (slips & ~tie & ~carry).any()


@pytest.mark.parametrize("block,N,K", [((128, 128), 200, 384), ((128, 128), 72, 300), ((1, 256), 96, 256)])
def test_w8a8_gemm(block, N, K):
    """The W8A8 GEMM on the reference's quantized activations against the A8 reference (both in fp32): 5 rows
    (one row block) and 70 (two, the second partial); fp32 output to fp32 rounding, fp16 output to its own;
    linear_fp8_w8a8 is the quantization kernel then the GEMM."""
    w = quantize_fp8_block(_randn(N, K, seed=11, scale=K ** -0.5), block).with_activation(A8)
    for M in (5, 70):
        x = _randn(M, K, seed=12, dtype=torch.float16)
        ref = linear_quant_ref(x, w, out_dtype=torch.float32)
        q, s = quantize_activation_fp8(x)
        assert _rel(lq.w8a8_gemm(q, s, w, out_dtype=torch.float32), ref) < 1e-5
        y = lq.w8a8_gemm(q, s, w, out_dtype=torch.float16, block_m=64, block_n=64)
        assert y.dtype == torch.float16 and _rel(y, ref) < 2e-3
        assert torch.equal(lq.linear_fp8_w8a8(x, w), lq.w8a8_gemm(*lq.quantize_activation_fp8(x), w,
                                                                 out_dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dequantize(dtype):
    """Equal to QuantizedWeight.dequantize bitwise: FP8 square blocks with partial edges, per-channel, a bank of
    experts; NVFP4 2-D and a bank."""
    cases = [quantize_fp8_block(_randn(200, 300, seed=13)), quantize_fp8_block(_randn(40, 96, seed=14), (1, 96)),
             quantize_nvfp4(_randn(40, 96, seed=15, scale=5.0), shards=(24, 16))]
    cases.append(_bank([quantize_fp8_block(_randn(130, 160, seed=16 + e)) for e in range(3)]))
    cases.append(_bank([quantize_nvfp4(_randn(24, 64, seed=20 + e, scale=e + 1.0)) for e in range(2)]))
    for w in cases:
        got = lq.dequantize(w, dtype)
        assert got.dtype == dtype and torch.equal(got, w.dequantize(dtype)), w


def test_linear_dequant():
    w = quantize_nvfp4(_randn(48, 160, seed=22))
    x = _randn(7, 160, seed=23)
    assert torch.equal(lq.linear_dequant(x, w), linear_quant_ref(x, w))
    w8 = quantize_fp8_block(_randn(48, 160, seed=24))
    assert torch.equal(lq.linear_dequant(x, w8, out_dtype=torch.float16), linear_quant_ref(x, w8).half())


def test_unsupported_weights_raise():
    w8 = quantize_fp8_block(_randn(64, 256, seed=25))
    w4 = quantize_nvfp4(_randn(64, 256, seed=26))
    x = _randn(2, 256, seed=27, dtype=torch.float16)
    with pytest.raises(ValueError, match="takes fp8_e4m3_block"):
        lq.linear_fp8(x, w4)
    with pytest.raises(ValueError, match="takes nvfp4"):
        lq.linear_nvfp4(x, w8)
    with pytest.raises(ValueError, match="does not match"):
        lq.linear_fp8(x[:, :128], w8)
    with pytest.raises(TypeError):
        lq.linear_fp8(x, torch.zeros(64, 256))
    odd = quantize_fp8_block(_randn(64, 256, seed=28), (128, 24))  # K blocks of 24: no tile fits them
    with pytest.raises(ValueError, match="not a multiple of 16"):
        lq.linear_fp8(x, odd)
    with pytest.raises(ValueError, match="activation groups"):
        lq.linear_fp8_w8a8(x, quantize_fp8_block(_randn(64, 256, seed=29), (128, 64)))
    with pytest.raises(ValueError, match="2-D"):
        lq.linear_fp8(x, _bank([w8]))


def _bank(experts: list[QuantizedWeight]) -> QuantizedWeight:
    """Experts stacked into a bank [E, N, K]."""
    first = experts[0]
    g = None if first.global_scale is None else torch.stack([w.global_scale for w in experts])
    return QuantizedWeight(format=first.format, data=torch.stack([w.data for w in experts]),
                           scale=torch.stack([w.scale for w in experts]), global_scale=g, block=first.block)
