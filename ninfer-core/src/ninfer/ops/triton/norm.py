"""RMS norms on the GPU: one pass per row, math in fp32 (see ``ninfer.ops.norm`` for the exact formulas)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, z_ptr, y_ptr, R, H1, s_x0, s_x1, s_z0, s_z1, s_yr, D, eps,
    ONE_PLUS: tl.constexpr, GATED: tl.constexpr, ROUND_WN: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr, SIGMOID_GATE: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    rr = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    # Row r of x (and z) is [r // H1, r % H1] of a [R / H1, H1, D] strided view: per-head rows of a slice of a
    # wider projection output (q of [query | gate], GDN's z) are read in place, with no copy to rows first.
    r0 = rr // H1
    r1 = rr - r0 * H1
    x_off = r0 * s_x0 + r1 * s_x1
    z_off = r0 * s_z0 + r1 * s_z1
    dd = tl.arange(0, BLOCK_D)
    mask = (rr < R)[:, None] & (dd < D)[None, :]
    x = tl.load(x_ptr + x_off[:, None] + dd[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
    normed = _normed(x, D, eps)
    if GATED:
        # Gated output norm rounds as the reference does: normed -> x.dtype, times w (in x.dtype when w is
        # not wider), then the fp32 gate: silu, or sigmoid (Qwen4Exp's output_gate_type).
        dt = y_ptr.dtype.element_ty
        y = w[None, :] * normed.to(dt).to(tl.float32)
        if ROUND_WN:
            y = y.to(dt).to(tl.float32)
        z = tl.load(z_ptr + z_off[:, None] + dd[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * (tl.sigmoid(z) if SIGMOID_GATE else z * tl.sigmoid(z))
    else:
        y = _scaled(normed, w, ONE_PLUS)
    tl.store(y_ptr + rr[:, None] * s_yr + dd[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normed(x, D, eps):
    """fp32 rows [ROWS, BLOCK_D] (zero past D) times rsqrt(mean(x^2) + eps): every norm kernel here norms through it,
    so a row normed by one is bitwise the row normed by another with the same tile."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]


@triton.jit
def _scaled(normed, w, ONE_PLUS: tl.constexpr):
    """The normed rows times (1 + w) or w (fp32 [BLOCK_D])."""
    if ONE_PLUS:
        return normed * (1.0 + w[None, :])
    return normed * w[None, :]


