"""The quantized-linear kernels (ninfer.ops.triton.linear_quant) on the GPU against ninfer.ops.quant's references
computed in fp32, at Qwen3.5-9B and -0.8B projection shapes: the few-row FP8 and NVFP4 weight-only GEMVs (decode),
the W8A8 FP8 GEMM with its activation quantization and the dequantize-then-cuBLAS path (prefill), dequantize
itself (2-D and banks of experts), a CUDA graph of them replayed, and the PDL builds.

Weights are fresh random draws quantized by the torch quantizers; the reference multiplies the fp32-upcast bf16
input by the fp32 weight the format defines (``linear_quant_ref``, TF32 off), so what is measured is the kernel's
own error. Tolerances (relative Frobenius error, ``Case.within``):

- bf16 output, 5e-3: the output's rounding to bf16 (relative 2^-9 at most per value, ~1-2e-3 as a norm) is
  the error; the dense few-row kernel measured up to 1.7e-3 against the same kind of reference.
- fp32 output of the weight-only kernels, 1e-5: the dot's operands are exact (e4m3 codes, and e2m1 x e4m3
  products, are exact in bf16), the products exact in fp32 and the scales applied in fp32: only the fp32
  accumulation order differs.
- fp32 output of the W8A8 GEMM, 5e-3 (3.0e-3 measured on an H100 at K = 4096): the activation codes and scales
  equal the reference's bitwise (tested),
  but Hopper's fp8 MMA adds each 128-wide K step with reduced (~14-bit) accumulator precision before the
  kernel promotes it to fp32.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

# Weights [N, K]: 9B attention o / GDN out, one MLP half, GDN in_proj (12352 rows: a partial 128-row FP8 scale
# block), down; 0.8B down and GDN in_proj (8224: a partial block again). Each shape is its own split-K choice.
DECODE_SHAPES = ((4096, 4096), (12288, 4096), (12352, 4096), (4096, 12288), (1024, 3584), (8224, 1024))
DECODE_ROWS = (1, 2, 4, 8)
PREFILL_SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288))
PREFILL_ROWS = (64, 512, 4096)


def _weight(case, N: int, K: int, fmt: str):
    from ninfer.ops.quant import quantize_fp8_block, quantize_nvfp4

    w = case.randn(N, K, scale=K ** -0.5, dtype=torch.float32)
    if fmt == "fp8":
        return quantize_fp8_block(w)
    if fmt == "fp8-channel":
        return quantize_fp8_block(w, (1, K))
    return quantize_nvfp4(w, shards=(N // 2, N - N // 2))  # two global scales, as a fused projection has


def _ref(x: torch.Tensor, w) -> torch.Tensor:
    from ninfer.ops.quant import linear_quant_ref

    return linear_quant_ref(x.float(), w, out_dtype=torch.float32)


def _few_rows(fmt: str):
    from ninfer.ops.triton import linear_quant

    return linear_quant.linear_nvfp4 if fmt == "nvfp4" else linear_quant.linear_fp8


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_few_rows(case, fmt, shape):
    """1, 2, 4, 8 rows in bf16 against fp32; a row alone bitwise equal to the row among eight."""
    fn = _few_rows(fmt)
    w = _weight(case, *shape, fmt)
    x = case.randn(max(DECODE_ROWS), shape[1])
    for m in DECODE_ROWS:
        y = fn(x[:m], w)
        assert y.dtype == x.dtype and y.shape == (m, shape[0])
        case.within(y, _ref(x[:m], w), 5e-3, f"{fmt} {shape} M={m}")
    assert torch.equal(fn(x[:1], w), y[:1])


@pytest.mark.parametrize("fmt", ["fp8", "fp8-channel", "nvfp4"])
def test_few_rows_fp32_out_and_row_blocks(case, fmt):
    """fp32 output (the accumulator itself) at 8 rows; 20 and 32 rows (two row blocks) in bf16; per-channel
    FP8 scales (one per row, applied in the epilogue)."""
    fn = _few_rows(fmt)
    w = _weight(case, 4096, 4096, fmt)
    x = case.randn(32, 4096)
    case.within(fn(x[:8], w, out_dtype=torch.float32), _ref(x[:8], w), 1e-5, f"{fmt} fp32 out")
    for m in (20, 32):
        case.within(fn(x[:m], w), _ref(x[:m], w), 5e-3, f"{fmt} M={m}")


def test_quantize_activation_fp8(case):
    """Codes and scales bitwise equal to the torch reference (a 3584-wide row: a partial last group only at
    0.8B's down projection input; 4096 at 9B), with an all-zero group and an outlier."""
    from ninfer.ops.quant import quantize_activation_fp8 as ref
    from ninfer.ops.triton.linear_quant import quantize_activation_fp8

    for K in (4096, 3584, 1000):
        x = case.randn(512, K, scale=3.0)
        x[3, :128] = 0
        x[5, 17] = 3e4
        q, s = quantize_activation_fp8(x)
        q_ref, s_ref = ref(x)
        assert torch.equal(s, s_ref), K
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), K


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_w8a8(case, shape):
    """The W8A8 GEMM (activations quantized per token and 128-group) against the A8 reference in fp32, at 64,
    512 and 4096 rows; bf16 and fp32 output."""
    from ninfer.contract.quant import A8
    from ninfer.ops.triton.linear_quant import linear_fp8_w8a8

    w = _weight(case, *shape, "fp8").with_activation(A8)
    for m in PREFILL_ROWS:
        x = case.randn(m, shape[1])
        ref = _ref(x, w)
        case.within(linear_fp8_w8a8(x, w), ref, 5e-3, f"W8A8 {shape} M={m}")
        if m == 512:
            case.within(linear_fp8_w8a8(x, w, out_dtype=torch.float32), ref, 5e-3, f"W8A8 fp32 {shape}")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_linear_dequant(case, fmt):
    """Weight-only prefill: the Triton dequantize then cuBLAS equals the reference's (bitwise: the same weight,
    the same F.linear) and is within bf16 rounding of fp32."""
    from ninfer.ops.quant import linear_quant_ref
    from ninfer.ops.triton.linear_quant import linear_dequant

    w = _weight(case, 12288, 4096, fmt)
    for m in (64, 512):
        x = case.randn(m, 4096)
        y = linear_dequant(x, w)
        assert torch.equal(y, linear_quant_ref(x, w))
        case.within(y, _ref(x, w), 5e-3, f"dequant {fmt} M={m}")


