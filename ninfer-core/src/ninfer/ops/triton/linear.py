"""y = x @ W.T for a few rows (decode), reading W once at full bandwidth.

Each program owns a block of BLOCK_N output columns for every row (rows padded to 16 for the tensor
cores) and one of SPLIT_K slices of K. With SPLIT_K > 1 the programs of a column block write fp32
partial sums to a workspace and the last to arrive adds them up in slice order and stores y, so one
launch does the whole product (no separate reduction kernel). y is stored in its own dtype: an fp32 y
from bf16/fp16 inputs receives the unrounded fp32 accumulator. The configuration depends on (N, K)
only, never on the number of rows: a row's result is then bitwise the same whatever its batch
neighbours are. More than MAX_ROWS rows (prefill) and fp32 go to cuBLAS.

SWIGLU: the MLP's gate_up projection with silu_and_mul as its epilogue. A program reads the gate rows
and the matching up rows of W ([gate; up] stacked, 2N rows) and stores silu(x Wg^T) * (x Wu^T), rounded
where the unfused ops round, so no [rows, 2N] intermediate is written and read back and one launch goes.
(Elementwise work on x inside the K loop, a prologue, stalls the dot's operand pipeline; an epilogue runs
once per tile. docs/kernels.md has the measurement.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.ops.launch import arrival_counters, pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue

MAX_ROWS = 16
_DTYPES = (torch.bfloat16, torch.float16)  # fp32 stays on cuBLAS (tl.dot would round its inputs to tf32)


@triton.jit
def _linear_rows_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, arrive_ptr, M, N, K, K_SPLIT, s_xm, s_wn, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr, USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    # N output columns; with SWIGLU, W holds 2N rows [gate; up] and column n pairs rows n and N + n.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    mm = tl.arange(0, BLOCK_M)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = mm < M, nn < N
    x_rows = x_ptr + mm.to(tl.int64)[:, None] * s_xm
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if USE_PDL:
        # W never depends on the previous kernel: pull this program's first PREFETCH tiles towards L2 while that
        # kernel finishes; the prologue then waits for it before x, y, the partials or the shared counters.
        rows_in = w_ptr + tl.minimum(nn, N - 1).to(tl.int64)[:, None] * s_wn
        for t in tl.static_range(PREFETCH):
            lines = tl.minimum(k_lo + t * BLOCK_K + tl.arange(0, BLOCK_K // 64) * 64, K - 1)  # one per 128 B
            _prefetch_l2(rows_in + lines[None, :])
            if SWIGLU:
                _prefetch_l2(rows_in + N * s_wn + lines[None, :])
    pdl_prologue(USE_PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < k_hi
        mask_w = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=mask_w, other=0.0)
        acc += tl.dot(x, tl.trans(w))
        if SWIGLU:
            w_up = tl.load(w_rows + N * s_wn + kk[None, :], mask=mask_w, other=0.0)
            acc_up += tl.dot(x, tl.trans(w_up))
    out = y_ptr + mm.to(tl.int64)[:, None] * s_ym + nn[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        # Partials [SPLIT_K, BLOCK_M, PW] (PW = 2N with SWIGLU: gate then up); the last program of this column
        # block sums them in slice order.
        PW = 2 * N if SWIGLU else N
        part = part_ptr + mm[:, None] * PW + nn[None, :]
        tl.store(part + pid_k * BLOCK_M * PW, acc, mask=mask)
        if SWIGLU:
            tl.store(part + pid_k * BLOCK_M * PW + N, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is published
        counter = arrive_ptr + pid_n
        last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part + s * BLOCK_M * PW, mask=mask, other=0.0)
                if SWIGLU:
                    acc_up += tl.load(part + s * BLOCK_M * PW + N, mask=mask, other=0.0)
            tl.store(out, _finish(acc, acc_up, y_ptr.dtype.element_ty, SWIGLU), mask=mask)
            tl.store(counter, 0)
    else:
        tl.store(out, _finish(acc, acc_up, y_ptr.dtype.element_ty, SWIGLU), mask=mask)


@triton.jit
def _prefetch_l2(ptrs):
    """A hint to fetch the 128-byte lines at ``ptrs`` into L2 (callers keep the addresses in bounds)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _finish(acc, acc_up, dtype: tl.constexpr, SWIGLU: tl.constexpr):
    if SWIGLU:  # round as linear then silu_and_mul do: the projections, silu(gate), the product
        g = acc.to(dtype).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        return (s * acc_up.to(dtype).to(tl.float32)).to(dtype)
    return acc.to(dtype)


