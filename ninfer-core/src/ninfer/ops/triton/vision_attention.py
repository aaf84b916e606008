"""Non-causal attention over packed variable-length sequences on the GPU (the vision encoder's per-frame attention).

One program owns BLOCK_M query rows of one sequence and one head, and streams that sequence's keys and values in
BLOCK_N tiles with an online softmax in fp32 (exp2). Sequence bounds come from the device ``cu_seqlens``; the
grid is (query blocks of the longest sequence, sequences, heads), and programs past their sequence's end return.

The head dim need not be a power of two (Qwen3.5's vision head is 72): with ``head_split`` it is covered by two
column blocks, the largest power of two below it and the rest padded to a power of two of at least 16 (72 =
64 + 16, 80 dot columns), instead of one block padded to the next power of two (128); the padding is masked
on load and store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue

_LOG2E = 1.4426950408889634


@triton.jit
def _vision_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_on, s_oh,
    qk_scale_log2,
    D: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    mblk = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    if mblk * BLOCK_M < length:
        rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        tok = start + rows
        if WIDE:
            tok = tok.to(tl.int64)
        da = tl.arange(0, DA)
        da_ok = da < D
        q_rows = q_ptr + tok[:, None] * s_qn + h * s_qh
        qa = tl.load(q_rows + da[None, :], mask=row_ok[:, None] & da_ok[None, :], other=0.0)
        acc_a = tl.zeros([BLOCK_M, DA], tl.float32)
        if DB > 0:  # the head's columns past DA (a static branch: DB is a compile-time constant)
            db = DA + tl.arange(0, DB)
            db_ok = db < D
            qb = tl.load(q_rows + db[None, :], mask=row_ok[:, None] & db_ok[None, :], other=0.0)
            acc_b = tl.zeros([BLOCK_M, DB], tl.float32)
        # Finite start for the running maxima (every key tile holds at least one key of the sequence).
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        cols = tl.arange(0, BLOCK_N)
        for n0 in range(0, length, BLOCK_N):
            n = n0 + cols
            n_ok = n < length
            ktok = start + n
            if WIDE:
                ktok = ktok.to(tl.int64)
            k_rows = k_ptr + ktok[:, None] * s_kn + h * s_kh
            v_rows = v_ptr + ktok[:, None] * s_vn + h * s_vh
            ka = tl.load(k_rows + da[None, :], mask=n_ok[:, None] & da_ok[None, :], other=0.0)
            s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PRECISION)
            if DB > 0:
                kb = tl.load(k_rows + db[None, :], mask=n_ok[:, None] & db_ok[None, :], other=0.0)
                s = tl.dot(qb, tl.trans(kb), s, input_precision=DOT_PRECISION)
            s = tl.where(n_ok[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            va = tl.load(v_rows + da[None, :], mask=n_ok[:, None] & da_ok[None, :], other=0.0)
            acc_a = tl.dot(p.to(va.dtype), va, acc_a * alpha[:, None], input_precision=DOT_PRECISION)
            if DB > 0:
                vb = tl.load(v_rows + db[None, :], mask=n_ok[:, None] & db_ok[None, :], other=0.0)
                acc_b = tl.dot(p.to(vb.dtype), vb, acc_b * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new
        inv = 1.0 / l_i
        o_rows = o_ptr + tok[:, None] * s_on + h * s_oh
        tl.store(o_rows + da[None, :], (acc_a * inv[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & da_ok[None, :])
        if DB > 0:
            tl.store(o_rows + db[None, :], (acc_b * inv[:, None]).to(o_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & db_ok[None, :])


def _wide_offsets(rows: int, *tensors) -> bool:
    """Whether an element offset (row x row stride + head x head stride) can pass int32: 64-bit offsets then;
    32-bit ones otherwise (fewer registers in the tile loops)."""
    return any(rows * t.stride(0) + t.shape[1] * t.stride(1) >= 2 ** 31 for t in tensors)


def head_blocks(head_dim: int, split: bool) -> tuple[int, int]:
    """(DA, DB): the column blocks covering a head of ``head_dim``. Split: the largest power of two not above it
    (at least 16) and the rest rounded up to a power of two of at least 16, or 0 when nothing is left;
    unsplit: one block, the next power of two (at least 16)."""
    whole = max(16, triton.next_power_of_2(head_dim))
    if not split or whole == head_dim or head_dim <= 16:
        return whole, 0
    first = whole // 2
    return first, max(16, triton.next_power_of_2(head_dim - first))


def default_block_m(longest: int, seqs: int, heads: int, device: tuning.DeviceKey) -> int:
    """Query rows per program: the table's ``block_m`` (128, the prefill attention's measured best), or
    ``narrow_block_m`` when blocks that wide would leave the GPU with fewer than ``wide_programs`` programs (two
    per SM: one small image)."""
    c = tuning.choices("vision_attention", device)
    wide = c["block_m"]
    return wide if triton.cdiv(longest, wide) * seqs * heads >= c["wide_programs"] else c["narrow_block_m"]


def vision_attention(q, k, v, seqs, scale: float | None = None, *, out=None, block_m: int | None = None,
                     block_n: int = 64, head_split: bool = True, num_warps: int | None = None,
                     num_stages: int = 3):
    """Attention within each packed sequence (see ``ninfer.ops.vision.vision_attention``); q, k, v [N, H, D] with
    any row and head strides and a unit-stride head dim."""
    N, H, D = q.shape
    if k.shape != q.shape or v.shape != q.shape or N != seqs.total:
        raise ValueError(f"vision_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         f"[N, H, D] alike with N = {seqs.total}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("vision_attention: the head dim of q, k and v must be contiguous")
    if out is None:
        out = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (N, H, D) or out.stride(2) != 1:
        raise ValueError(f"vision_attention: out {tuple(out.shape)} must be [{N}, {H}, {D}] with a contiguous head")
    if N == 0:
        return out
    B, longest = len(seqs.lengths), seqs.max_length
    if block_m is None:
        block_m = default_block_m(longest, B, H, tuning.device_key(q))
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    da, db = head_blocks(D, head_split)
    scale = D ** -0.5 if scale is None else scale
    _vision_attention_kernel[(triton.cdiv(longest, block_m), B, H)](
        q, k, v, out, seqs.cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * _LOG2E,
        D=D, DA=da, DB=db, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WIDE=_wide_offsets(N, q, k, v, out),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device)
    )
    return out
