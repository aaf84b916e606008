"""The decode MoE block's routing in one launch: the router's top-k for every token, the shared expert as one
more slot of each token, and the grouping by expert that the grouped kernels read.

One program (a decode batch has few tokens):

1. loads the router logits of all N tokens as one [BLOCK_T, BLOCK_E] tile and picks each row's k largest one
   after another (the lowest expert number first among equal ones), weighted as the renormalised top-k of the
   fp32 softmax that ``moe_route`` takes (``route_rows``);
2. with ``shared_gate`` [N, 1], appends slot k to every token: the shared expert, numbered E (one past the
   bank), weighted by sigmoid(gate) rounded to the activations' dtype as the unfused block rounds it;
3. stores the routing (weights [N, S] in the logits' dtype, ids [N, S] int32, S = k or k + 1), waits for every
   thread's stores (``tl.debug_barrier`` also orders global memory within the program) and groups its N·S
   pairs by expert with ``moe_align_kernel.align_pairs``, the layout ``align_by_expert`` builds.

Sizes depend on the shapes only and nothing is read back to the host: a call is CUDA-graph capturable. The
separate route and alignment kernels are two launches of a few microseconds each per MoE layer of a decode
step, against one here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.moe_align_kernel import align_pairs, launch_shape, max_experts
from ninfer.ops.triton.moe_layout import ExpertBlocks, capacity

MAX_TOKENS = 16  # the logits tile stays [16, E]: decode batches and speculative verification rows
MAX_EXPERTS = 1024


@triton.jit
def route_rows(logits_ptr, gate_ptr, N, E, s_l, s_g, dtype: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """The routing of N tokens as [BLOCK_T, BLOCK_S] tiles (weights fp32, already rounded to ``dtype`` where the
    unfused block rounds; expert ids int32): each row's top-k (the lowest expert number first among equal ones),
    renormalised, and with SHARED the shared expert E as slot k. Padding rows repeat the last token. The MoE
    block's one-token kernel (``moe_one_token``) routes with it too, so both give the same experts.

    The softmax is monotonic and the top-k is renormalised, so the picks are the k largest logits and their
    weights exp(z_j - z_max) / sum over the picks of exp(z_i - z_max): no softmax over all E experts, whose max
    and sum are two more dependent reductions over the whole row."""
    tt = tl.arange(0, BLOCK_T)
    ee = tl.arange(0, BLOCK_E)
    ss = tl.arange(0, BLOCK_S)
    rows = tl.minimum(tt, N - 1).to(tl.int64)
    z = tl.load(logits_ptr + rows[:, None] * s_l + ee[None, :], mask=(ee < E)[None, :], other=0.0)
    # One key per expert orders by value, then by the lower expert number: each pick is one max reduction, where
    # value then index took two dependent ones. The value's bits map to an unsigned order (negative values
    # reversed) above the inverted expert number; padding and picked experts hold -1, below every key. 16-bit
    # logits (bf16, fp16) fit int32 keys, whose reductions move half the bits of int64 ones.
    WIDE: tl.constexpr = z.dtype.primitive_bitwidth > 16
    if WIDE:
        z = z.to(tl.float32)
        bits = z.to(tl.int32, bitcast=True).to(tl.int64)
        SIGN: tl.constexpr = 0x80000000
        SHIFT: tl.constexpr = 16
    else:
        bits = z.to(tl.int16, bitcast=True).to(tl.int32)
        SIGN: tl.constexpr = 0x8000
        SHIFT: tl.constexpr = 15
    mag = bits & (SIGN - 1)
    order = tl.where(bits < 0, SIGN - 1 - mag, SIGN + mag)
    key = tl.where((ee < E)[None, :], (order << SHIFT) | (BLOCK_E - 1 - ee)[None, :].to(bits.dtype), -1)
    top = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, 1)
        pick = (BLOCK_E - 1 - (best & ((1 << SHIFT) - 1))).to(tl.int32)
        o = best >> SHIFT
        value = tl.where(o >= SIGN, o - SIGN, (SIGN - 1 - o) | SIGN)
        if WIDE:
            value = value.to(tl.int32).to(tl.float32, bitcast=True)
        else:
            value = value.to(tl.int16).to(z.dtype, bitcast=True).to(tl.float32)
        if j == 0:
            largest = value
        top = tl.where(ss[None, :] == j, value[:, None], top)
        ids = tl.where(ss[None, :] == j, pick[:, None], ids)
        key = tl.where(key == best[:, None], -1, key)
    top = tl.where(ss[None, :] < TOP_K, tl.exp(top - largest[:, None]), 0.0)
    top = top / tl.sum(top, 1)[:, None]
    if SHARED:  # slot k: the shared expert, behind sigmoid(gate) in the activations' dtype
        g = tl.load(gate_ptr + rows * s_g).to(tl.float32)
        scale = tl.sigmoid(g).to(dtype).to(tl.float32)
        top = tl.where(ss[None, :] == TOP_K, scale[:, None], top)
        ids = tl.where(ss[None, :] == TOP_K, E, ids)
    return top.to(dtype).to(tl.float32), ids


@triton.jit
def _route_align_kernel(
    logits_ptr, gate_ptr, w_ptr, ids_ptr, pairs_ptr, experts_ptr, used_ptr, N, E, s_l, s_g, cap, max_blocks,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr, BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    SLOTS: tl.constexpr = TOP_K + SHARED
    tt = tl.arange(0, BLOCK_T)
    ss = tl.arange(0, BLOCK_S)
    pdl_prologue(USE_PDL)
    dtype = w_ptr.dtype.element_ty
    top, ids = route_rows(logits_ptr, gate_ptr, N, E, s_l, s_g, dtype, TOP_K, SHARED, BLOCK_T, BLOCK_E, BLOCK_S)
    out = tt[:, None] * SLOTS + ss[None, :]
    stored = (tt < N)[:, None] & (ss < SLOTS)[None, :]
    tl.store(w_ptr + out, top.to(dtype), mask=stored)
    tl.store(ids_ptr + out, ids, mask=stored)
    tl.debug_barrier()  # the routing is in memory before the alignment's lanes read it
    align_pairs(ids_ptr, pairs_ptr, experts_ptr, used_ptr, N * SLOTS, E + SHARED, SLOTS, SLOTS, 1, cap,
                max_blocks, BLOCK, FILL, BLOCK_M)


def fits(tokens: int, experts: int, top_k: int, shared: bool) -> bool:
    """Whether one program routes and groups ``tokens`` tokens over ``experts`` experts."""
    slots = top_k + shared
    return 1 <= tokens <= MAX_TOKENS and experts <= MAX_EXPERTS and top_k <= experts and \
        experts + shared <= max_experts(tokens * slots)


def route_align(logits: torch.Tensor, top_k: int, block_m: int, shared_gate: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
    """Router logits [N, E] (rows may be strided) -> (weights [N, S] in the logits' dtype, ids [N, S] int32, the
    pairs grouped by expert in blocks of ``block_m``), S = k, or k + 1 with ``shared_gate`` [N, 1]: the shared
    expert as expert E of every token (weight sigmoid(gate)). For routings that ``fits``."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    N, E = logits.shape
    shared = shared_gate is not None
    if not fits(N, E, top_k, shared):
        raise ValueError(f"route_align: one program routes 1 to {MAX_TOKENS} tokens over at most {MAX_EXPERTS} "
                         f"experts, got {N} tokens, {E} experts, top-{top_k}")
    slots = top_k + shared
    dev = logits.device
    weights = torch.empty((N, slots), dtype=logits.dtype, device=dev)
    ids = torch.empty((N, slots), dtype=torch.int32, device=dev)
    numel, experts = N * slots, E + shared
    cap = capacity(numel, experts, block_m)
    pairs = torch.empty(cap, dtype=torch.int32, device=dev)
    block_experts = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    block, pair_warps = launch_shape(numel)
    block_t, block_e = max(2, triton.next_power_of_2(N)), triton.next_power_of_2(E)
    warps = max(pair_warps, min(8, block_t * block_e // 512))
    _route_align_kernel[(1,)](
        logits, shared_gate if shared else logits, weights, ids, pairs, block_experts, used, N, E,
        logits.stride(0), shared_gate.stride(0) if shared else 0, cap, cap // block_m, TOP_K=top_k, SHARED=shared,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_S=triton.next_power_of_2(slots), BLOCK=block, FILL=32 * 4 * warps,
        BLOCK_M=block_m, num_warps=warps, num_stages=1, **pdl_args(dev))
    return weights, ids, ExpertBlocks(pairs, block_experts, used, block_m, numel)
