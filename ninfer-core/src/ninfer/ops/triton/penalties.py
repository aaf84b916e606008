"""Repetition, frequency and presence penalties on the GPU (``ninfer.ops.penalties``): one launch over
(penalized row, block of the vocabulary); each program reads its block of logits, of the row's output counts
and prompt marks, and writes the penalized logits back in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue

_BLOCK = 2048


@triton.jit
def _apply_penalties_kernel(
    x_ptr, sel_ptr, hist_ptr, counts_ptr, prompt_ptr, pres_ptr, freq_ptr, rep_ptr, V, s_xb, s_hb,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    row = tl.load(sel_ptr + m)
    h = tl.load(hist_ptr + m)
    presence = tl.load(pres_ptr + m)
    frequency = tl.load(freq_ptr + m)
    repetition = tl.load(rep_ptr + m)
    x_at = x_ptr + row * s_xb + cols
    x = tl.load(x_at, mask=ok, other=0.0).to(tl.float32)
    count = tl.load(counts_ptr + h * s_hb + cols, mask=ok, other=0)
    seen = (tl.load(prompt_ptr + h * s_hb + cols, mask=ok, other=0) != 0) | (count > 0)
    rep = tl.where(seen, repetition, 1.0)
    x = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)  # rounded as torch divides
    x = x - frequency * count.to(tl.float32) - presence * (count > 0).to(tl.float32)
    tl.store(x_at, x.to(x_ptr.dtype.element_ty), mask=ok)


def apply_penalties(logits: torch.Tensor, sel: torch.Tensor, hist: torch.Tensor, counts: torch.Tensor,
                    prompt: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """In place, as ``ninfer.ops.penalties.apply_penalties`` (its checks done): logits [N, V] with unit stride
    along V; counts int32 and prompt bool [H, V] contiguous."""
    if logits.stride(1) != 1:
        raise ValueError("apply_penalties: logits need unit stride along the vocabulary")
    dev = logits.device
    M, V = sel.shape[0], logits.shape[1]
    counts, prompt = counts.contiguous(), prompt.contiguous()
    # Per-row arguments are read at offset m: columns of one [M, 3] tensor become contiguous first.
    rows = [t.to(dev, dtype).contiguous() for t, dtype in ((sel, torch.int64), (hist, torch.int64),
                                                           (presence, torch.float32), (frequency, torch.float32),
                                                           (repetition, torch.float32))]
    _apply_penalties_kernel[(M, triton.cdiv(V, _BLOCK))](
        logits, rows[0], rows[1], counts, prompt.view(torch.uint8), *rows[2:],
        V, logits.stride(0), counts.stride(0), BLOCK=_BLOCK, num_warps=4, **pdl_args(dev))
    return logits
