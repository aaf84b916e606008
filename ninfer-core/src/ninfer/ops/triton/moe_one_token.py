"""The MoE block of one token (decode at B=1) in one launch: gate_up and down of its k routed experts and the
shared expert, the down programs waiting on device counters instead of on the end of a gate_up launch.

As two launches (the grouped kernels of ``moe``) the pipe to DRAM drains between them: the down launch waits
until the last gate_up program has finished and its writes are flushed, then reads its expert and only then its
first weights. Here one 1-D grid holds both:

1. programs ``[0, S·U)`` (S = k + 1 slots, U intermediate column blocks per slot) are gate_up's: route the token
   (``route_rows``, as everywhere else; the shared expert's slot, the last, needs no routing), compute their
   slot's silu(gate)·up columns into ``hidden`` [S, I] and publish them with a release add on their slot's
   counter;
2. programs ``[S·U, S·U + S·D)`` (D output column blocks) are down's, slot-major: they route the token too
   (so they know their expert and weight without reading gate_up's), then spin on their slot's counter until its U gate_up programs have published, and compute
   and store their weighted slot row [S, H] as the grouped down kernel does. The last down program of a slot
   leaving zeroes its counters, so every launch (and graph replay) starts from zero.

Progress: a down program only waits for gate_up programs, which have lower program ids and so are dispatched
first; the successor kernel (PDL) is scheduled only after every program of this grid has started. The tiles,
roundings and sums are the grouped kernels' (``gate_up_tile``, ``down_acc``, ``store_weighted``).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ninfer.ops.launch import arrival_counters, pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.moe_route_align import route_rows
from ninfer.ops.triton.moe_shared import (
    FP32_BLOCK_K,
    FP32_STAGES,
    OneTokenTiles,
    as_expert,
    down_acc,
    expert_base,
    gate_up_tile,
    one_token_tiles,
    precision,
    shared_args,
    store_weighted,
    tile,
)


@triton.jit
def _pick_slot(top, ids, slot, BLOCK_S: tl.constexpr):
    """(expert, weight) of the token's ``slot`` from ``route_rows``' [2, BLOCK_S] tiles of one token."""
    pick = (tl.arange(0, 2)[:, None] == 0) & (tl.arange(0, BLOCK_S)[None, :] == slot)
    return tl.sum(tl.where(pick, ids, 0)), tl.sum(tl.where(pick, top, 0.0))


@triton.jit
def _one_token_kernel(
    x_ptr, gu_ptr, d_ptr, h_ptr, y_ptr, logits_ptr, gate_ptr, arrive_ptr, INTER, H,
    s_gue, s_gun, s_guk, s_de, s_dn, s_dk, s_l, s_g, bank_experts, shared_gu, shared_d,
    SLOTS: tl.constexpr, UP_BLOCKS: tl.constexpr, DOWN_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
    UP_N: tl.constexpr, UP_K: tl.constexpr, DOWN_N: tl.constexpr, DOWN_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr, PRECISION: tl.constexpr, SHARED_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pdl_prologue(USE_PDL)
    dtype = h_ptr.dtype.element_ty
    valid = tl.arange(0, BLOCK_M) == 0  # row 0 is the token; the others pad tl.dot's rows
    rows = tl.zeros((BLOCK_M, 1), dtype=tl.int64)
    if pid < SLOTS * UP_BLOCKS:
        slot = pid // UP_BLOCKS
        pid_n = pid % UP_BLOCKS
        expert = bank_experts  # the shared expert's slot starts its weights without waiting for the routing
        if (slot < SLOTS - 1) or not SHARED_FIRST:
            top, ids = route_rows(logits_ptr, gate_ptr, 1, bank_experts, s_l, s_g, dtype, SLOTS - 1, True, 2,
                                  BLOCK_E, BLOCK_S)
            expert, _ = _pick_slot(top, ids, slot, BLOCK_S)
        w_up = gu_ptr + expert_base(expert, s_gue, bank_experts, shared_gu, True)
        hidden = gate_up_tile(x_ptr, w_up, rows.reshape(BLOCK_M), valid, pid_n, INTER, H, 0, 1, s_gun, s_guk,
                              dtype, BLOCK_M, UP_N, UP_K, PRECISION)
        cols = pid_n * UP_N + tl.arange(0, UP_N)
        tl.store(h_ptr + slot * INTER + rows + cols[None, :], hidden, mask=valid[:, None] & (cols < INTER)[None, :])
        tl.debug_barrier()  # every thread's columns are written before the arrival is published
        tl.atomic_add(arrive_ptr + slot, 1, sem="release")
    else:
        q = pid - SLOTS * UP_BLOCKS
        slot = q // DOWN_BLOCKS
        pid_n = q % DOWN_BLOCKS
        top, ids = route_rows(logits_ptr, gate_ptr, 1, bank_experts, s_l, s_g, dtype, SLOTS - 1, True, 2, BLOCK_E,
                              BLOCK_S)
        expert, route = _pick_slot(top, ids, slot, BLOCK_S)
        nn = pid_n * DOWN_N + tl.arange(0, DOWN_N)
        w_rows = d_ptr + expert_base(expert, s_de, bank_experts, shared_d, True) + nn.to(tl.int64)[:, None] * s_dn
        seen = tl.atomic_add(arrive_ptr + slot, 0, sem="acquire")
        while seen < UP_BLOCKS:
            seen = tl.atomic_add(arrive_ptr + slot, 0, sem="acquire")
        tl.debug_barrier()  # no thread reads the slot's hidden row (from L2: ".cg") before the acquire above
        h_rows = h_ptr + slot * INTER + rows
        acc = down_acc(h_rows, w_rows, valid, pid_n, H, INTER, s_dk, BLOCK_M, DOWN_N, DOWN_K, PRECISION, True)
        store_weighted(y_ptr + slot * H + rows, acc, tl.zeros((BLOCK_M,), dtype=tl.float32) + route, valid, pid_n,
                       H, DOWN_N)
        if tl.atomic_add(arrive_ptr + SLOTS + slot, 1, sem="relaxed") == DOWN_BLOCKS - 1:
            tl.store(arrive_ptr + slot, 0)  # the slot's last reader: zero for the next launch
            tl.store(arrive_ptr + SLOTS + slot, 0)


def fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, shared_gate_up: torch.Tensor,
         shared_down: torch.Tensor) -> bool:
    """Whether ``moe_one_token`` takes this call: one token, contiguous activations, the shared expert laid out
    as one more expert of each bank."""
    return x.shape[0] == 1 and x.stride(1) == 1 and as_expert(gate_up, shared_gate_up) and \
        as_expert(down, shared_down)


def moe_one_token(x: torch.Tensor, logits: torch.Tensor, shared_gate: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor, top_k: int,
                  tiles: OneTokenTiles | None = None) -> torch.Tensor:
    """The k + 1 weighted slot rows [k + 1, H] of one token x [1, H] (``moe.moe_block(..., summed=False)[0]``),
    in one launch; for calls that ``fits``."""
    t = tiles or one_token_tiles(tuning.device_key(x))
    if x.dtype == torch.float32:  # the grouped kernels' fp32 caps
        t = attrs.evolve(t, up_k=min(t.up_k, FP32_BLOCK_K), down_k=min(t.down_k, FP32_BLOCK_K),
                         num_stages=min(t.num_stages, FP32_STAGES))
    H, inter = x.shape[1], down.shape[2]
    slots = top_k + 1
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    up_n, down_n = tile(t.up_n, inter), tile(t.down_n, H)
    down_k = tile(t.down_k, inter)
    up_blocks, down_blocks = triton.cdiv(inter, up_n), triton.cdiv(H, down_n)
    hidden = torch.empty((slots, inter), dtype=x.dtype, device=x.device)
    rows = torch.empty((slots, H), dtype=x.dtype, device=x.device)
    gu, dn = shared_args(gate_up, shared_gate_up), shared_args(down, shared_down)
    _one_token_kernel[(slots * (up_blocks + down_blocks),)](
        x, gate_up, down, hidden, rows, logits, shared_gate, arrival_counters(x.device, 2 * slots), inter, H,
        gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), down.stride(0), down.stride(1), down.stride(2),
        logits.stride(0), shared_gate.stride(0), gate_up.shape[0], gu["shared_off"], dn["shared_off"],
        SLOTS=slots, UP_BLOCKS=up_blocks, DOWN_BLOCKS=down_blocks, BLOCK_M=16, UP_N=up_n, UP_K=tile(t.up_k, H),
        DOWN_N=down_n, DOWN_K=down_k, BLOCK_E=triton.next_power_of_2(logits.shape[1]),
        BLOCK_S=triton.next_power_of_2(slots), PRECISION=precision(x.dtype),
        SHARED_FIRST=t.shared_first, num_warps=t.num_warps, num_stages=t.num_stages, **pdl_args(x.device))
    return rows
