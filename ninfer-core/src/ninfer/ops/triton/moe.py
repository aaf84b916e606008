"""Routed MoE experts on the GPU: grouped GEMMs over the fused expert bank, gathered through an expert-grouped
routing (``moe_align.align_by_expert``), in three launches after the alignment.

1. ``_gate_up_kernel``: a program owns one block of pairs (all routed to one expert) and BLOCK_N intermediate
   columns. It gathers the pairs' token rows of x, multiplies them by that expert's gate rows and the matching
   up rows of ``gate_up`` [E, 2I, H] in the same K loop, and stores silu(gate)·up (rounded where the unfused
   ops round) to a per-pair cache [N·k, I]: no [N·k, 2I] intermediate is written and read back.
2. ``_down_kernel``: the same grouping over ``down`` [E, H, I]; its epilogue scales each pair's row by its
   routing weight and stores it, in the activations' dtype, to a per-pair [N·k, H] buffer.
3. ``moe_shared.sum_slots``: out[t] = the sum of the k rows of token t, in fp32 and in slot order.

The sum is a separate small step rather than atomic adds into [N, H] from the down kernel: atomics would add
the k contributions in whatever order the programs finish, so a token's output would change from run to run
in its last bits; here it is the same on every run, and independent of which other tokens share the batch.

``moe_block`` runs the whole decode-sized MoE block this way with the shared expert as expert E of the grouped
kernels (one slot more per token, its weight sigmoid(gate); ``_expert_offset`` points expert E at the shared
matrices) after one program that routes and groups (``moe_route_align``): four launches, where the block's parts
take seven (route, align, the shared expert's two linears, the three above). A one-token call (decode at B=1)
needs no grouping, since a token's experts are distinct: ``moe_one_token`` routes it and runs its gate_up and
down in one launch, with the tiles and sums the two kernels here share with it (``moe_shared``). A caller
that adds the slot rows itself (the next ``add_rms_norm``, ``summed=False``) saves the slot sum's launch as well.

Accumulation is fp32; fp32 inputs multiply in full fp32 (``input_precision="ieee"``, not TF32). Block sizes
follow the token count (``moe_shared.default_config``, from the tuning table ``tables/moe.json``): BLOCK_M stays
16 while each expert sees few rows and grows for long prefill chunks. Grids depend on the shapes only and the
used-block count is read on the device, so a call is CUDA-graph capturable at a fixed token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton import moe_one_token, moe_route_align, tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.moe_align import align_by_expert
from ninfer.ops.triton.moe_layout import ExpertBlocks
from ninfer.ops.triton.moe_shared import (
    MoeConfig,
    as_expert,
    default_config,
    down_acc,
    expert_base,
    gate_up_tile,
    precision,
    shared_args,
    store_weighted,
    sum_slots,
    tile,
)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _expert_offset(block_expert_ptr, s_we, bank_experts, shared_off, SHARED: tl.constexpr):
    """``expert_base`` of the expert a block of the grouping holds."""
    return expert_base(tl.load(block_expert_ptr), s_we, bank_experts, shared_off, SHARED)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, pairs_ptr, experts_ptr, used_ptr, numel, INTER, H,
    s_xm, s_xk, s_we, s_wn, s_wk, s_hm, bank_experts, shared_off,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, SHARED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_prologue(USE_PDL)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = _expert_offset(experts_ptr + pid_m, s_we, bank_experts, shared_off, SHARED)
    valid = pair < numel
    hidden = gate_up_tile(x_ptr, w_ptr + expert, (pair // TOP_K).to(tl.int64), valid, pid_n, INTER, H, s_xm, s_xk,
                          s_wn, s_wk, h_ptr.dtype.element_ty, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = h_ptr + pair.to(tl.int64)[:, None] * s_hm + nn[None, :]
    tl.store(out, hidden, mask=valid[:, None] & (nn < INTER)[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, pairs_ptr, experts_ptr, used_ptr, route_ptr, numel, H, INTER,
    s_hm, s_we, s_wn, s_wk, s_ym, bank_experts, shared_off,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    SHARED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_prologue(USE_PDL)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < numel
    row = pair.to(tl.int64)
    expert = _expert_offset(experts_ptr + pid_m, s_we, bank_experts, shared_off, SHARED)
    route = tl.load(route_ptr + row, mask=valid, other=0.0).to(tl.float32)  # with the expert: one round trip
    w_tile = w_ptr + expert + (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None] * s_wn
    acc = down_acc(h_ptr + row[:, None] * s_hm, w_tile, valid, pid_n, H, INTER, s_wk, BLOCK_M, BLOCK_N, BLOCK_K,
                   PRECISION)
    store_weighted(y_ptr + row[:, None] * s_ym, acc, route, valid, pid_n, H, BLOCK_N)


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, *, out: torch.Tensor | None = None, config: MoeConfig | None = None,
                shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts (``ninfer.ops.moe.moe_experts``, which checks the shapes): x [N, H], ``gate_up``
    [E, 2I, H], ``down`` [E, H, I], ``ids`` / ``weights`` [N, k] -> [N, H] in x's dtype (into ``out`` if
    given). ``config`` overrides the tiles chosen by token count. ``shared`` [N, H] / ``shared_gate`` [N, 1]:
    the shared expert's output and gate logit, added by the last step (sigmoid(gate) * shared)."""
    if not (x.dtype == gate_up.dtype == down.dtype) or x.dtype not in _DTYPES:
        raise ValueError(f"moe_experts: x, gate_up and down must share one of bf16/fp16/fp32, got {x.dtype}, "
                         f"{gate_up.dtype}, {down.dtype}")
    N, H = x.shape
    E, top_k = gate_up.shape[0], ids.shape[1]
    if out is None:
        out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    cfg = config or default_config(N, x.dtype, tuning.device_key(x))
    blocks = align_by_expert(ids, E, cfg.block_m)
    per_pair = _grouped(x, gate_up, down, blocks, top_k, weights.reshape(-1).contiguous(), cfg)
    sum_slots(per_pair, out, top_k, shared, shared_gate)
    return out


