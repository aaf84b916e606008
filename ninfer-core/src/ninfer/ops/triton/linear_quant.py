"""y = x @ W.T for a few rows (decode) with W quantized (``ninfer.ops.quant.QuantizedWeight``), weight-only.

Decode reads every weight once per step, so these kernels stream the quantized bytes (half of bf16 for FP8,
about a quarter for NVFP4) and widen each tile in registers; x stays bf16 / fp16 and every product is summed in
fp32. The layout of the work is the dense few-row kernel's (``ninfer.ops.triton.linear``): a program owns
BLOCK_N output columns of BLOCK_M (16, tl.dot's minimum) rows and one of SPLIT_K slices of K; with SPLIT_K > 1
the slices write fp32 partials and the last program to arrive sums them in slice order and stores y (one launch).
More than 16 rows take more row blocks (a third grid axis), each reading W again: correct at any M, fast at few.
The configuration depends on (N, K) and the format only, so a row's result does not depend on its neighbours.

FP8 (``fp8_e4m3_block``, scale a multiplier per b0 x b1 block): e4m3 widens exactly to bf16 / fp16, so the dot
takes the raw codes and the block scale multiplies the dot's [rows, BLOCK_N] result, per K tile when the scale
changes along K (a tile never straddles a K block: BLOCK_K divides b1) or once in the epilogue when one block
spans K (per-channel (1, K)).

NVFP4 (e2m1 pairs, e4m3 scale per 16, fp32 global per row): the low and high nibbles of a byte are the even and
odd elements, so x's tile, loaded once, is split into its even and odd columns and each meets its nibbles in a
dot (the weight is never interleaved). A code becomes its value by bit placement in an fp16 (``e2m1_scaled``),
times the block scale; an e2m1 times an e4m3 is exact in bf16 / fp16, so the dot's operand is the weight
without the global scale, which multiplies the epilogue.

Inputs in fp32 (no tensor-core dot without rounding them) take ``linear_dequant``: the weight dequantized in fp32
and cuBLAS. The many-row paths (W8A8 GEMM, dequantize then cuBLAS) are in ``linear_quant_gemm``, re-exported here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.contract.quant import FP8_BLOCK, NVFP4, NVFP4_GROUP
from ninfer.ops.launch import arrival_counters, pdl_args
from ninfer.ops.quant import QuantizedWeight
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.linear_quant_gemm import (  # noqa: F401  (the many-row paths, one import for dispatch)
    dequantize,
    e2m1_scaled,
    linear_dequant,
    linear_fp8_w8a8,
    quantize_activation_fp8,
    require_weight,
    w8a8_gemm,
)

BLOCK_M = 16
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _fp8_rows_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, arrive_ptr, M, N, K, K_SPLIT, s_xm, s_wn, s_sn, s_sk, s_ym, B0, B1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ROW_SCALE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    mm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = mm < M, nn < N
    x_rows = x_ptr + mm.to(tl.int64)[:, None] * s_xm
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * s_wn
    s_rows = s_ptr + (nn // B0).to(tl.int64) * s_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    pdl_prologue(USE_PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < k_hi
        x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if ROW_SCALE:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        else:  # the tile lies in K block k0 // B1: one scale per column
            s = tl.load(s_rows + (k0 // B1) * s_sk, mask=mask_n, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s[None, :]
    if ROW_SCALE:
        acc *= tl.load(s_rows, mask=mask_n, other=0.0)[None, :]
    _store_rows(acc, y_ptr, part_ptr, arrive_ptr, mm, nn, mask_m, mask_n, N, s_ym, BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit
def _nvfp4_rows_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, part_ptr, arrive_ptr, M, N, KB, KB_SPLIT, GK, GK_SPLIT, s_xm, s_wn, s_sn,
    s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # Walked in bytes (KB = K / 2 per row) and scale groups (GK = K / 16), each with its own bounds: masks over
    # contiguous indices with known alignment keep the loads vectorized.
    HALF: tl.constexpr = BLOCK_K // 2  # bytes of a tile row
    GROUPS: tl.constexpr = BLOCK_K // 16  # e4m3 scales of a tile row, 8 bytes each
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    mm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    jj = tl.arange(0, HALF)
    gg = tl.arange(0, GROUPS)
    mask_m, mask_n = mm < M, nn < N
    x_rows = x_ptr + mm.to(tl.int64)[:, None] * s_xm
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * s_wn
    s_rows = s_ptr + nn.to(tl.int64)[:, None] * s_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_lo = pid_k * KB_SPLIT
    b_hi = tl.minimum(b_lo + KB_SPLIT, KB)
    g_lo = pid_k * GK_SPLIT
    g_hi = tl.minimum(g_lo + GK_SPLIT, GK)
    kk = tl.arange(0, BLOCK_K)
    pdl_prologue(USE_PDL)
    for t in range(0, tl.cdiv(b_hi - b_lo, HALF)):
        jb = b_lo + t * HALF + jj
        mask_b = jb < b_hi
        x = tl.load(x_rows + 2 * (b_lo + t * HALF) + kk[None, :],
                    mask=mask_m[:, None] & (2 * (b_lo + t * HALF) + kk < 2 * b_hi)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HALF, 2)))
        packed = tl.load(w_rows + jb[None, :], mask=mask_n[:, None] & mask_b[None, :], other=0)
        group = g_lo + t * GROUPS + gg
        s = tl.load(s_rows + group[None, :], mask=mask_n[:, None] & (group < g_hi)[None, :], other=0.0)
        s = s.to(tl.float32) * 16384.0
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))  # one per byte
        lo = e2m1_scaled(packed & 15, s).to(x_even.dtype)
        hi = e2m1_scaled(packed >> 4, s).to(x_even.dtype)
        acc = tl.dot(x_even, tl.trans(lo), acc)
        acc = tl.dot(x_odd, tl.trans(hi), acc)
    acc *= tl.load(g_ptr + nn, mask=mask_n, other=0.0)[None, :]
    _store_rows(acc, y_ptr, part_ptr, arrive_ptr, mm, nn, mask_m, mask_n, N, s_ym, BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit
def _store_rows(acc, y_ptr, part_ptr, arrive_ptr, mm, nn, mask_m, mask_n, N, s_ym,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store y = acc, or with SPLIT_K > 1 this slice's partial; the last slice of a tile to arrive sums the
    partials ([SPLIT_K, row blocks x BLOCK_M, N]) in slice order and stores y."""
    out = y_ptr + mm.to(tl.int64)[:, None] * s_ym + nn[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        slice_size = (tl.num_programs(2) * BLOCK_M).to(tl.int64) * N
        part = part_ptr + mm.to(tl.int64)[:, None] * N + nn[None, :]
        tl.store(part + tl.program_id(1) * slice_size, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is published
        counter = arrive_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part + s * slice_size, mask=mask, other=0.0)
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(counter, 0)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def default_config(fmt: str, N: int, K: int, device: tuning.DeviceKey = tuning.CPU
                   ) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, split_k, num_warps, num_stages) for a quantized [N, K] weight: the measured choice of
    ``tables/linear_quant.json`` for this format and shape on this device, else its rule: block_n columns a
    program, K tiles of the format's block_k (FP8: Qwen's 128-wide K blocks; NVFP4: 128 bytes a row), K split in
    two until about ``programs`` programs stream the weight."""
    c = tuning.choices("linear_quant", device)
    measured = c["shapes"].get(f"{fmt}:{N}x{K}")
    if measured is not None:
        return tuple(measured)
    block_n, block_k = c["block_n"], c["block_k_nvfp4" if fmt == NVFP4 else "block_k_fp8"]
    blocks_n = triton.cdiv(N, block_n)
    split = 1
    while blocks_n * split < c["programs"] and K // (split * 2) >= block_k:
        split *= 2
    return block_n, block_k, split, c["num_warps"], c["num_stages"]


def linear_fp8(x: torch.Tensor, weight: QuantizedWeight, *, out_dtype: torch.dtype | None = None,
               block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for an FP8 block-scaled W [N, K], weight-only (x is never quantized, whatever
    ``weight.activation`` says): [..., N] in out_dtype, else x's dtype. Any block (b0, b1) whose b1 is a multiple
    of 16 or at least K. fp32 inputs take ``linear_dequant``."""
    require_weight(x, weight, FP8_BLOCK, "linear_fp8")
    if x.dtype not in _DTYPES:
        return linear_dequant(x, weight, out_dtype=out_dtype)
    N, K = weight.shape
    b0, b1 = weight.block
    bn, bk, split, warps, stages = _knobs(FP8_BLOCK, x, N, K, (block_n, block_k, split_k, num_warps, num_stages))
    row_scale = b1 >= K
    if not row_scale:
        bk = _pow2_divisor(bk, b1)
        if bk < 16:
            raise ValueError(f"linear_fp8: K blocks of {b1} (block {weight.block}) are not a multiple of 16")
    x2, out, y2, M = _rows(x, N, out_dtype)
    if M == 0:
        return out
    k_split, split, part, arrive, grid = _split(x2, M, N, K, bn, bk, split)
    _fp8_rows_kernel[grid](
        x2, weight.data, weight.scale, y2, part, arrive, M, N, K, k_split, x2.stride(0), weight.data.stride(0),
        weight.scale.stride(0), weight.scale.stride(1), y2.stride(0), b0, b1,
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, ROW_SCALE=row_scale, num_warps=warps,
        num_stages=stages, **pdl_args(x2.device))
    return out


