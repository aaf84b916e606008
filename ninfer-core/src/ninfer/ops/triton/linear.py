"""y = x @ W.T for a few rows (decode), reading W once at full bandwidth.

Each program owns a block of BLOCK_N output columns for every row (rows padded to 16 for the tensor
cores) and one of SPLIT_K slices of K. With SPLIT_K > 1 the programs of a column block write fp32
partial sums to a workspace and the last to arrive adds them up in slice order and stores y, so one
launch does the whole product (no separate reduction kernel). The configuration depends on (N, K)
only, never on the number of rows: a row's result is then bitwise the same whatever its batch
neighbours are. More than MAX_ROWS rows (prefill) and fp32 go to cuBLAS.

A PROLOGUE computes the input tile from two operands on the fly, so the elementwise kernel that would
write it (and the read back) disappears: silu(a) * b (the MLP's down projection reads [gate | up]) or
a * sigmoid(g) (attention's output gate before o_proj). Each rounds to the input dtype where the unfused
ops do, so the fused product equals the unfused kernels' bit for bit up to the sigmoid's last ulp.
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


PROLOGUES = {None: 0, "silu_mul": 1, "sigmoid_gate": 2}


@triton.jit
def _linear_rows_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, arrive_ptr, b_ptr, M, N, K, K_SPLIT, s_xm, s_wn, s_ym, s_bm, s_bh, B_D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PROLOGUE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    mm = tl.arange(0, BLOCK_M)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = mm < M, nn < N
    x_rows = x_ptr + mm.to(tl.int64)[:, None] * s_xm
    b_rows = b_ptr + mm.to(tl.int64)[:, None] * s_bm  # the second operand: element k at (k // B_D, k % B_D)
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < k_hi
        mask_mk = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_rows + kk[None, :], mask=mask_mk, other=0.0)
        if PROLOGUE != 0:
            b = tl.load(b_rows + (kk // B_D * s_bh + kk % B_D)[None, :], mask=mask_mk, other=0.0).to(tl.float32)
            a = x.to(tl.float32)
            if PROLOGUE == 1:  # silu(a) * b, silu rounded first as silu_and_mul does
                s = (a * tl.sigmoid(a)).to(x.dtype).to(tl.float32)
                x = (s * b).to(x.dtype)
            else:  # a * sigmoid(b), the sigmoid rounded first as torch's a * sigmoid(b) does
                x = (a * tl.sigmoid(b).to(x.dtype).to(tl.float32)).to(x.dtype)
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


# Measured best (block_n, block_k, split_k) per decode weight shape on the H200 (scripts/gpu-check --only linear,
# sweep at 1 and 8 rows, best summed time; 2026-11-29). Qwen3.5-9B and -0.8B shapes; cuBLAS in brackets (M=1).
_MEASURED = {
    (4096, 4096): (64, 128, 4),     # 11.3 us [12.9]   9B GDN out, attention o
    (4096, 12288): (32, 128, 4),    # 26.8 us [29.2]   9B down
    (10240, 4096): (32, 256, 1),    # 22.6 us [22.6]   9B attention q|gate,k,v
    (12352, 4096): (32, 256, 1),    # 26.0 us [27.5]   9B GDN in_proj
    (24576, 4096): (64, 128, 1),    # 47.3 us [48.0]   9B gate|up
    (1024, 2048): (32, 128, 8),     # 4.8 us  [12.9]   0.8B GDN out, attention o
    (1024, 3584): (64, 256, 8),     # 5.8 us  [7.2]    0.8B down
    (5120, 1024): (32, 256, 1),     # 6.1 us  [5.5]    0.8B attention q|gate,k,v
    (7168, 1024): (32, 256, 1),     # 6.6 us  [6.6]    0.8B gate|up
    (8224, 1024): (32, 256, 1),     # 6.9 us  [6.9]    0.8B GDN in_proj
}
_PROGRAMS_TARGET = 256  # about two per SM of an H200: fewer leave bandwidth unused, many more add partial traffic


@functools.cache
def default_config(N: int, K: int) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, split_k, num_warps, num_stages) for an [N, K] weight. The measured best for a known
    shape; otherwise split K until about _PROGRAMS_TARGET programs stream W (the rule the sweep favoured:
    256-wide K tiles when unsplit, 128-wide when split)."""
    if (N, K) in _MEASURED:
        return (*_MEASURED[N, K], 4, 3)
    block_n = 32
    blocks_n = triton.cdiv(N, block_n)
    split = 1
    while blocks_n * split < _PROGRAMS_TARGET and K // (split * 2) >= 256:
        split *= 2
    return block_n, 256 if split == 1 else 128, split, 4, 3


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None, block_n: int | None = None,
           block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N]; more than MAX_ROWS rows (or a strided weight) use cuBLAS."""
    return _linear(x, None, weight, None, out, (block_n, block_k, split_k, num_warps, num_stages))


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
                    **config: int) -> torch.Tensor:
    """silu(x[..., :K]) * x[..., K:] @ weight[N, K].T for x [..., 2K] (the MLP's down projection)."""
    K = weight.shape[1]
    if x.shape[-1] != 2 * K:
        raise ValueError(f"linear_silu_mul: input {tuple(x.shape)} is not [gate | up] for weight {tuple(weight.shape)}")
    if _unfused(x, weight):
        from ninfer.ops.activation import silu_and_mul
        return linear(silu_and_mul(x), weight, out=out)
    x2 = x.reshape(-1, 2 * K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return _linear(x2[:, :K], x2[:, K:], weight, "silu_mul", out, _knobs(config), rows_shape=x.shape[:-1])


def linear_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *,
                        out: torch.Tensor | None = None, **config: int) -> torch.Tensor:
    """(x * sigmoid(gate)) @ weight[N, K].T; x and gate [..., heads, D] (gate may be a strided per-head slice,
    as attention's gate half of [query | gate])."""
    if x.shape != gate.shape or x.shape[-2] * x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_sigmoid_gate: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight "
                         f"{tuple(weight.shape)} do not match")
    if _unfused(x, weight) or gate.stride(-1) != 1:
        return linear((x * torch.sigmoid(gate)).flatten(-2), weight, out=out)
    heads, D = x.shape[-2:]
    g3 = gate.reshape(-1, heads, D)
    return _linear(x.reshape(-1, heads * D), g3, weight, "sigmoid_gate", out, _knobs(config),
                   rows_shape=x.shape[:-2])


