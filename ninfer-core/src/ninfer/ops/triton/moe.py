"""Routed MoE experts on the GPU: grouped GEMMs over the fused expert bank, gathered through an expert-grouped
routing (``moe_align.align_by_expert``), in three launches after the alignment.

1. ``_gate_up_kernel``: a program owns one block of pairs (all routed to one expert) and BLOCK_N intermediate
   columns. It gathers the pairs' token rows of x, multiplies them by that expert's gate rows and the matching
   up rows of ``gate_up`` [E, 2I, H] in the same K loop, and stores silu(gate)·up (rounded where the unfused
   ops round) to a per-pair cache [N·k, I]: no [N·k, 2I] intermediate is written and read back.
2. ``_down_kernel``: the same grouping over ``down`` [E, H, I]; its epilogue scales each pair's row by its
   routing weight and stores it, in the activations' dtype, to a per-pair [N·k, H] buffer.
3. ``_sum_slots_kernel``: out[t] = the sum of the k rows of token t, in fp32 and in slot order.

The sum is a separate small step rather than atomic adds into [N, H] from the down kernel: atomics would add
the k contributions in whatever order the programs finish, so a token's output would change from run to run
in its last bits; here it is the same on every run, and independent of which other tokens share the batch.

``moe_block`` runs the whole decode-sized MoE block this way with the shared expert as expert E of the grouped
kernels (one slot more per token, its weight sigmoid(gate); ``_expert_offset`` points expert E at the shared
matrices) after one program that routes and groups (``moe_route_align``): four launches, where the block's parts
take seven (route, align, the shared expert's two linears, the three above). A one-token call (decode at B=1)
needs no grouping, since a token's experts are distinct: ``moe_one_token`` routes it and runs its gate_up and
down in one launch, with the tiles and sums of the two kernels here (``_gate_up_tile``, ``_down_acc``). A caller
that adds the slot rows itself (the next ``add_rms_norm``, ``summed=False``) saves the slot sum's launch as well.

Accumulation is fp32; fp32 inputs multiply in full fp32 (``input_precision="ieee"``, not TF32). Block sizes
follow the token count (``default_config``): BLOCK_M stays 16 while each expert sees few rows and grows for
long prefill chunks. Grids depend on the shapes only and the used-block count is read on the device, so a call
is CUDA-graph capturable at a fixed token count.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ninfer.ops.triton._pdl import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.moe_align import ExpertBlocks, align_by_expert

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@attrs.frozen
class MoeConfig:
    """Tile sizes of both grouped GEMMs. ``block_n`` counts output columns of a program: for the gate_up GEMM
    it is split between the gate and the up half, so a program reads as many weight rows in both."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# By token count: vLLM's tuned H200 table for E=512, I=512 (the 35B-A3B geometry but E), as summarised in
# shared/reference/kernels_quant.md section 3.1, except the decode rows (1 and up to 16 tokens), which are the
# best of our own sweep at 1 and 8 tokens (benchmarks/gpu_check.py "moe"; docs/performance.md, issue 21).
_BY_TOKENS: tuple[tuple[int, MoeConfig], ...] = (
    (1, MoeConfig(16, 64, 128, 4, 4)),
    (16, MoeConfig(16, 64, 64, 4, 4)),
    (256, MoeConfig(16, 128, 128, 4, 3)),
    (512, MoeConfig(16, 256, 128, 8, 2)),
    (1024, MoeConfig(32, 128, 64, 4, 3)),
    (3072, MoeConfig(64, 128, 64, 4, 3)),
)
_LARGEST = MoeConfig(128, 256, 64, 8, 4)
FP32_BLOCK_K, FP32_STAGES = 32, 2  # fp32 tiles take twice the shared memory: a shorter K step, fewer stages


def default_config(tokens: int, dtype: torch.dtype) -> MoeConfig:
    """The tiles for a call over ``tokens`` tokens; fp32 tiles take twice the shared memory, so they use a
    shorter K step and at most two pipeline stages."""
    cfg = next((c for limit, c in _BY_TOKENS if tokens <= limit), _LARGEST)
    if dtype == torch.float32:
        cfg = attrs.evolve(cfg, block_k=min(cfg.block_k, FP32_BLOCK_K), num_stages=min(cfg.num_stages, FP32_STAGES))
    return cfg


@triton.jit
def _expert_base(expert, s_we, bank_experts, shared_off, SHARED: tl.constexpr):
    """Where ``expert``'s matrices start, in elements from the bank's base; with SHARED, expert ``bank_experts``
    is the shared expert, ``shared_off`` elements away (its weights keep the bank's row and column strides)."""
    expert = expert.to(tl.int64)
    if SHARED:
        return tl.where(expert == bank_experts, shared_off, expert * s_we)
    return expert * s_we