def moe_block(x: torch.Tensor, logits: torch.Tensor, shared_gate: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor, top_k: int, *,
              summed: bool = True, one_launch: bool = True) -> torch.Tensor:
    """The sparse MoE block (``ninfer.ops.moe.moe_block``, which checks the shapes). A decode-sized call (up to
    ``moe_route_align.MAX_TOKENS`` tokens, the shared expert shaped as one routed expert) is four launches: the
    routing, the shared expert as slot k of every token (expert E, weight sigmoid(gate)) and the grouping in one
    (``moe_route_align``), then the grouped kernels and the slot sum over k + 1 slots. A one-token call
    (``one_launch``) is two: its k + 1 experts are distinct, so nothing needs grouping, and one launch routes it
    and runs gate_up and down (``moe_one_token``). With ``summed=False``
    the slot sum is left to the caller (``ninfer.ops.add_rms_norm`` takes the rows as terms): the weighted slot
    rows [N, k + 1, H] come back. Other calls run the block as its parts (``moe_block_ref``; [N, 1, H] when not
    summed)."""
    from ninfer.ops.moe import moe_block_ref  # the reference module dispatches here: imported on use

    N, H = x.shape
    folded = (moe_route_align.fits(N, gate_up.shape[0], top_k, shared=True) and as_expert(gate_up, shared_gate_up)
              and as_expert(down, shared_down) and x.dtype == gate_up.dtype == down.dtype == logits.dtype
              and x.dtype in _DTYPES)
    if not folded:
        out = moe_block_ref(x, logits, shared_gate, gate_up, down, shared_gate_up, shared_down, top_k)
        return out if summed else out[:, None]
    cfg = default_config(N, x.dtype, tuning.device_key(x))
    slots, shared = top_k + 1, (shared_gate_up, shared_down)
    if N == 1 and one_launch and moe_one_token.fits(x, gate_up, down, shared_gate_up, shared_down):
        per_pair = moe_one_token.moe_one_token(x, logits, shared_gate, gate_up, down, shared_gate_up, shared_down,
                                               top_k)
    else:
        weights, _, blocks = moe_route_align.route_align(logits, top_k, cfg.block_m, shared_gate)
        per_pair = _grouped(x, gate_up, down, blocks, slots, weights.reshape(-1), cfg, shared)
    if not summed:
        return per_pair.view(N, slots, H)
    out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    sum_slots(per_pair, out, slots, None, None)
    return out


def _grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, blocks: ExpertBlocks, slots: int,
             route: torch.Tensor, cfg: MoeConfig, shared: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> torch.Tensor:
    """Both grouped GEMMs: the weighted output of every (token, slot) pair, [N·slots, H]."""
    hidden = torch.empty((blocks.numel, gate_up.shape[1] // 2), dtype=x.dtype, device=x.device)
    per_pair = torch.empty((blocks.numel, x.shape[1]), dtype=x.dtype, device=x.device)
    gate_up_grouped(x, gate_up, blocks, slots, hidden, cfg, None if shared is None else shared[0])
    down_grouped(hidden, down, blocks, route, per_pair, cfg, None if shared is None else shared[1])
    return per_pair


def gate_up_grouped(x: torch.Tensor, gate_up: torch.Tensor, blocks: ExpertBlocks, top_k: int, hidden: torch.Tensor,
                    cfg: MoeConfig, shared: torch.Tensor | None = None) -> None:
    """hidden[p] = silu(x[p // k] Wg_e^T) * (x[p // k] Wu_e^T) for every pair p routed to expert e; with
    ``shared`` [2I, H], expert E is that matrix."""
    H, inter = x.shape[1], hidden.shape[1]
    block_n = tile(cfg.block_n // 2, inter)
    _gate_up_kernel[(blocks.max_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, hidden, blocks.sorted_pairs, blocks.block_experts, blocks.used, blocks.numel, inter, H,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), hidden.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=tile(cfg.block_k, H),
        PRECISION=precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **shared_args(gate_up, shared), **pdl_args(x.device))


def down_grouped(hidden: torch.Tensor, down: torch.Tensor, blocks: ExpertBlocks, route: torch.Tensor,
                 per_pair: torch.Tensor, cfg: MoeConfig, shared: torch.Tensor | None = None) -> None:
    """per_pair[p] = route[p] * (hidden[p] Wd_e^T) for every pair p routed to expert e; with ``shared``
    [H, I], expert E is that matrix."""
    inter, H = hidden.shape[1], per_pair.shape[1]
    block_n = tile(cfg.block_n, H)
    _down_kernel[(blocks.max_blocks, triton.cdiv(H, block_n))](
        hidden, down, per_pair, blocks.sorted_pairs, blocks.block_experts, blocks.used, route, blocks.numel,
        H, inter, hidden.stride(0), down.stride(0), down.stride(1), down.stride(2), per_pair.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=tile(cfg.block_k, inter),
        PRECISION=precision(hidden.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **shared_args(down, shared), **pdl_args(hidden.device))
