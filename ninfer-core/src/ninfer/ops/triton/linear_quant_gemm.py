"""Quantized linears for many rows (prefill): W8A8 FP8 GEMM, and dequantize-then-cuBLAS for any format.

W8A8 (``linear_fp8_w8a8``): x is quantized per token and 128-wide group (``quantize_activation_fp8``, the same
fp32 operations as ``ninfer.ops.quant.quantize_activation_fp8``: round-to-nearest divisions, so the codes and
scales are the reference's), then a tiled GEMM multiplies the fp8 codes on the tensor cores, one 128-wide K
step at a time, and scales each step's product by the row's activation scale and the column's weight scale
before adding it to the fp32 accumulator (the per-128 promotion also bounds the fp8 MMA's reduced-precision
accumulation). W's [N, K] rows with K contiguous are the K-major B operand fp8 dots want. Any FP8 block whose
K extent is a multiple of 128 or spans K (Qwen's (128, 128), per-channel (1, K)); the N extent is free (the
column scale is gathered per output column).

Weight-only (``linear_dequant``): ``dequantize`` writes the weight in bf16 / fp16 / fp32 (one elementwise kernel,
the format's definition with the reference's fp32 operations, so the result equals ``QuantizedWeight.dequantize``)
and cuBLAS multiplies. The NVFP4 prefill path on Hopper (no FP4 tensor cores) and the fallback for FP8 without
A8; the temporary is the whole weight in the input's dtype. ``dequantize`` takes banks of experts [E, N, K].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.contract.quant import FP8_BLOCK, FP8_MAX, NVFP4, QUANTIZED_FORMATS
from ninfer.ops.launch import pdl_args
from ninfer.ops.quant import QuantizedWeight
from ninfer.ops.triton._pdl_jit import pdl_prologue

GROUP = 128  # activation quantization group, and the GEMM's K step
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, GROUPS, s_xm, s_qm, s_sm, FP8_MAX: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_G: tl.constexpr, USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    kk = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = kk < K
    pdl_prologue(USE_PDL)
    x = tl.load(x_ptr + row * s_xm + kk, mask=mask, other=0.0).to(tl.float32)
    # div_rn: Triton's fp32 '/' is an approximate division; the reference's is IEEE
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10), FP8_MAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * s_qm + kk, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * s_sm + g, scale, mask=g < GROUPS)


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, s_am, s_asm, s_wn, s_wsn, s_wsk, s_ym, B0, B1,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # Programs walk GROUP_M row blocks down one column block before the next, so W's tiles are reused from L2.
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    mm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = mm < M, nn < N
    a_rows = a_ptr + mm.to(tl.int64)[:, None] * s_am
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * s_wn
    as_rows = as_ptr + mm.to(tl.int64) * s_asm
    ws_rows = ws_ptr + (nn // B0).to(tl.int64) * s_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pdl_prologue(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < K
        a = tl.load(a_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a_s = tl.load(as_rows + k0 // BLOCK_K, mask=mask_m, other=0.0)
        w_s = tl.load(ws_rows + (k0 // B1) * s_wsk, mask=mask_n, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
    out = y_ptr + mm.to(tl.int64)[:, None] * s_ym + nn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequant_fp8_kernel(d_ptr, s_ptr, y_ptr, N, K, s_de, s_dn, s_se, s_sn, s_sk, s_ye, s_yn, B0, B1,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
    e = tl.program_id(2).to(tl.int64)
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    pdl_prologue(USE_PDL)
    mask = (rr < N)[:, None] & (cc < K)[None, :]
    r64 = rr.to(tl.int64)[:, None]
    d = tl.load(d_ptr + e * s_de + r64 * s_dn + cc[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + e * s_se + (rr // B0).to(tl.int64)[:, None] * s_sn + (cc // B1)[None, :] * s_sk,
                mask=mask, other=0.0)
    tl.store(y_ptr + e * s_ye + r64 * s_yn + cc[None, :], (d * s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_nvfp4_kernel(d_ptr, s_ptr, g_ptr, y_ptr, N, KB, s_de, s_dn, s_se, s_sn, s_ge, s_ye, s_yn,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
    HALF: tl.constexpr = BLOCK_C // 2
    e = tl.program_id(2).to(tl.int64)
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    jj = tl.program_id(1) * HALF + tl.arange(0, HALF)  # byte columns
    mask = (rr < N)[:, None] & (jj < KB)[None, :]  # over bytes, so the loads stay vectorized
    r64 = rr.to(tl.int64)[:, None]
    pdl_prologue(USE_PDL)
    packed = tl.load(d_ptr + e * s_de + r64 * s_dn + jj[None, :], mask=mask, other=0)
    g = tl.load(g_ptr + e * s_ge + rr, mask=rr < N, other=0.0)
    # the reference's order: (scale * global), then times the e2m1 value
    s = tl.load(s_ptr + e * s_se + r64 * s_sn + (jj // 8)[None, :], mask=mask, other=0.0).to(tl.float32)
    s = s * g[:, None]
    lo = e2m1_scaled(packed & 15, s * 16384.0)  # exact powers of two: rounded as the reference's value * s
    hi = e2m1_scaled(packed >> 4, s * 16384.0)
    w = tl.reshape(tl.join(lo, hi), (BLOCK_R, BLOCK_C))  # [.., j, 0] element 2j, [.., j, 1] element 2j + 1
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(y_ptr + e * s_ye + r64 * s_yn + cc[None, :], w.to(y_ptr.dtype.element_ty),
             mask=(rr < N)[:, None] & (cc < 2 * KB)[None, :])


@triton.jit
def e2m1_scaled(code, scale):
    """e2m1 codes (0..15, any integer type) times fp32 ``scale`` that holds the factor 2^14: the code's sign
    at bit 15 and its exponent and mantissa at bits 9-11 of an fp16 give the e2m1 value times 2^-14 (the
    subnormal 0.5 included), so one multiply both restores it and scales it."""
    c = code.to(tl.uint16)
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32) * scale


def require_weight(x: torch.Tensor, weight: QuantizedWeight, fmt: str | None, op: str) -> None:
    """Raise for a weight a kernel cannot take: another format (``fmt`` None: any), a bank of experts, an
    input of another width or device, strided rows."""
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"{op}: expected a QuantizedWeight, got {type(weight).__name__}")
    if fmt is not None and weight.format != fmt:
        raise ValueError(f"{op}: takes {fmt} weights, got {weight.format}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: takes a 2-D weight, got {weight.shape} (take an expert of a bank)")
    if x.shape[-1] != weight.shape[1] or x.device != weight.device:
        raise ValueError(f"{op}: input {tuple(x.shape)} on {x.device} does not match weight {weight.shape} on "
                         f"{weight.device}")
    if weight.data.stride(-1) != 1:
        raise ValueError(f"{op}: the weight's rows must be contiguous")


def quantize_activation_fp8(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]), scale = max(amax, 1e-10) / 448
    per row and ``group`` columns: ``ninfer.ops.quant.quantize_activation_fp8`` in one kernel."""
    if x.dim() != 2:
        raise ValueError(f"quantize_activation_fp8: takes [M, K], got {tuple(x.shape)}")
    if group & (group - 1) or group < 16:
        raise ValueError(f"quantize_activation_fp8: the group must be a power of two of at least 16, got {group}")
    M, K = x.shape
    groups = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, groups), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    if x.stride(1) != 1:
        x = x.contiguous()
    block_g = max(1, min(1024 // group, triton.next_power_of_2(groups)))
    _quantize_rows_kernel[(M, triton.cdiv(groups, block_g))](
        x, q, s, K, groups, x.stride(0), q.stride(0), s.stride(0), FP8_MAX=FP8_MAX, GROUP=group, BLOCK_G=block_g,
        num_warps=4, **pdl_args(x.device))
    return q, s


def linear_fp8_w8a8(x: torch.Tensor, weight: QuantizedWeight, *, out_dtype: torch.dtype | None = None,
                    **tiles) -> torch.Tensor:
    """x [..., K] @ W.T with x quantized to FP8 per token and 128-group (``weight.activation``'s A8 numbers,
    whatever it says): [..., N] in out_dtype, else x's dtype. ``tiles``: ``w8a8_gemm``'s."""
    require_weight(x, weight, FP8_BLOCK, "linear_fp8_w8a8")
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    q, s = quantize_activation_fp8(x2)
    y = w8a8_gemm(q, s, weight, out_dtype=out_dtype or x.dtype, **tiles)
    return y.view(*x.shape[:-1], N)


def w8a8_gemm(q: torch.Tensor, scales: torch.Tensor, weight: QuantizedWeight, *,
              out_dtype: torch.dtype = torch.bfloat16, block_m: int | None = None, block_n: int = 128,
              group_m: int = 8, num_warps: int | None = None, num_stages: int = 4) -> torch.Tensor:
    """(q * scales) @ W.T for activations quantized per row and 128-group (``quantize_activation_fp8``'s
    output) and an FP8 W with K blocks a multiple of 128 or spanning K: [M, N] in ``out_dtype``. Tiles: 64 rows
    up to 64 rows (4 warps), else 128 (8 warps); ``block_n`` columns; 128-wide K steps."""
    N, K = weight.shape
    b0, b1 = weight.block
    if b1 % GROUP and b1 < K:
        raise ValueError(f"w8a8_gemm: the weight's K blocks of {b1} (block {weight.block}) do not hold whole "
                         f"{GROUP}-wide activation groups; use linear_fp8 or linear_dequant")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"w8a8_gemm: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    M = q.shape[0]
    if q.shape != (M, K) or q.dtype != torch.float8_e4m3fn or scales.shape != (M, triton.cdiv(K, GROUP)) or \
            q.stride(1) != 1:
        raise ValueError(f"w8a8_gemm: activations {q.dtype} {tuple(q.shape)} with scales {tuple(scales.shape)} "
                         f"do not match weight {weight.shape}")
    y = torch.empty((M, N), dtype=out_dtype, device=q.device)
    if M == 0:
        return y
    bm = block_m or (64 if M <= 64 else 128)
    warps = num_warps or (4 if bm <= 64 else 8)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, block_n),)
    _w8a8_kernel[grid](
        q, scales, weight.data, weight.scale, y, M, N, K, q.stride(0), scales.stride(0), weight.data.stride(0),
        weight.scale.stride(0), weight.scale.stride(1), y.stride(0), b0, b1,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=GROUP, GROUP_M=group_m, num_warps=warps, num_stages=num_stages,
        **pdl_args(q.device))
    return y


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight [N, K] (or a bank [E, N, K]) in ``dtype``: equal to ``weight.dequantize(dtype)``."""
    if not isinstance(weight, QuantizedWeight) or weight.format not in QUANTIZED_FORMATS:
        raise TypeError(f"dequantize: expected a QuantizedWeight, got {type(weight).__name__}")
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dequantize: dtype must be one of {_OUT_DTYPES}, got {dtype}")
    if weight.data.stride(-1) != 1:
        raise ValueError("dequantize: the weight's rows must be contiguous")
    *lead, N, K = weight.shape
    E = lead[0] if lead else 1
    y = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if y.numel() == 0:
        return y
    d, s, y3 = (t if lead else t.unsqueeze(0) for t in (weight.data, weight.scale, y))
    block_r, block_c = 32, 128
    grid = (triton.cdiv(N, block_r), triton.cdiv(K, block_c), E)
    pdl = pdl_args(weight.device)
    if weight.format == NVFP4:
        g = weight.global_scale if lead else weight.global_scale.unsqueeze(0)
        _dequant_nvfp4_kernel[grid](d, s, g, y3, N, K // 2, d.stride(0), d.stride(1), s.stride(0), s.stride(1),
                                    g.stride(0), y3.stride(0), y3.stride(1), BLOCK_R=block_r, BLOCK_C=block_c,
                                    num_warps=4, **pdl)
    else:
        b0, b1 = weight.block
        _dequant_fp8_kernel[grid](d, s, y3, N, K, d.stride(0), d.stride(1), s.stride(0), s.stride(1), s.stride(2),
                                  y3.stride(0), y3.stride(1), b0, b1, BLOCK_R=block_r, BLOCK_C=block_c,
                                  num_warps=4, **pdl)
    return y


def linear_dequant(x: torch.Tensor, weight: QuantizedWeight, *, out_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """x [..., K] @ W.T weight-only for any format: W dequantized to x's dtype, then ``F.linear`` (cuBLAS):
    [..., N] in out_dtype, else x's dtype. ``linear_quant_ref``'s A16 numbers."""
    require_weight(x, weight, None, "linear_dequant")
    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"linear_dequant: the input must be one of {_OUT_DTYPES}, got {x.dtype}")
    y = F.linear(x, dequantize(weight, x.dtype))
    return y if out_dtype in (None, x.dtype) else y.to(out_dtype)