@triton.jit
def _expert_offset(block_expert_ptr, s_we, bank_experts, shared_off, SHARED: tl.constexpr):
    """``_expert_base`` of the expert a block of the grouping holds."""
    return _expert_base(tl.load(block_expert_ptr), s_we, bank_experts, shared_off, SHARED)


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
    hidden = _gate_up_tile(x_ptr, w_ptr + expert, (pair // TOP_K).to(tl.int64), valid, pid_n, INTER, H, s_xm, s_xk,
                           s_wn, s_wk, h_ptr.dtype.element_ty, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = h_ptr + pair.to(tl.int64)[:, None] * s_hm + nn[None, :]
    tl.store(out, hidden, mask=valid[:, None] & (nn < INTER)[None, :])


@triton.jit
def _gate_up_tile(x_ptr, w_ptr, token, valid, pid_n, INTER, H, s_xm, s_xk, s_wn, s_wk, dtype: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """silu(x Wg^T) * (x Wu^T) of the rows ``token`` (where ``valid``) for intermediate column block ``pid_n`` of the
    expert whose gate rows start at ``w_ptr`` (its up rows INTER rows on), rounded as the unfused ops round."""
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = nn < INTER
    kk = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + token[:, None] * s_xm + kk[None, :] * s_xk
    gate_tile = w_ptr + nn.to(tl.int64)[:, None] * s_wn + kk[None, :] * s_wk
    up_tile = gate_tile + INTER * s_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = kk < H - k0
        a = tl.load(x_tile, mask=valid[:, None] & mask_k[None, :], other=0.0)
        g = tl.load(gate_tile, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        u = tl.load(up_tile, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc_gate = tl.dot(a, tl.trans(g), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, tl.trans(u), acc_up, input_precision=PRECISION)
        x_tile += BLOCK_K * s_xk
        gate_tile += BLOCK_K * s_wk
        up_tile += BLOCK_K * s_wk
    # Round as the unfused ops do: both projections, silu(gate), the product.
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (act * acc_up.to(dtype).to(tl.float32)).to(dtype)


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
    acc = _down_acc(h_ptr + row[:, None] * s_hm, w_tile, valid, pid_n, H, INTER, s_wk, BLOCK_M, BLOCK_N, BLOCK_K,
                    PRECISION)
    _store_weighted(y_ptr + row[:, None] * s_ym, acc, route, valid, pid_n, H, BLOCK_N)


@triton.jit
def _down_acc(h_rows, w_rows, valid, pid_n, H, INTER, s_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, H_L2: tl.constexpr = False):
    """The fp32 products of the hidden rows at ``h_rows`` [BLOCK_M, 1] (where ``valid``) with the down rows at
    ``w_rows`` [BLOCK_N, 1] (output column block ``pid_n``) over the INTER intermediate columns; ``H_L2``: the hidden
    loads bypass L1 (".cg")."""
    mask_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N) < H
    kk = tl.arange(0, BLOCK_K)
    h_tile = h_rows + kk[None, :]
    w_tile = w_rows + kk[None, :] * s_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        mask_k = kk < INTER - k0
        if H_L2:
            a = tl.load(h_tile, mask=valid[:, None] & mask_k[None, :], other=0.0, cache_modifier=".cg")
        else:
            a = tl.load(h_tile, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_tile, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        h_tile += BLOCK_K
        w_tile += BLOCK_K * s_wk
    return acc


@triton.jit
def _store_weighted(y_rows, acc, route, valid, pid_n, H, BLOCK_N: tl.constexpr):
    """The expert's output rounded as the unfused projection does, then scaled by the pair's routing weight,
    stored at ``y_rows`` [BLOCK_M, 1] (where ``valid``), output column block ``pid_n``."""
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = y_rows.dtype.element_ty
    y = (acc.to(dtype).to(tl.float32) * route[:, None]).to(dtype)
    tl.store(y_rows + nn[None, :], y, mask=valid[:, None] & (nn < H)[None, :])


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, shared_ptr, gate_ptr, H, s_om, s_sm, s_gm, TOP_K: tl.constexpr,
                      BLOCK: tl.constexpr, HAS_SHARED: tl.constexpr, USE_PDL: tl.constexpr = False):
    token = tl.program_id(0).to(tl.int64)
    cc = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cc < H
    pdl_prologue(USE_PDL)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + slot) * H + cc, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if HAS_SHARED:  # + sigmoid(gate) * shared, rounded where the unfused ops round
        g = tl.load(gate_ptr + token * s_gm).to(tl.float32)
        scale = tl.sigmoid(g).to(dtype).to(tl.float32)
        s = tl.load(shared_ptr + token * s_sm + cc, mask=mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + (scale * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * s_om + cc, out, mask=mask)


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
    cfg = config or default_config(N, x.dtype)
    blocks = align_by_expert(ids, E, cfg.block_m)
    per_pair = _grouped(x, gate_up, down, blocks, top_k, weights.reshape(-1).contiguous(), cfg)
    _sum_slots(per_pair, out, top_k, shared, shared_gate)
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
    from ninfer.ops.moe import moe_block_ref
    from ninfer.ops.triton import moe_one_token, moe_route_align

    N, H = x.shape
    folded = (moe_route_align.fits(N, gate_up.shape[0], top_k, shared=True) and _as_expert(gate_up, shared_gate_up)
              and _as_expert(down, shared_down) and x.dtype == gate_up.dtype == down.dtype == logits.dtype
              and x.dtype in _DTYPES)
    if not folded:
        out = moe_block_ref(x, logits, shared_gate, gate_up, down, shared_gate_up, shared_down, top_k)
        return out if summed else out[:, None]
    cfg = default_config(N, x.dtype)
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
    _sum_slots(per_pair, out, slots, None, None)
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


def _sum_slots(per_pair: torch.Tensor, out: torch.Tensor, slots: int, shared: torch.Tensor | None,
               shared_gate: torch.Tensor | None) -> None:
    N, H = out.shape
    block = min(1024, triton.next_power_of_2(H))
    has_shared = shared is not None
    if has_shared and shared.stride(1) != 1:
        shared = shared.contiguous()
    _sum_slots_kernel[(N, triton.cdiv(H, block))](
        per_pair, out, shared if has_shared else out, shared_gate if has_shared else out, H, out.stride(0),
        shared.stride(0) if has_shared else 0, shared_gate.stride(0) if has_shared else 0, TOP_K=slots,
        BLOCK=block, HAS_SHARED=has_shared, num_warps=4, **pdl_args(out.device))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # only fp32 operands are affected


def _tile(width: int, dim: int) -> int:
    return max(16, min(width, triton.next_power_of_2(dim)))


def _as_expert(bank: torch.Tensor, shared: torch.Tensor) -> bool:
    """Whether ``shared`` is laid out as one expert of ``bank`` [E, ...]: its shape, strides and dtype."""
    return shared.shape == bank.shape[1:] and shared.stride() == bank.stride()[1:] and shared.dtype == bank.dtype


def _shared_args(bank: torch.Tensor, shared: torch.Tensor | None) -> dict:
    """The kernels' arguments that make expert E (one past ``bank`` [E, ...]) the ``shared`` matrix."""
    if shared is None:
        return {"bank_experts": bank.shape[0], "shared_off": 0, "SHARED": False}
    offset, rem = divmod(shared.data_ptr() - bank.data_ptr(), bank.element_size())
    if rem or not _as_expert(bank, shared):
        raise ValueError(f"moe: the shared expert {tuple(shared.shape)} {shared.dtype} must be laid out as one "
                         f"expert of the bank {tuple(bank.shape)} {bank.dtype}")
    return {"bank_experts": bank.shape[0], "shared_off": offset, "SHARED": True}


def gate_up_grouped(x: torch.Tensor, gate_up: torch.Tensor, blocks: ExpertBlocks, top_k: int, hidden: torch.Tensor,
                    cfg: MoeConfig, shared: torch.Tensor | None = None) -> None:
    """hidden[p] = silu(x[p // k] Wg_e^T) * (x[p // k] Wu_e^T) for every pair p routed to expert e; with
    ``shared`` [2I, H], expert E is that matrix."""
    H, inter = x.shape[1], hidden.shape[1]
    block_n = _tile(cfg.block_n // 2, inter)
    _gate_up_kernel[(blocks.max_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, hidden, blocks.sorted_pairs, blocks.block_experts, blocks.used, blocks.numel, inter, H,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), hidden.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=_tile(cfg.block_k, H),
        PRECISION=_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_shared_args(gate_up, shared), **pdl_args(x.device))


def down_grouped(hidden: torch.Tensor, down: torch.Tensor, blocks: ExpertBlocks, route: torch.Tensor,
                 per_pair: torch.Tensor, cfg: MoeConfig, shared: torch.Tensor | None = None) -> None:
    """per_pair[p] = route[p] * (hidden[p] Wd_e^T) for every pair p routed to expert e; with ``shared``
    [H, I], expert E is that matrix."""
    inter, H = hidden.shape[1], per_pair.shape[1]
    block_n = _tile(cfg.block_n, H)
    _down_kernel[(blocks.max_blocks, triton.cdiv(H, block_n))](
        hidden, down, per_pair, blocks.sorted_pairs, blocks.block_experts, blocks.used, route, blocks.numel,
        H, inter, hidden.stride(0), down.stride(0), down.stride(1), down.stride(2), per_pair.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=_tile(cfg.block_k, inter),
        PRECISION=_precision(hidden.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_shared_args(down, shared), **pdl_args(hidden.device))
