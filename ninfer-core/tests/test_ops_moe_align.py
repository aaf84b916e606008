"""Grouping a MoE routing by expert for the grouped-GEMM kernels (``ninfer.ops.triton.moe_align``): the torch steps
and the one-program Triton kernel (``moe_align_kernel``, run here by Triton's interpreter), each against a plain
Python construction of the same layout, on random routings and on the worst padding case, and against each
other."""

from __future__ import annotations

import os

import pytest
import torch

from ninfer.ops.triton.moe_align import ExpertBlocks, align_by_expert, align_by_expert_torch, capacity

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernel needs CUDA or TRITON_INTERPRET=1")
# Triton's interpreter converts 1-element arrays to ints, which numpy deprecates; not our code.
interpreted = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


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


def check(ids: torch.Tensor, experts: int, block_m: int, kernel: bool = False) -> ExpertBlocks:
    got = align_by_expert(ids, experts, block_m, kernel=kernel)
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
    return got


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


# The one-program kernel.

def check_kernel(ids: torch.Tensor, experts: int, block_m: int) -> None:
    """The kernel's layout is the Python one, and the torch steps' to the last entry (sentinel tail included)."""
    got, want = check(ids, experts, block_m, kernel=True), align_by_expert_torch(ids, experts, block_m)
    assert torch.equal(got.sorted_pairs, want.sorted_pairs) and torch.equal(got.used, want.used)
    blocks = int(want.used.item()) // block_m
    assert torch.equal(got.block_experts[:blocks], want.block_experts[:blocks])
    assert (got.block_experts[blocks:] == 0).all()  # unused blocks are defined too


def top_k_routing(seed: int, tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """Distinct experts per token, as top-k yields them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices


@needs_triton
@interpreted
@pytest.mark.parametrize("tokens,top_k,experts,block_m", [
    (1, 8, 256, 16),   # one decode token of the 35B-A3B bank: 8 experts, one block each
    (3, 8, 256, 16),
    (16, 8, 256, 32),
    (1, 1, 1, 16),     # one pair, one expert
    (9, 2, 4, 16),     # fewer experts than pairs: several pairs per expert
    (40, 4, 5, 8),     # more pairs per expert than one block
    (37, 3, 7, 1),     # one-row blocks: no padding
    (6, 2, 300, 4),    # experts far outnumber pairs
    (128, 8, 256, 16),
])
def test_kernel_equals_the_torch_steps(tokens, top_k, experts, block_m):
    ids = top_k_routing(tokens * 131 + experts, tokens, top_k, experts)
    check_kernel(ids, experts, block_m)


@needs_triton
@interpreted
def test_kernel_reads_int32_ids_and_ids_through_their_strides():
    ids = top_k_routing(4, 6, 8, 64)
    check_kernel(ids.to(torch.int32), 64, 16)
    wide = torch.full((6, 20), 63, dtype=ids.dtype)  # columns outside the view must never be read
    wide[:, 5:13] = ids
    check_kernel(wide[:, 5:13], 64, 16)
    check_kernel(ids.t().contiguous().t(), 64, 16)  # column-major
    check_kernel(torch.tensor([[0, 7]]).expand(9, 2), 8, 4)  # a stride-0 row dimension


@needs_triton
@interpreted
def test_kernel_at_its_pair_limit():
    from ninfer.ops.triton.moe_align_kernel import MAX_PAIRS

    check_kernel(top_k_routing(9, MAX_PAIRS // 8, 8, 256), 256, 16)


@needs_triton
@interpreted
def test_kernel_worst_padding_one_expert_and_repeats():
    ids = torch.randperm(12, generator=torch.Generator().manual_seed(3)).view(6, 2)
    check_kernel(ids, 12, 16)  # every block one pair and 15 sentinels: the whole capacity
    check_kernel(torch.full((40, 1), 3), 8, 16)
    check_kernel(torch.randint(0, 5, (33, 4), generator=torch.Generator().manual_seed(7)), 5, 8)


@needs_triton
@interpreted
def test_kernel_leaves_out_pairs_routed_outside_the_bank():
    """A broken routing cannot be reported from inside a graph: its pairs are left out, nothing else moves."""
    ids = torch.tensor([[0, 9], [-1, 2], [2, 0]])
    got = align_by_expert(ids, 4, 2, kernel=True)
    assert got.sorted_pairs.tolist() == [0, 5, 3, 4] + [6] * 6
    assert got.block_experts[:2].tolist() == [0, 2] and got.used.tolist() == [4]


def test_kernel_limits_and_dispatch(monkeypatch):
    pytest.importorskip("triton")
    from ninfer.ops.triton import moe_align_kernel

    limit = moe_align_kernel.MAX_PAIRS
    assert moe_align_kernel.fits(1, 256) and moe_align_kernel.fits(limit, 256)
    assert not moe_align_kernel.fits(0, 256) and not moe_align_kernel.fits(limit + 1, 256)
    assert moe_align_kernel.fits(8, moe_align_kernel.max_experts(8))
    assert not moe_align_kernel.fits(8, moe_align_kernel.max_experts(8) + 1)  # int32 sort keys
    with pytest.raises(ValueError, match=f"1 to {limit} pairs"):
        align_by_expert(torch.zeros(limit + 1, 1, dtype=torch.int64), 8, 16, kernel=True)

    def refuse(*args):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(moe_align_kernel, "align_small", refuse)
    check(torch.tensor([[1, 0]]), 2, 4)  # CPU ids take the torch steps unless the kernel is asked for
    check(torch.tensor([[1, 0]]), 2, 4, kernel=False)
