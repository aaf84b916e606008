"""Routed MoE experts over FP8 or NVFP4 banks on the GPU, weight-only (the codes become the activations' dtype in
registers): the grouped kernels of ``moe`` with the banks' scales.

The grouping (``align_by_expert``), the per-pair caches and the slot sum are ``moe``'s. FP8: each K tile of a
program lies inside one K block of the scales (``BLOCK_K`` divides the block's K extent, or one block spans K), so
a dot's [BLOCK_M, BLOCK_N] result takes one scale per column, the scale of the block its weight row sits in; the
e4m3 codes widen exactly. NVFP4: a tile is walked in bytes as the few-row NVFP4 kernel walks it (low and high
nibbles are the even and odd elements: two dots on x's even and odd columns), each code times its per-16 e4m3
scale exactly representable in bf16 / fp16 (``e2m1_scaled``), the per-row global scale in the epilogue. The
products are exact either way; the reference (``moe_experts_ref``: each expert's linear over the weight
dequantized to the activations' dtype) differs only in where the scales are rounded in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.contract.quant import FP8_BLOCK, NVFP4, NVFP4_GROUP
from ninfer.ops.launch import pdl_args
from ninfer.ops.quant import QuantizedWeight
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.linear_quant_gemm import e2m1_scaled
from ninfer.ops.triton.moe_align import align_by_expert
from ninfer.ops.triton.moe_shared import default_config, precision, store_weighted, sum_slots, tile

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _scaled_dot(a, w_rows, s_rows, k0, kk, mask_n, K, s_sk, B1, PRECISION: tl.constexpr):
    """dot(a, W[rows, k0:k0 + BLOCK_K]^T) times each row's scale of K block k0 // B1 (fp32 [BLOCK_M, BLOCK_N])."""
    mask_k = kk < K - k0
    w = tl.load(w_rows + (k0 + kk)[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    s = tl.load(s_rows + (k0 // B1) * s_sk, mask=mask_n, other=0.0)
    return tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=PRECISION) * s[None, :]


@triton.jit
def _nvfp4_dot(a, w_rows, s_rows, k0, mask_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """dot(a, W[rows, k0:k0 + BLOCK_K]^T) of NVFP4 rows (packed bytes at ``w_rows`` [BLOCK_N, 1], per-16 e4m3
    scales from ``s_rows`` [BLOCK_N]), without the rows' global scales (fp32 [BLOCK_M, BLOCK_N])."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    jj = k0 // 2 + tl.arange(0, HALF)
    gg = k0 // 16 + tl.arange(0, GROUPS)
    a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, HALF, 2)))
    packed = tl.load(w_rows + jj[None, :], mask=mask_n[:, None] & (jj < K // 2)[None, :], other=0)
    s = tl.load(s_rows[:, None] + gg[None, :], mask=mask_n[:, None] & (gg < K // 16)[None, :], other=0.0)
    s = tl.reshape(tl.broadcast_to((s.to(tl.float32) * 16384.0)[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))
    lo = e2m1_scaled(packed & 15, s).to(a.dtype)
    hi = e2m1_scaled(packed >> 4, s).to(a.dtype)
    acc = tl.dot(a_even, tl.trans(lo), input_precision=PRECISION)
    return tl.dot(a_odd, tl.trans(hi), acc, input_precision=PRECISION)


@triton.jit
def _quant_dot(a, w_rows, s_rows, k0, kk, mask_n, K, s_sk, B1, FP4: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    if FP4:
        return _nvfp4_dot(a, w_rows, s_rows, k0, mask_n, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    return _scaled_dot(a, w_rows, s_rows, k0, kk, mask_n, K, s_sk, B1, PRECISION)


@triton.jit
def _block_pairs(pairs_ptr, experts_ptr, pid_m, numel, BLOCK_M: tl.constexpr):
    """(the pairs of block ``pid_m`` of the grouping, which of them are real, their expert)."""
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pair, pair < numel, tl.load(experts_ptr + pid_m).to(tl.int64)


@triton.jit
def _quant_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, h_ptr, pairs_ptr, experts_ptr, used_ptr, numel, INTER, H,
    s_xm, s_we, s_wn, s_se, s_sn, s_sk, s_ge, s_hm, B0, B1,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, FP4: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_prologue(USE_PDL)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    pair, valid, expert = _block_pairs(pairs_ptr, experts_ptr, pid_m, numel, BLOCK_M)
    token = (pair // TOP_K).to(tl.int64)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = nn < INTER
    kk = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert * s_we + nn.to(tl.int64)[:, None] * s_wn
    up_rows = gate_rows + INTER * s_wn
    gate_scales = s_ptr + expert * s_se + (nn // B0).to(tl.int64) * s_sn
    up_scales = s_ptr + expert * s_se + ((nn + INTER) // B0).to(tl.int64) * s_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(x_ptr + token[:, None] * s_xm + (k0 + kk)[None, :],
                    mask=valid[:, None] & (kk < H - k0)[None, :], other=0.0)
        acc_gate += _quant_dot(a, gate_rows, gate_scales, k0, kk, mask_n, H, s_sk, B1, FP4, BLOCK_M, BLOCK_N,
                               BLOCK_K, PRECISION)
        acc_up += _quant_dot(a, up_rows, up_scales, k0, kk, mask_n, H, s_sk, B1, FP4, BLOCK_M, BLOCK_N, BLOCK_K,
                             PRECISION)
    if FP4:  # each weight row's global scale
        g_rows = g_ptr + expert * s_ge + nn
        acc_gate *= tl.load(g_rows, mask=mask_n, other=0.0)[None, :]
        acc_up *= tl.load(g_rows + INTER, mask=mask_n, other=0.0)[None, :]
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)  # rounded as the unfused ops round: both projections, silu, product
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    hidden = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(h_ptr + pair.to(tl.int64)[:, None] * s_hm + nn[None, :], hidden, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _quant_down_kernel(
    h_ptr, w_ptr, s_ptr, g_ptr, y_ptr, pairs_ptr, experts_ptr, used_ptr, route_ptr, numel, H, INTER,
    s_hm, s_we, s_wn, s_se, s_sn, s_sk, s_ge, s_ym, B0, B1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    FP4: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_prologue(USE_PDL)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    pair, valid, expert = _block_pairs(pairs_ptr, experts_ptr, pid_m, numel, BLOCK_M)
    row = pair.to(tl.int64)
    route = tl.load(route_ptr + row, mask=valid, other=0.0).to(tl.float32)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = nn < H
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert * s_we + nn.to(tl.int64)[:, None] * s_wn
    scales = s_ptr + expert * s_se + (nn // B0).to(tl.int64) * s_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        a = tl.load(h_ptr + row[:, None] * s_hm + (k0 + kk)[None, :],
                    mask=valid[:, None] & (kk < INTER - k0)[None, :], other=0.0)
        acc += _quant_dot(a, w_rows, scales, k0, kk, mask_n, INTER, s_sk, B1, FP4, BLOCK_M, BLOCK_N, BLOCK_K,
                          PRECISION)
    if FP4:
        acc *= tl.load(g_ptr + expert * s_ge + nn, mask=mask_n, other=0.0)[None, :]
    store_weighted(y_ptr + row[:, None] * s_ym, acc, route, valid, pid_n, H, BLOCK_N)


def _block_k(bank: QuantizedWeight, width: int, want: int) -> int | None:
    """A K tile for ``bank`` (K = ``width``), at most ``want``: FP8, one that lies inside one scale block; NVFP4,
    whole scale groups. None if none fits."""
    if bank.format == NVFP4:
        return max(2 * NVFP4_GROUP, min(want, triton.next_power_of_2(width)))
    b1 = bank.block[1]
    if b1 >= width:
        return tile(want, width)
    k = tile(min(want, b1), width)
    return k if b1 % k == 0 else None


def fits(x: torch.Tensor, gate_up, down) -> bool:
    """Whether these kernels take the call: banks of one format (FP8 or NVFP4), activations in bf16 / fp16 /
    fp32, K tiles that fit the scale blocks."""
    if not (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)) or x.dtype not in _DTYPES:
        return False
    if gate_up.format != down.format or gate_up.format not in (FP8_BLOCK, NVFP4):
        return False
    cfg = default_config(max(1, x.shape[0]), x.dtype, tuning.device_key(x))
    return _block_k(gate_up, x.shape[1], cfg.block_k) is not None and \
        _block_k(down, down.shape[2], cfg.block_k) is not None


def moe_experts_quant(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight, ids: torch.Tensor,
                      weights: torch.Tensor, *, shared: torch.Tensor | None = None,
                      shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """``ninfer.ops.moe.moe_experts`` (which checks the shapes) for quantized banks ``gate_up`` [E, 2I, H] and
    ``down`` [E, H, I] of one format: grouped by expert, the gate_up and down kernels, then ``moe``'s slot sum
    (with the shared expert's sigmoid(gate) * shared when given)."""
    if not fits(x, gate_up, down):
        raise ValueError(f"moe_experts_quant: banks {gate_up.format} {gate_up.shape} block {gate_up.block} and "
                         f"{down.format} {down.shape} block {down.block} with x {x.dtype} do not fit its tiles")
    N, H = x.shape
    E, two_i, _ = gate_up.shape
    inter, top_k = two_i // 2, ids.shape[1]
    out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    cfg = default_config(N, x.dtype, tuning.device_key(x))
    blocks = align_by_expert(ids, E, cfg.block_m)
    hidden = torch.empty((blocks.numel, inter), dtype=x.dtype, device=x.device)
    per_pair = torch.empty((blocks.numel, H), dtype=x.dtype, device=x.device)
    xs = x if x.stride(1) == 1 else x.contiguous()
    fp4 = gate_up.format == NVFP4
    common = dict(PRECISION=precision(x.dtype), FP4=fp4, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **pdl_args(x.device))
    block_n = tile(cfg.block_n // 2, inter)
    _quant_gate_up_kernel[(blocks.max_blocks, triton.cdiv(inter, block_n))](
        xs, *_planes(gate_up), hidden, blocks.sorted_pairs, blocks.block_experts, blocks.used, blocks.numel, inter,
        H, xs.stride(0), *_strides(gate_up), hidden.stride(0), *_blocks(gate_up), TOP_K=top_k, BLOCK_M=cfg.block_m,
        BLOCK_N=block_n, BLOCK_K=_block_k(gate_up, H, cfg.block_k), **common)
    block_n = tile(cfg.block_n, H)
    _quant_down_kernel[(blocks.max_blocks, triton.cdiv(H, block_n))](
        hidden, *_planes(down), per_pair, blocks.sorted_pairs, blocks.block_experts, blocks.used,
        weights.reshape(-1).contiguous(), blocks.numel, H, inter, hidden.stride(0), *_strides(down),
        per_pair.stride(0), *_blocks(down), BLOCK_M=cfg.block_m, BLOCK_N=block_n,
        BLOCK_K=_block_k(down, inter, cfg.block_k), **common)
    sum_slots(per_pair, out, top_k, shared, shared_gate)
    return out


def _planes(bank: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, global scales: the scales again where the format has none: never read)."""
    return bank.data, bank.scale, bank.global_scale if bank.global_scale is not None else bank.scale


def _strides(bank: QuantizedWeight) -> tuple[int, ...]:
    """s_we, s_wn (codes: expert, row), s_se, s_sn, s_sk (scales: expert, row or row block, K block), s_ge."""
    g = bank.global_scale
    return (bank.data.stride(0), bank.data.stride(1), *bank.scale.stride(), g.stride(0) if g is not None else 0)


def _blocks(bank: QuantizedWeight) -> tuple[int, int]:
    """(B0, B1): the rows and K columns one scale covers (NVFP4: one row, 16 columns)."""
    return bank.block