def test_dequantize(case):
    """Bitwise equal to QuantizedWeight.dequantize: 2-D FP8 (partial scale block), NVFP4, and banks of experts
    at the 35B-A3B expert shape [E, 1024, 2048] (16 experts), in bf16 and fp32."""
    from ninfer.ops.quant import QuantizedWeight
    from ninfer.ops.triton.linear_quant import dequantize

    def bank(fmt):
        parts = [_weight(case, 1024, 2048, fmt) for _ in range(16)]
        g = None if parts[0].global_scale is None else torch.stack([p.global_scale for p in parts])
        return QuantizedWeight(format=parts[0].format, data=torch.stack([p.data for p in parts]),
                               scale=torch.stack([p.scale for p in parts]), global_scale=g, block=parts[0].block)

    for w in (_weight(case, 12352, 4096, "fp8"), _weight(case, 12352, 4096, "nvfp4"), bank("fp8"), bank("nvfp4")):
        for dtype in (torch.bfloat16, torch.float32):
            assert torch.equal(dequantize(w, dtype), w.dequantize(dtype)), (w, dtype)


def test_quantizers_give_the_cpus_bits(case):
    """``ninfer convert --quantize`` quantizes on the GPU when there is one: the planes must be the CPU's, bit for
    bit (FP8 with a partial 128-row block, NVFP4 with two shard global scales, a bf16 source)."""
    from ninfer.ops.quant import quantize_fp8_block, quantize_nvfp4

    w = case.randn(12352, 4096, scale=4096 ** -0.5, dtype=torch.float32).bfloat16()
    for quantize in (quantize_fp8_block, lambda t: quantize_nvfp4(t, shards=(6176, 6176))):
        gpu, cpu = quantize(w), quantize(w.cpu())
        for plane in ("data", "scale", "global_scale"):
            a, b = getattr(gpu, plane), getattr(cpu, plane)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)), plane


def test_cuda_graph_and_pdl(case):
    """The few-row kernels (split-K: the arrival counters), the W8A8 path and dequantize captured in one CUDA
    graph: replays over fresh inputs equal eager bitwise; no host sync; launched with PDL, bitwise the same."""
    from ninfer.contract.quant import A8
    from ninfer.ops import launch
    from ninfer.ops.triton import linear_quant as lq

    w8, w4 = _weight(case, 4096, 4096, "fp8"), _weight(case, 4096, 4096, "nvfp4")
    wa = w8.with_activation(A8)
    x, xp = case.randn(4, 4096), case.randn(64, 4096)

    def step():
        return (lq.linear_fp8(x, w8), lq.linear_nvfp4(x, w4), lq.linear_fp8(x, w8, out_dtype=torch.float32),
                lq.linear_fp8_w8a8(xp, wa), lq.linear_dequant(xp, w4))

    case.no_host_sync(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        x.copy_(case.randn(4, 4096))
        xp.copy_(case.randn(64, 4096))
        graph.replay()
        eager = step()
        for got, want in zip(outs, eager, strict=True):
            assert torch.equal(got, want)
    with launch.scope(True):
        for got, want in zip(step(), eager, strict=True):
            assert torch.equal(got, want)
    assert int(launch.arrival_counters(x.device, 1).abs().sum()) == 0
