"""``moe_align.align_by_expert`` for small routings as one Triton program: one launch instead of the torch
steps' two dozen, which dominate a decode-size MoE call.

The layout is the torch steps' exactly (``moe_align``'s docstring). The program holds the routing's ``numel``
pairs in registers, one lane per pair (BLOCK lanes, the next power of two), and:

1. sorts the keys ``expert · BLOCK + pair`` (padding lanes sort last): pairs grouped by expert in ascending
   expert order, in pair order within an expert, as the torch steps' stable argsort;
2. finds where each expert's run starts in that order (a scan carrying the start of the last run), so the
   pair at sorted position s has ``rank = s - run start`` within its expert;
3. a pair *heads a block* when ``rank % block_m == 0``: an expert with c pairs has ceil(c / block_m) heads,
   one per block of its padded segment. With H(s) the heads at positions <= s, ``H(s) - rank // block_m - 1``
   heads belong to earlier experts, one block each, so the pair lands at ``block_m`` times that, plus
   ``rank``; a head writes its block's expert, and ``used`` = ``block_m`` · (all heads);
4. fills ``sorted_pairs`` with the sentinel and ``block_experts`` with 0 (unused blocks read as expert 0),
   waits for every thread's fill (``tl.debug_barrier``, which also makes global writes visible within the
   program), then scatters.

Sizes depend on the shapes only and nothing is read back to the host, so it is CUDA-graph capturable. A pair
whose id is outside [0, experts) (a broken routing: the torch steps fail on it, which a graph cannot report)
is left out of the layout, so nothing downstream reads or writes out of bounds for it.

``MAX_PAIRS`` = 2048 (256 decode tokens at top-8) bounds the routing: larger routings still compile without
spills up to a point (docs/kernels.md has the register figures), but the sort runs on one SM with work
growing as n·log²n, while from a few hundred tokens on the grouped GEMMs dwarf the launches it saves: past
2048 pairs the torch steps run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.moe_layout import ExpertBlocks, capacity

MAX_PAIRS = 2048
_PAIRS_PER_THREAD = 4
_PAD_KEY = tl.constexpr(2**31 - 1)  # above every pair's key, so padding lanes sort last


@triton.jit
def _last_run_start(expert_a, start_a, expert_b, start_b):
    """Scan step over experts in ascending order: (last expert, where its run starts). When both halves end in
    the same expert, the right half is all that expert and its run began in the left half."""
    return expert_b, tl.where(expert_a == expert_b, start_a, start_b)


@triton.jit
def _align_kernel(
    ids_ptr, pairs_ptr, experts_ptr, used_ptr, numel, experts, top_k, s_in, s_ik, cap, max_blocks,
    BLOCK: tl.constexpr, FILL: tl.constexpr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    align_pairs(ids_ptr, pairs_ptr, experts_ptr, used_ptr, numel, experts, top_k, s_in, s_ik, cap, max_blocks,
                BLOCK, FILL, BLOCK_M)


@triton.jit
def align_pairs(ids_ptr, pairs_ptr, experts_ptr, used_ptr, numel, experts, top_k, s_in, s_ik, cap, max_blocks,
                BLOCK: tl.constexpr, FILL: tl.constexpr, BLOCK_M: tl.constexpr):
    """The whole layout (module docstring) from the routing at ``ids_ptr``, by one program; also called by the
    fused router (``moe_route_align``) once its ids are written."""
    lane = tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + (lane // top_k) * s_in + (lane % top_k) * s_ik, mask=lane < numel, other=-1)
    routed = (expert >= 0) & (expert < experts)
    key = tl.sort(tl.where(routed, expert.to(tl.int32) * BLOCK + lane, _PAD_KEY))
    # From here a lane is a sorted position: its pair, expert, and place in its expert's run.
    real = key != _PAD_KEY
    pair = key % BLOCK
    expert = key // BLOCK
    _, run_start = tl.associative_scan((expert, lane), 0, _last_run_start)
    rank = lane - run_start
    head = real & (rank % BLOCK_M == 0)
    heads = tl.cumsum(head.to(tl.int32), 0)
    dest = (heads - rank // BLOCK_M - 1) * BLOCK_M + rank
    for p0 in range(0, cap, FILL):
        p = p0 + tl.arange(0, FILL)
        tl.store(pairs_ptr + p, tl.full((FILL,), 0, tl.int32) + numel, mask=p < cap)
        tl.store(experts_ptr + p, tl.zeros((FILL,), dtype=tl.int32), mask=p < max_blocks)
    tl.debug_barrier()  # every thread's fill lands before the scatter overwrites parts of it
    tl.store(pairs_ptr + dest, pair, mask=real)
    tl.store(experts_ptr + dest // BLOCK_M, expert, mask=head)
    tl.store(used_ptr, tl.sum(head.to(tl.int32), 0) * BLOCK_M)


def launch_shape(numel: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the program for ``numel`` pairs."""
    block = max(16, triton.next_power_of_2(numel))
    return block, max(1, min(32, block // (32 * _PAIRS_PER_THREAD)))


def max_experts(numel: int) -> int:
    """The most experts the kernel takes for ``numel`` pairs: its int32 sort keys ``expert · BLOCK + pair``
    stay below the padding key."""
    return (2**31 - 2) // launch_shape(numel)[0]


def fits(numel: int, experts: int) -> bool:
    """Whether the kernel takes a routing of ``numel`` pairs over ``experts`` experts."""
    return 1 <= numel <= MAX_PAIRS and experts <= max_experts(numel)


def align_small(ids: torch.Tensor, experts: int, block_m: int) -> ExpertBlocks:
    """``align_by_expert`` (which checks ``ids``, ``experts`` and ``block_m``) in one launch, for routings that
    ``fits``."""
    numel = ids.numel()
    if not fits(numel, experts):
        raise ValueError(f"align_by_expert: the one-program kernel takes 1 to {MAX_PAIRS} pairs over at most "
                         f"{max_experts(max(numel, 1))} experts, got {numel} pairs over {experts} experts")
    dev = ids.device
    cap = capacity(numel, experts, block_m)
    sorted_pairs = torch.empty(cap, dtype=torch.int32, device=dev)
    block_experts = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    block, warps = launch_shape(numel)
    _align_kernel[(1,)](
        ids, sorted_pairs, block_experts, used, numel, experts, ids.shape[1], ids.stride(0), ids.stride(1), cap,
        cap // block_m, BLOCK=block, FILL=32 * _PAIRS_PER_THREAD * warps, BLOCK_M=block_m, num_warps=warps,
        num_stages=1, **pdl_args(dev))
    return ExpertBlocks(sorted_pairs, block_experts, used, block_m, numel)