def _knobs(config: dict) -> tuple:
    unknown = set(config) - {"block_n", "block_k", "split_k", "num_warps", "num_stages"}
    if unknown:
        raise TypeError(f"unknown configuration {sorted(unknown)}")
    return tuple(config.get(k) for k in ("block_n", "block_k", "split_k", "num_warps", "num_stages"))


def _unfused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs the fused prologues leave to the unfused ops: prefill-sized, fp32 or mixed dtypes."""
    rows = x.numel() // max(x.shape[-1], 1)
    return rows > MAX_ROWS or weight.stride(1) != 1 or x.dtype != weight.dtype or x.dtype not in _DTYPES


def _linear(x: torch.Tensor, b: torch.Tensor | None, weight: torch.Tensor, prologue: str | None,
            out: torch.Tensor | None, knobs: tuple, rows_shape: tuple | None = None) -> torch.Tensor:
    N, K = weight.shape
    if prologue is None:
        rows_shape = x.shape[:-1]
        x2 = x.reshape(-1, K)
        if _unfused(x2, weight):
            y = F.linear(x, weight)
            if out is not None:
                out.copy_(y.view(out.shape))
                return out
            return y
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
    else:
        x2 = x
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
    M = x2.shape[0]
    if out is None:
        out = torch.empty((*rows_shape, N), dtype=x.dtype, device=x.device)
    y2 = out.view(-1, N)
    if M == 0:
        return out
    bn, bk, split, warps, stages = (v if v is not None else d
                                    for v, d in zip(knobs, default_config(N, K), strict=True))
    blocks_n = triton.cdiv(N, bn)
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk  # whole BLOCK_K tiles per slice
    split = triton.cdiv(K, k_split)
    part = torch.empty((split, MAX_ROWS, N), dtype=torch.float32, device=x.device) if split > 1 else y2
    arrive = arrival_counters(x.device, blocks_n) if split > 1 else y2
    if b is None:  # an unused pointer and strides
        b_arg, s_bm, s_bh, b_d = x2, 0, 0, 1
    elif b.dim() == 2:  # [M, K] rows (the up half of [gate | up])
        b_arg, s_bm, s_bh, b_d = b, b.stride(0), 0, K
    else:  # [M, heads, D] with unit stride inside a head
        b_arg, s_bm, s_bh, b_d = b, b.stride(0), b.stride(1), b.shape[2]
    _linear_rows_kernel[(blocks_n, split)](
        x2, weight, y2, part, arrive, b_arg, M, N, K, k_split, x2.stride(0), weight.stride(0), y2.stride(0),
        s_bm, s_bh, b_d, BLOCK_M=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, PROLOGUE=PROLOGUES[prologue],
        num_warps=warps, num_stages=stages)
    return out
