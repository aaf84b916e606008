"""The expert-grouped layout of a routing that the MoE kernels read (``ExpertBlocks``) and its static size;
shared by the builders (``moe_align``'s torch steps, ``moe_align_kernel``, ``moe_route_align``) and the grouped
GEMMs (``moe``). ``moe_align``'s docstring describes the layout."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class ExpertBlocks:
    """A routing grouped by expert: ``sorted_pairs`` [capacity] int32 pair numbers (``numel`` = padding),
    ``block_experts`` [capacity / block_m] int32 (the expert of each block; meaningless past the used ones),
    ``used`` [1] int32 (entries in used blocks, a multiple of block_m)."""

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    used: torch.Tensor
    block_m: int
    numel: int

    @property
    def max_blocks(self) -> int:
        return self.sorted_pairs.shape[0] // self.block_m


def capacity(numel: int, experts: int, block_m: int) -> int:
    """Entries of the padded layout for ``numel`` pairs over ``experts`` experts (``moe_align``'s docstring)."""
    entries = numel + min(experts, numel) * (block_m - 1)
    return -(-entries // block_m) * block_m
