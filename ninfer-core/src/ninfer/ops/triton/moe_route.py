"""The MoE router's top-k in one launch (``ninfer.ops.moe.moe_route``): a program per token loads its E logits,
takes the fp32 softmax, picks the k largest probabilities one after another (the lowest expert number first
among equal ones) and writes them renormalised to sum to 1, in the logits' dtype, with their expert numbers.

The unfused route is a softmax, a top-k, a sum, a division and a cast: five or six small launches per MoE layer
of a decode step. Probabilities are fp32 as in the reference; the sum of a row is taken in a different order, so
a probability may differ in its last bits and two experts within that distance may swap places.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, s_l, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    token = tl.program_id(0).to(tl.int64)
    ee = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    pdl_prologue(USE_PDL)
    z = tl.load(logits_ptr + token * s_l + ee, mask=ee < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(ee < E, p, -1.0)  # padding is never picked
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        pick = tl.min(tl.where(p == best, ee, BLOCK_E), 0)
        top = tl.where(kk == j, best, top)
        ids = tl.where(kk == j, pick.to(tl.int64), ids)
        p = tl.where(ee == pick, -1.0, p)
    top = top / tl.sum(tl.where(kk < TOP_K, top, 0.0), 0)
    tl.store(w_ptr + token * TOP_K + kk, top.to(w_ptr.dtype.element_ty), mask=kk < TOP_K)
    tl.store(ids_ptr + token * TOP_K + kk, ids, mask=kk < TOP_K)


def moe_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (rows may be strided, e.g. a view of a fused projection) -> (weights [N, k] in the
    logits' dtype, expert ids [N, k] int64); shapes are checked by ``ninfer.ops.moe.moe_route``."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    N, E = logits.shape
    weights = torch.empty((N, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((N, top_k), dtype=torch.int64, device=logits.device)
    if N:
        _route_kernel[(N,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
                            num_warps=4 if E <= 512 else 8, **pdl_args(logits.device))
    return weights, ids