def default_config(N: int, K: int, device: tuning.DeviceKey = tuning.CPU) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, split_k, num_warps, num_stages) for an [N, K] weight on ``device``: the measured best
    for a shape in its tuning table (``tables/linear.json``); otherwise ``block_n``-wide column blocks with K
    split in two until about ``programs`` programs stream W (the rule the sweep favoured: ``block_k``-wide K
    tiles when unsplit, ``split_block_k``-wide when split)."""
    c = tuning.choices("linear", device)
    measured = c["shapes"].get(f"{N}x{K}")
    if measured is not None:
        return (*measured, c["num_warps"], c["num_stages"])
    block_n = c["block_n"]
    blocks_n = triton.cdiv(N, block_n)
    split = 1
    while blocks_n * split < c["programs"] and K // (split * 2) >= c["block_k"]:
        split *= 2
    return block_n, c["block_k"] if split == 1 else c["split_block_k"], split, c["num_warps"], c["num_stages"]


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, block_n: int | None = None, block_k: int | None = None,
           split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N]; more than MAX_ROWS rows (or a strided weight) use cuBLAS.

    The result has out's dtype, else out_dtype, else x's. An fp32 result from bf16/fp16 inputs is the kernel's
    fp32 accumulator itself (not rounded to the input dtype; the lm_head's fp32 logits without a cast kernel);
    cuBLAS rounds to the input dtype, then casts."""
    if _unfused(x, weight):
        y = F.linear(x, weight)
        if out is None:
            return y if out_dtype is None else y.to(out_dtype)
        out.copy_(y.view(out.shape))
        return out
    if out is None and out_dtype is not None:
        out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype, device=x.device)
    return _launch(x, weight, out, (block_n, block_k, split_k, num_warps, num_stages), swiglu=False)


def swiglu(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None, block_n: int | None = None,
           block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None) -> torch.Tensor:
    """silu_and_mul(x @ weight.T) for weight [2N, K] = [gate; up]: [..., N]. block_n counts the columns of
    one half (the default halves the (2N, K) configuration, so a program reads as many weight rows)."""
    if weight.shape[0] % 2:
        raise ValueError(f"swiglu: weight {tuple(weight.shape)} is not [gate; up] (odd row count)")
    if _unfused(x, weight):
        from ninfer.ops.activation import silu_and_mul
        return silu_and_mul(linear(x, weight)) if out is None else out.copy_(silu_and_mul(linear(x, weight)))
    if block_n is None:
        block_n = max(16, default_config(*weight.shape, tuning.device_key(x))[0] // 2)
    return _launch(x, weight, out, (block_n, block_k, split_k, num_warps, num_stages), swiglu=True)


def _with_prefetch(pdl: dict, tiles: int, device: tuning.DeviceKey) -> dict:
    """Under PDL: the weight tiles a program hints into L2 before waiting for the previous kernel."""
    if not pdl.get("USE_PDL"):
        return pdl
    return {**pdl, "PREFETCH": min(tuning.choices("linear", device)["prefetch_tiles"], tiles)}


def _unfused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs for cuBLAS and the unfused ops: prefill-sized, a strided weight, fp32 or mixed dtypes."""
    rows = x.numel() // max(x.shape[-1], 1)
    return rows > MAX_ROWS or weight.stride(1) != 1 or x.dtype != weight.dtype or x.dtype not in _DTYPES


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, knobs: tuple, *, swiglu: bool
            ) -> torch.Tensor:
    rows_n, K = weight.shape
    N = rows_n // 2 if swiglu else rows_n
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if out is None:
        out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    y2 = out.view(-1, N)
    if M == 0:
        return out
    device = tuning.device_key(x2)
    bn, bk, split, warps, stages = (v if v is not None else d
                                    for v, d in zip(knobs, default_config(rows_n, K, device), strict=True))
    blocks_n = triton.cdiv(N, bn)
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk  # whole BLOCK_K tiles per slice
    split = triton.cdiv(K, k_split)
    part = torch.empty((split, MAX_ROWS, rows_n), dtype=torch.float32, device=x.device) if split > 1 else y2
    arrive = arrival_counters(x.device, blocks_n) if split > 1 else y2
    _linear_rows_kernel[(blocks_n, split)](
        x2, weight, y2, part, arrive, M, N, K, k_split, x2.stride(0), weight.stride(0), y2.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SWIGLU=swiglu, num_warps=warps, num_stages=stages,
        **_with_prefetch(pdl_args(x2.device), k_split // bk, device))
    return out
