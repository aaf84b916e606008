"""y = x @ W.T for a few rows (decode), reading W once at full bandwidth.

Each program owns a block of BLOCK_N output columns for every row (rows padded to 16 for the tensor
cores) and one of SPLIT_K slices of K. With SPLIT_K > 1 the programs of a column block write fp32
partial sums to a workspace and the last to arrive adds them up in slice order and stores y, so one
launch does the whole product (no separate reduction kernel). The configuration depends on (N, K)
only, never on the number of rows: a row's result is then bitwise the same whatever its batch
neighbours are. More than MAX_ROWS rows (prefill) and fp32 go to cuBLAS.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.ops.triton._arrivals import arrival_counters

MAX_ROWS = 16
_DTYPES = (torch.bfloat16, torch.float16)  # fp32 stays on cuBLAS (tl.dot would round its inputs to tf32)
_SMS_TARGET = 4 * 132  # programs worth launching: a few per SM of an H100/H200 keep enough loads in flight


@triton.jit
def _linear_rows_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, arrive_ptr, M, N, K, K_SPLIT, s_xm, s_wn, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    mm = tl.arange(0, BLOCK_M)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = mm < M, nn < N
    x_rows = x_ptr + mm.to(tl.int64)[:, None] * s_xm
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < k_hi
        x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    out = y_ptr + mm.to(tl.int64)[:, None] * s_ym + nn[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials [SPLIT_K, BLOCK_M, N]; the last program of this column block sums them in slice order.
        part = part_ptr + mm[:, None] * N + nn[None, :]
        tl.store(part + pid_k * BLOCK_M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is published
        counter = arrive_ptr + pid_n
        last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * BLOCK_M * N, mask=mask, other=0.0)
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(counter, 0)


@functools.cache
def default_config(N: int, K: int) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, split_k, num_warps, num_stages) for an [N, K] weight: enough programs to keep
    the memory system busy, each streaming BLOCK_N rows of W in BLOCK_K-wide tiles. A starting point that
    scripts/gpu-check sweeps; the measured best per shape replaces it."""
    block_n, block_k = 32, 256
    blocks_n = triton.cdiv(N, block_n)
    split = 1
    while blocks_n * split < _SMS_TARGET and K // (split * 2) >= 4 * block_k:
        split *= 2
    return block_n, block_k, split, 4, 3


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None, block_n: int | None = None,
           block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N]; more than MAX_ROWS rows (or a strided weight) use cuBLAS."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_ROWS or weight.stride(1) != 1 or x.dtype != weight.dtype or x.dtype not in _DTYPES:
        y = F.linear(x, weight)
        if out is not None:
            out.copy_(y.view(out.shape))
            return out
        return y
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    y2 = out.view(-1, N)
    if M == 0:
        return out
    cfg = default_config(N, K)
    bn, bk, split, warps, stages = (v if v is not None else d for v, d in
                                    zip((block_n, block_k, split_k, num_warps, num_stages), cfg, strict=True))
    blocks_n = triton.cdiv(N, bn)
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk  # whole BLOCK_K tiles per slice
    split = triton.cdiv(K, k_split)
    part = torch.empty((split, MAX_ROWS, N), dtype=torch.float32, device=x.device) if split > 1 else y2
    arrive = arrival_counters(x.device, blocks_n) if split > 1 else y2
    _linear_rows_kernel[(blocks_n, split)](
        x2, weight, y2, part, arrive, M, N, K, k_split, x2.stride(0), weight.stride(0), y2.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)
    return out
