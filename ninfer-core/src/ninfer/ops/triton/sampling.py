"""Sampling on the GPU: greedy tokens, and the constrained-decoding token mask.

Greedy: the first index of each row's maximum, as ``torch.argmax(logits, -1)``.

A row is cut into S chunks of whole blocks, one program each (about the tuning table's ``programs_per_row`` for
any vocabulary, about one per SM, so B = 1 still streams the row with the whole GPU); each program writes its
chunk's (key, first index) to a small workspace and the last program of the row to arrive reduces the S partials
and stores the token: one launch.

Values are compared through an int32 key that orders like torch: floats by value with -0.0 == +0.0, NaN
above +inf (every NaN equal, so the first NaN wins), padding below -inf (an all -inf row gives index 0).

The token mask (``apply_token_mask``) sets refused logits to -inf in place from the int32 bitmask of
``ninfer.contract.constraint`` (bit ``t % 32`` of word ``t // 32``: token t allowed), one launch over
(row, blocks of words); it reads only the mask and writes only the refused logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import arrival_counters, pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue

_BLOCK = 2048  # elements per program and loop step: 16 per thread at 4 warps, 4 x 16-byte loads for fp32
_KEY_PAD = tl.constexpr(-(2**31))  # below every float's key
_KEY_NAN = tl.constexpr(2**31 - 1)  # above +inf's key
_INDEX_NONE = tl.constexpr(2**31 - 1)


@triton.jit
def _key(v):
    """An int32 that orders like torch's comparison of fp32 values (see the module docstring)."""
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 -> +0.0: they tie, and the first index must win
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: flip the magnitude bits so larger is greater
    return tl.where(v != v, _KEY_NAN, key)


@triton.jit
def _first_max(key, index):
    """(largest key, smallest index holding it) of a block."""
    best = tl.max(key, 0)
    return best, tl.min(tl.where(key == best, index, _INDEX_NONE), 0)


@triton.jit
def _greedy_kernel(
    x_ptr, part_ptr, arrive_ptr, out_ptr, V, CHUNK, S, s_xb,
    BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * s_xb
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    # Per lane, the best key so far and where: lanes visit increasing indices, so a strict > keeps the first.
    best = tl.full((BLOCK,), _KEY_PAD, tl.int32)
    at = tl.zeros((BLOCK,), tl.int32)
    for k0 in range(lo, hi, BLOCK):
        kk = k0 + tl.arange(0, BLOCK)
        mask = kk < V  # chunks are whole blocks: only the row's end cuts one
        key = tl.where(mask, _key(tl.load(x_row + kk, mask=mask, other=0.0).to(tl.float32)), _KEY_PAD)
        take = key > best
        best = tl.where(take, key, best)
        at = tl.where(take, kk, at)
    key, index = _first_max(best, at)  # every chunk is non-empty, so a real element is found
    if BLOCK_S == 1:
        tl.store(out_ptr + row, index.to(tl.int64))
    else:
        # Partials [2, B, S]: keys then indices; the row's last program reduces them.
        part = part_ptr + row * S
        tl.store(part + split, key)
        tl.store(part + tl.num_programs(0) * S + split, index)
        tl.debug_barrier()  # the partial is written before the arrival is published
        counter = arrive_ptr + row
        if tl.atomic_add(counter, 1, sem="acq_rel") == S - 1:
            ss = tl.arange(0, BLOCK_S)
            keys = tl.load(part + ss, mask=ss < S, other=_KEY_PAD)
            indices = tl.load(part + tl.num_programs(0) * S + ss, mask=ss < S, other=0)
            key, index = _first_max(keys, indices)
            tl.store(out_ptr + row, index.to(tl.int64))
            tl.store(counter, 0)


def splits(V: int, programs_per_row: int) -> tuple[int, int]:
    """(chunk, S) for rows of V: whole blocks per chunk, about ``programs_per_row`` chunks, none empty."""
    chunk = triton.cdiv(triton.cdiv(V, programs_per_row), _BLOCK) * _BLOCK
    return chunk, triton.cdiv(V, chunk)


def greedy(logits: torch.Tensor, *, out: torch.Tensor | None = None, programs_per_row: int | None = None
           ) -> torch.Tensor:
    """tokens[B] int64 = torch.argmax(logits, -1) for logits [B, V] (fp32, bf16 or fp16), bitwise.
    ``programs_per_row``: the tuning table's unless given (the result does not depend on it)."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.shape[1] >= 2**31:
        raise ValueError(f"greedy: logits {tuple(logits.shape)} is not [B, V] with 0 < V < 2**31")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if programs_per_row is None:
        programs_per_row = tuning.choices("sampling", tuning.device_key(logits))["programs_per_row"]
    chunk, S = splits(V, programs_per_row)
    part = torch.empty((2, B, S), dtype=torch.int32, device=logits.device) if S > 1 else out
    arrive = arrival_counters(logits.device, B) if S > 1 else out
    _greedy_kernel[(B, S)](
        logits, part, arrive, out, V, chunk, S, logits.stride(0),
        BLOCK=_BLOCK, BLOCK_S=triton.next_power_of_2(S), num_warps=4, **pdl_args(logits.device))
    return out


# -- constrained decoding: the allowed-token bitmask ---------------------------------------------------------

_MASK_WORDS = 64  # int32 mask words per program: 2048 logits, as the greedy kernel's block


@triton.jit
def _apply_token_mask_kernel(
    x_ptr, mask_ptr, V, W, s_xb, s_xv, s_mb,
    BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Program (row, block of BLOCK_W words): loads its words once, writes -inf at each refused token. The
    logits are never read, so an allowed token's value is untouched bit for bit."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    packed = tl.load(mask_ptr + row.to(tl.int64) * s_mb + words, mask=words < W, other=-1)
    bit = tl.arange(0, 32)
    refused = ((packed[:, None] >> bit[None, :]) & 1) == 0  # >> is arithmetic: bit 31 of a negative word is 1
    token = words[:, None] * 32 + bit[None, :]
    x = x_ptr + row.to(tl.int64) * s_xb + token.to(tl.int64) * s_xv
    tl.store(x, tl.full((BLOCK_W, 32), float("-inf"), x_ptr.dtype.element_ty), mask=refused & (token < V))


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """In place: logits[b, t] = -inf where bit ``t % 32`` of ``mask[b, t // 32]`` is 0; returns ``logits``.
    logits [B, V] (fp32, bf16 or fp16, any strides), mask int32 [B, ceil(V / 32)]; bits past V are ignored."""
    if logits.dim() != 2 or logits.shape[1] >= 2**31 - 32:
        raise ValueError(f"apply_token_mask: logits {tuple(logits.shape)} is not [B, V] with V < 2**31 - 32")
    B, V = logits.shape
    W = (V + 31) // 32
    if mask.dtype != torch.int32 or mask.shape != (B, W):
        raise ValueError(f"apply_token_mask: mask {tuple(mask.shape)} {mask.dtype} does not fit logits "
                         f"{tuple(logits.shape)} (int32 [B, ceil(V / 32)] expected)")
    if B == 0 or V == 0:
        return logits
    mask = mask.to(logits.device)
    if mask.stride(1) != 1:
        mask = mask.contiguous()
    _apply_token_mask_kernel[(B, triton.cdiv(W, _MASK_WORDS))](
        logits, mask, V, W, logits.stride(0), logits.stride(1), mask.stride(0),
        BLOCK_W=_MASK_WORDS, num_warps=4, **pdl_args(logits.device))
    return logits