@triton.jit
def _embed_rms_norm_kernel(
    ids_ptr, table_ptr, w_ptr, x_ptr, y_ptr, R, V, s_t, s_xr, s_yr, D, eps,
    ONE_PLUS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # The embedding gather and the first norm in one pass: x[r] = table[ids[r]], y[r] = rms_norm(x[r]) computed as
    # _rms_norm_kernel does (same tile, same reductions), so y is bitwise that kernel's norm of the gathered rows.
    pdl_prologue(USE_PDL)
    rr = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    ok = rr < R
    mask = ok[:, None] & (dd < D)[None, :]
    ids = tl.load(ids_ptr + rr, mask=ok, other=0).to(tl.int64)
    in_table = (ids >= 0) & (ids < V)  # an id out of range reads nothing (zeros), never another buffer
    row = tl.load(table_ptr + ids[:, None] * s_t + dd[None, :], mask=mask & in_table[:, None], other=0.0)
    tl.store(x_ptr + rr[:, None] * s_xr + dd[None, :], row, mask=mask)
    w = tl.load(w_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
    y = _scaled(_normed(row.to(tl.float32), D, eps), w, ONE_PLUS)
    tl.store(y_ptr + rr[:, None] * s_yr + dd[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x, D: int, what: str):
    if x.shape[-1] != D:
        raise ValueError(f"{what}: last dimension {x.shape[-1]} does not match the weight's {D}")
    x2 = x.reshape(-1, D)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _heads(x, D: int, what: str):
    """x [..., D] as a [A, H1, D] view (H1 = the second-to-last dim) with a contiguous last dim; a copy only
    when the leading dims cannot merge or the last dim is strided."""
    if x.shape[-1] != D:
        raise ValueError(f"{what}: last dimension {x.shape[-1]} does not match the weight's {D}")
    x3 = x.reshape(-1, x.shape[-2] if x.dim() >= 2 else 1, D)
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def _row_tile(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, rows per program, warps) of every norm kernel here for rows of D: one tile shape per D, so the
    norm of a row is computed alike by each kernel that norms it. A decode step's norms are latency on its
    chain, not bandwidth: few rows per program (a GDN layer's 32 head rows in 8 programs, not 2) and 8 warps for
    a row of 2048 or more (its loads and its reduction spread wider) finish them sooner (docs/kernels.md)."""
    block_d = triton.next_power_of_2(D)
    return block_d, max(1, min(4, 2048 // block_d)), 8 if block_d >= 2048 else 4


def _launch(x, z, weight, eps, one_plus, gated, out, sigmoid_gate=False):
    D = weight.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:  # no rows (and no head dim to view them by)
        return out
    x3 = _heads(x, D, "rms_norm")
    z3 = _heads(z, D, "rms_norm_gated") if gated else x3
    if gated and z3.shape != x3.shape:
        raise ValueError(f"rms_norm_gated: x {tuple(x.shape)} and z {tuple(z.shape)} differ")
    y2 = out.view(-1, D)
    R, H1 = x3.shape[0] * x3.shape[1], x3.shape[1]
    if R == 0:
        return out
    block_d, rows, warps = _row_tile(D)
    _rms_norm_kernel[(triton.cdiv(R, rows),)](
        x3, weight, z3, y2, R, H1, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), y2.stride(0), D, eps,
        ONE_PLUS=bool(one_plus), GATED=gated, ROUND_WN=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
        ROWS=rows, BLOCK_D=block_d, SIGMOID_GATE=sigmoid_gate, num_warps=warps, **pdl_args(x.device)
    )
    return out


def rms_norm(x, weight, eps: float, *, one_plus: bool = True, out=None):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w) (or * w), in fp32, cast to x.dtype."""
    return _launch(x, None, weight, eps, one_plus, False, out)


def embed_rms_norm(ids, table, weight, eps: float, *, one_plus: bool = True):
    """(x, y): the rows of ``table`` [V, D] at ``ids`` [N] (int32/int64) and ``rms_norm(x, weight, eps)``, one
    launch. An id outside the table gives a zero row (callers validate ids; this only keeps the read in bounds)."""
    D = weight.shape[0]
    if table.shape[-1] != D or table.stride(-1) != 1:
        raise ValueError(f"embed_rms_norm: table {tuple(table.shape)} rows do not match the weight's {D}")
    R = ids.numel()
    x = torch.empty((R, D), dtype=table.dtype, device=table.device)
    y = torch.empty_like(x)
    if R == 0:
        return x, y
    block_d, rows, warps = _row_tile(D)
    _embed_rms_norm_kernel[(triton.cdiv(R, rows),)](
        ids.reshape(-1), table, weight, x, y, R, table.shape[0], table.stride(0), x.stride(0), y.stride(0), D, eps,
        ONE_PLUS=bool(one_plus), ROWS=rows, BLOCK_D=block_d, num_warps=warps, **pdl_args(table.device))
    return x, y


def rms_norm_gated(x, z, weight, eps: float, *, out=None):
    """Qwen3.5 GDN output norm: (w * normed(x).to(dtype)) * silu(z.float()), cast to x.dtype."""
    return _launch(x, z, weight, eps, False, True, out)


def rms_norm_gated_sigmoid(x, z, weight, eps: float, *, out=None):
    """Qwen4Exp's GDN output norm (``output_gate_type`` sigmoid): (w * normed(x).to(dtype)) * sigmoid(z.float())."""
    return _launch(x, z, weight, eps, False, True, out, sigmoid_gate=True)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, R, s_xr, s_xt, s_rr, s_yr, s_sr, D, eps,
    ONE_PLUS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TERMS: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    rr = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    mask = (rr < R)[:, None] & (dd < D)[None, :]
    w = tl.load(w_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
    s, y = _add_norm_rows(x_ptr, r_ptr, w, rr, dd, mask, s_xr, s_xt, s_rr, D, eps, s_ptr.dtype.element_ty,
                          y_ptr.dtype.element_ty, ONE_PLUS, ROWS, BLOCK_D, TERMS)
    # Every row is fully read above before either store, so residual_out may be the residual itself.
    tl.store(s_ptr + rr[:, None] * s_sr + dd[None, :], s, mask=mask)
    tl.store(y_ptr + rr[:, None] * s_yr + dd[None, :], y, mask=mask)


@triton.jit
def _add_norm_rows(x_ptr, r_ptr, w, rr, dd, mask, s_xr, s_xt, s_rr, D, eps, s_dtype: tl.constexpr,
                   y_dtype: tl.constexpr, ONE_PLUS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                   TERMS: tl.constexpr):
    """(residual + x rounded to s_dtype, its norm in y_dtype) of rows ``rr`` (``w``: the norm weight in fp32). Both
    add_rms_norm kernels norm through it, so a row is bitwise the same from either."""
    x = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for t in tl.static_range(TERMS):  # x as terms (a MoE block's slot rows): added in order in fp32, then rounded
        x += tl.load(x_ptr + rr[:, None] * s_xr + t * s_xt + dd[None, :], mask=mask, other=0.0).to(tl.float32)
    if TERMS > 1:
        x = x.to(s_dtype).to(tl.float32)
    r = tl.load(r_ptr + rr[:, None] * s_rr + dd[None, :], mask=mask, other=0.0)
    # The sum is rounded to the residual dtype first: the norm reads the rounded stream, as the unfused model.
    s = (r.to(tl.float32) + x).to(s_dtype)
    return s, _scaled(_normed(s.to(tl.float32), D, eps), w, ONE_PLUS).to(y_dtype)


def _out_rows(buf, like, what: str):
    if buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
        raise ValueError(f"add_rms_norm: {what} {tuple(buf.shape)} {buf.dtype} must match x {tuple(like.shape)} "
                         f"{like.dtype} on {like.device}")
    try:
        rows = buf.view(-1, like.shape[-1])  # written through, so it must be a view, never a copy
    except RuntimeError:
        rows = None
    if rows is None or rows.stride(-1) != 1:
        raise ValueError(f"add_rms_norm: {what} must be viewable as rows with a contiguous last dimension")
    return rows


def add_rms_norm(x, residual, weight, eps: float, *, one_plus: bool = True, out=None, residual_out=None):
    """(rms_norm(residual + x), residual + x) in one pass: x and residual read once, both results written once.

    x may also be terms [..., S, D] of residual [..., D] (``ninfer.ops.norm.add_rms_norm``): added in order in
    fp32 and rounded before the residual add. ``residual_out=residual`` updates the residual stream in place;
    ``out`` takes the normed rows.
    """
    D = weight.shape[0]
    terms = x.dim() == residual.dim() + 1
    like = x[..., 0, :] if terms else x
    if like.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must have the same shape and dtype")
    x3 = _heads(x, D, "add_rms_norm") if terms else _rows(x, D, "add_rms_norm")[:, None]  # [R, S, D]
    r2 = _rows(residual, D, "add_rms_norm")
    if out is None:
        out = torch.empty(like.shape, dtype=x.dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty(like.shape, dtype=x.dtype, device=x.device)
    y2 = _out_rows(out, like, "out")
    s2 = _out_rows(residual_out, like, "residual_out")
    R = r2.shape[0]
    if R == 0:
        return out, residual_out
    block_d, rows, warps = _row_tile(D)
    _add_rms_norm_kernel[(triton.cdiv(R, rows),)](
        x3, r2, weight, y2, s2, R, x3.stride(0), x3.stride(1), r2.stride(0), y2.stride(0), s2.stride(0), D, eps,
        ONE_PLUS=bool(one_plus), ROWS=rows, BLOCK_D=block_d, TERMS=x3.shape[1], num_warps=warps,
        **pdl_args(x.device)
    )
    return out, residual_out


# Rows a fused norm + projection call takes (decode batches, verification rows); more go to the unfused ops.
PROJECT_MAX_ROWS = 16


@triton.jit
def _add_rms_norm_linear_kernel(
    x_ptr, r_ptr, w_ptr, p_ptr, y_ptr, s_ptr, o_ptr, R, P, s_xr, s_rr, s_yr, s_sr, s_pp, s_or, D, eps,
    ONE_PLUS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pp = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    dd = tl.arange(0, BLOCK_D)
    # This program's projection rows never depend on the previous kernel: they load while it finishes.
    proj = tl.load(p_ptr + tl.minimum(pp, P - 1).to(tl.int64)[:, None] * s_pp + dd[None, :],
                   mask=(dd < D)[None, :], other=0.0)
    w = tl.load(w_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
    pdl_prologue(USE_PDL)
    # Row block program_id(1), normed as _add_rms_norm_kernel norms it (the same tile and order: bitwise the same
    # rows) by every program of the row block; the first stores them, and each projects them onto its rows.
    rr = (tl.program_id(1) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    mask = (rr < R)[:, None] & (dd < D)[None, :]
    s, y = _add_norm_rows(x_ptr, r_ptr, w, rr, dd, mask, s_xr, 0, s_rr, D, eps, s_ptr.dtype.element_ty,
                          y_ptr.dtype.element_ty, ONE_PLUS, ROWS, BLOCK_D, 1)
    if pid == 0:
        tl.store(s_ptr + rr[:, None] * s_sr + dd[None, :], s, mask=mask)
        tl.store(y_ptr + rr[:, None] * s_yr + dd[None, :], y, mask=mask)
    # The rounded rows, as a separate projection would read them back; fp32 products and sum.
    out = tl.sum(y.to(tl.float32)[:, None, :] * proj.to(tl.float32)[None, :, :], axis=2)
    tl.store(o_ptr + rr[:, None] * s_or + pp[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(rr < R)[:, None] & (pp < P)[None, :])


def add_rms_norm_linear(x, residual, weight, eps: float, projection, *, one_plus: bool = True, block_p: int = 4):
    """(normed, residual + x, normed @ projection.T) in one launch for up to PROJECT_MAX_ROWS rows of bf16/fp16
    with D <= 4096 (``ninfer.ops.norm.add_rms_norm_linear``), else None (the caller runs the unfused ops).
    A program per ``block_p`` projection rows and row block (``add_rms_norm``'s tile and warps); the tiles never
    depend on the row count, so a row's results do not depend on its batch neighbours."""
    D = weight.shape[0]
    if x.shape != residual.shape or x.dtype != residual.dtype or x.shape[-1] != D or projection.stride(1) != 1 \
            or x.dtype not in (torch.bfloat16, torch.float16) or D > 4096:
        return None
    x2, r2 = _rows(x, D, "add_rms_norm_linear"), _rows(residual, D, "add_rms_norm_linear")
    R, P = x2.shape[0], projection.shape[0]
    if not 1 <= R <= PROJECT_MAX_ROWS:
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    projected = torch.empty((*x.shape[:-1], P), dtype=x.dtype, device=x.device)
    block_d, rows, warps = _row_tile(D)  # add_rms_norm's tile: bitwise its rows
    _add_rms_norm_linear_kernel[(triton.cdiv(P, block_p), triton.cdiv(R, rows))](
        x2, r2, weight, projection, out.view(-1, D), residual_out.view(-1, D), projected.view(-1, P), R, P,
        x2.stride(0), r2.stride(0), D, D, projection.stride(0), P, D, eps, ONE_PLUS=bool(one_plus),
        ROWS=rows, BLOCK_D=block_d, BLOCK_P=block_p, num_warps=warps, **pdl_args(x.device))
    return out, residual_out, projected
