"""Grouping a routing by expert for the grouped-GEMM MoE kernels (``ninfer.ops.triton.moe``).

A routing ``ids`` [N, k] names k experts per token; its N·k (token, slot) pairs are numbered ``p = token·k +
slot``. ``align_by_expert`` lays the pair numbers out grouped by expert (in pair order within an expert), each
expert's segment padded to a multiple of ``block_m`` with the sentinel ``N·k`` (which the kernels mask), so
every block of ``block_m`` entries belongs to one expert. Everything has a size fixed by the shapes alone and
nothing is read back to the host (no ``.item()``, ``bincount`` or ``nonzero``), so the step runs inside a CUDA
graph; how many blocks are used is a device tensor and the kernels' programs past it return at once.

Static size: each expert that is hit adds at most ``block_m - 1`` padding entries and at most ``min(E, N·k)``
experts are hit, so ``N·k + min(E, N·k)·(block_m - 1)`` entries, rounded up to whole blocks, always suffice
(tighter than ``N·k + E·(block_m - 1)`` when few tokens route, the decode case, where it launches far fewer
idle programs).

Two implementations build the same layout: a one-program Triton kernel (``moe_align_kernel``, one launch) for
small CUDA routings, the decode case, and this module's torch steps (about 25 launches) for larger ones and as
the reference. Which one runs depends on the device and the shapes only, so a captured graph keeps its choice.
"""

from __future__ import annotations

import torch

from ninfer.ops.triton.moe_layout import ExpertBlocks, capacity


def align_by_expert(ids: torch.Tensor, experts: int, block_m: int, *, kernel: bool | None = None) -> ExpertBlocks:
    """Group the pairs of the routing ``ids`` [N, k] (expert numbers in [0, experts)) by expert, each expert's
    segment padded to a multiple of ``block_m``. ``kernel``: None takes the one-program Triton kernel for CUDA
    ids that it fits (``moe_align_kernel.fits``: 1 to ``MAX_PAIRS`` pairs) and the torch steps otherwise; True
    asks for the kernel (CPU tensors need Triton's interpreter, ``TRITON_INTERPRET=1``); False the torch
    steps."""
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"align_by_expert: ids must be an [N, k] integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    if block_m < 1 or experts < 1:
        raise ValueError(f"align_by_expert: block_m ({block_m}) and experts ({experts}) must be positive")
    if kernel or (kernel is None and ids.is_cuda):
        from ninfer.ops.triton import moe_align_kernel  # imports Triton: only when the kernel may run

        if kernel or moe_align_kernel.fits(ids.numel(), experts):
            return moe_align_kernel.align_small(ids, experts, block_m)
    return align_by_expert_torch(ids, experts, block_m)


def align_by_expert_torch(ids: torch.Tensor, experts: int, block_m: int) -> ExpertBlocks:
    """``align_by_expert`` (which checks the arguments) in torch steps, for any size: the reference."""
    dev = ids.device
    flat = ids.reshape(-1).long()
    numel = flat.numel()
    cap = capacity(numel, experts, block_m)
    counts = torch.zeros(experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    seg_end = padded.cumsum(0)
    seg_start = seg_end - padded           # where each expert's padded segment starts
    first = counts.cumsum(0) - counts      # where each expert's pairs start in the unpadded sorted order
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = seg_start[expert_of] + torch.arange(numel, device=dev) - first[expert_of]
    sorted_pairs = torch.full((cap,), numel, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    # A used block starts with a real pair (a segment's padding is shorter than a block), whose expert it takes.
    heads = sorted_pairs[::block_m].long().clamp_(max=max(numel - 1, 0))
    block_experts = (flat[heads] if numel else torch.zeros_like(heads)).to(torch.int32)
    used = seg_end[-1:].to(torch.int32)
    return ExpertBlocks(sorted_pairs, block_experts, used, block_m, numel)
