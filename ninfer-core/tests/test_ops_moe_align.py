"""Grouping a MoE routing by expert for the grouped-GEMM kernels (``ninfer.ops.triton.moe_align``, pure torch),
against a plain Python construction of the same layout on random routings and on the worst padding case."""

from __future__ import annotations

import pytest
import torch

from ninfer.ops.triton.moe_align import align_by_expert, capacity


def python_layout(ids: list[list[int]], experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """(pair numbers grouped by expert in pair order, each expert's run padded with the sentinel to whole blocks;
    the expert of each block)."""
    flat = [e for row in ids for e in row]
    sentinel = len(flat)
    pairs, block_experts = [], []
    for e in range(experts):
        mine = [p for p, x in enumerate(flat) if x == e]
        if not mine:
            continue
        blocks = -(-len(mine) // block_m)
        pairs += mine + [sentinel] * (blocks * block_m - len(mine))
        block_experts += [e] * blocks
    return pairs, block_experts


def check(ids: torch.Tensor, experts: int, block_m: int) -> None:
    got = align_by_expert(ids, experts, block_m)
    pairs, block_experts = python_layout(ids.tolist(), experts, block_m)
    numel = ids.numel()
    used = int(got.used.item())
    assert got.numel == numel and got.block_m == block_m
    assert used == len(pairs) and used % block_m == 0
    assert got.sorted_pairs.dtype == got.block_experts.dtype == got.used.dtype == torch.int32
    # The sizes depend on the shapes only, and hold every layout.
    assert got.sorted_pairs.shape == (capacity(numel, experts, block_m),)
    assert got.sorted_pairs.shape[0] % block_m == 0 and used <= got.sorted_pairs.shape[0]
    assert got.block_experts.shape == (got.max_blocks,)
    assert got.sorted_pairs[:used].tolist() == pairs
    assert (got.sorted_pairs[used:] == numel).all()  # unused entries are the sentinel too
    assert got.block_experts[:used // block_m].tolist() == block_experts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_random_top_k_routings(seed, block_m):
    gen = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(2, 40, (1,), generator=gen))
    top_k = int(torch.randint(1, min(experts, 8) + 1, (1,), generator=gen))
    tokens = int(torch.randint(1, 70, (1,), generator=gen))
    # Distinct experts per token, as top-k yields them.
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    check(ids, experts, block_m)


def test_repeated_experts_and_int32_ids():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 5, (33, 4), generator=gen)  # a token may repeat an expert: still one pair per slot
    check(ids, 5, 8)
    check(ids.to(torch.int32), 5, 8)


def test_every_expert_hit_once_takes_the_whole_capacity():
    """The worst padding: each hit expert has one pair, so every block is one pair and block_m - 1 sentinels."""
    ids = torch.randperm(12, generator=torch.Generator().manual_seed(3)).view(6, 2)
    check(ids, 12, 16)
    got = align_by_expert(ids, 12, 16)
    assert int(got.used.item()) == got.sorted_pairs.shape[0] == 12 * 16


def test_one_expert_takes_every_pair_and_unhit_experts_take_nothing():
    check(torch.full((40, 1), 3), 8, 16)
    check(torch.tensor([[0, 7]] * 9), 8, 4)


def test_no_tokens():
    got = align_by_expert(torch.zeros(0, 8, dtype=torch.int64), 16, 16)
    assert got.sorted_pairs.numel() == 0 and got.max_blocks == 0 and got.used.tolist() == [0]


def test_capacity_is_static_and_tight_for_decode():
    # 35B-A3B decode: one token, top-8 of 256 experts, 16-row blocks -> 8 blocks, not 256.
    assert capacity(8, 256, 16) == 8 * 16
    assert capacity(4096 * 8, 256, 64) == -(-(4096 * 8 + 256 * 63) // 64) * 64


@pytest.mark.parametrize("ids,experts,block_m,message", [
    (torch.zeros(4, dtype=torch.int64), 8, 16, r"\[N, k\] integer"),
    (torch.zeros(4, 2), 8, 16, r"\[N, k\] integer"),
    (torch.zeros(4, 2, dtype=torch.int64), 8, 0, "must be positive"),
])
def test_bad_input_is_named(ids, experts, block_m, message):
    with pytest.raises(ValueError, match=message):
        align_by_expert(ids, experts, block_m)