def linear_nvfp4(x: torch.Tensor, weight: QuantizedWeight, *, out_dtype: torch.dtype | None = None,
                 block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for an NVFP4 W [N, K], weight-only (Hopper has no FP4 tensor cores): [..., N] in
    out_dtype, else x's dtype. fp32 inputs take ``linear_dequant``."""
    require_weight(x, weight, NVFP4, "linear_nvfp4")
    if x.dtype not in _DTYPES:
        return linear_dequant(x, weight, out_dtype=out_dtype)
    N, K = weight.shape
    bn, bk, split, warps, stages = _knobs(NVFP4, x, N, K, (block_n, block_k, split_k, num_warps, num_stages))
    if bk < 2 * NVFP4_GROUP or bk & (bk - 1):
        raise ValueError(f"linear_nvfp4: block_k must be a power of two of at least 32, got {bk}")
    if weight.scale.stride(1) != 1:
        raise ValueError("linear_nvfp4: the block scales of a row must be contiguous")
    x2, out, y2, M = _rows(x, N, out_dtype)
    if M == 0:
        return out
    k_split, split, part, arrive, grid = _split(x2, M, N, K, bn, bk, split)
    _nvfp4_rows_kernel[grid](
        x2, weight.data, weight.scale, weight.global_scale, y2, part, arrive, M, N, K // 2, k_split // 2,
        K // NVFP4_GROUP, k_split // NVFP4_GROUP, x2.stride(0),
        weight.data.stride(0), weight.scale.stride(0), y2.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages,
        **pdl_args(x2.device))
    return out


def _knobs(fmt: str, x: torch.Tensor, N: int, K: int, given: tuple) -> tuple[int, ...]:
    defaults = default_config(fmt, N, K, tuning.device_key(x))
    return tuple(v if v is not None else d for v, d in zip(given, defaults, strict=True))


def _pow2_divisor(bk: int, b1: int) -> int:
    """The largest power of two at most ``bk`` that divides ``b1`` (a K tile inside one scale block)."""
    while bk > 1 and b1 % bk:
        bk //= 2
    return bk


def _rows(x: torch.Tensor, N: int, out_dtype: torch.dtype | None) -> tuple:
    """(x as [M, K] with unit inner stride, the output [..., N], its [M, N] view, M)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], N), dtype=out_dtype or x.dtype, device=x.device)
    return x2, out, out.view(-1, N), x2.shape[0]


def _split(x2: torch.Tensor, M: int, N: int, K: int, bn: int, bk: int, split: int) -> tuple:
    """(K per slice in whole tiles, slices, partials, arrival counters, grid) of a few-row launch."""
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_split)
    blocks_n, blocks_m = triton.cdiv(N, bn), triton.cdiv(M, BLOCK_M)
    if split > 1:
        part = torch.empty((split, blocks_m * BLOCK_M, N), dtype=torch.float32, device=x2.device)
        arrive = arrival_counters(x2.device, blocks_n * blocks_m)
    else:
        part = arrive = x2  # unused
    return k_split, split, part, arrive, (blocks_n, split, blocks_m)
