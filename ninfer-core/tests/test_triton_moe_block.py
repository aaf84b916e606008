"""The decode MoE block's Triton path (``ninfer.ops.triton.moe.moe_block`` and its one-program routing,
``moe_route_align``) against the block's parts, on the CPU through Triton's interpreter: tiny banks, fp32 and
fp16 (the interpreter has no bf16 arithmetic). The 35B-A3B bank, bf16, graphs and launch counts are the GPU
tests' job (ninfer-core/tests/gpu/test_moe_block.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from ninfer.ops.moe import moe_block_ref, moe_route  # noqa: E402
from ninfer.ops.triton import moe_route_align  # noqa: E402
from ninfer.ops.triton.moe import moe_block  # noqa: E402
from ninfer.ops.triton.moe_align import align_by_expert_torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def block_args(seed, experts, top_k, hidden, inter, tokens, dtype, shared_inter=None):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    si = shared_inter or inter
    fused = randn(tokens, experts + 1, scale=2.0)  # [routing logits | shared-gate logit], as the fused router
    return (randn(tokens, hidden), fused[:, :experts], fused[:, experts:],
            randn(experts, 2 * inter, hidden, scale=hidden ** -0.5), randn(experts, hidden, inter, scale=inter ** -0.5),
            randn(2 * si, hidden, scale=hidden ** -0.5), randn(hidden, si, scale=si ** -0.5), top_k)


def reference(args):
    *tensors, top_k = args
    return moe_block_ref(*(t.float() for t in tensors), top_k)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(8, 2, 64, 32, 1), (10, 3, 40, 24, 5), (6, 6, 32, 16, 16)],
                         ids=["E8-N1", "E10-N5", "E6-all-N16"])
def test_folded_block_matches_its_parts(shape, dtype, tol):
    args = block_args(sum(shape), *shape, dtype)
    out = moe_block(*args)
    torch.testing.assert_close(out.float(), reference(args), atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", [1, 3])
def test_unsummed_block_is_its_slot_rows(tokens):
    """``summed=False``: the k + 1 weighted slot rows whose in-order sum is the summed output, bitwise."""
    from ninfer.ops.norm import sum_terms

    args = block_args(11, 8, 3, 64, 32, tokens, torch.float16)
    rows = moe_block(*args, summed=False)
    assert rows.shape == (tokens, 4, 64)
    assert torch.equal(sum_terms(rows), moe_block(*args))


@pytest.mark.parametrize("tokens,shared_inter", [(17, None), (3, 16)], ids=["past-the-program", "shared-width"])
def test_other_calls_take_the_parts(tokens, shared_inter):
    """More tokens than one routing program takes, or a shared expert unlike a routed one: the composed path."""
    args = block_args(7, 8, 2, 64, 32, tokens, torch.float32, shared_inter)
    torch.testing.assert_close(moe_block(*args), reference(args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_route_align_is_route_then_align(tokens):
    """Weights and ids as moe_route gives them (distinct logits: no ties), slot k the shared expert E at
    sigmoid(gate), and exactly the torch steps' layout of those ids over E + 1 experts."""
    E, top_k = 12, 3
    _, logits, gate, *_ = block_args(tokens, E, top_k, 8, 8, tokens, torch.float32)
    weights, ids, blocks = moe_route_align.route_align(logits, top_k, 4, gate)
    want_w, want_ids = moe_route(logits, top_k)
    assert torch.equal(ids[:, :top_k].long(), want_ids)
    torch.testing.assert_close(weights[:, :top_k], want_w)
    assert (ids[:, top_k] == E).all()
    torch.testing.assert_close(weights[:, top_k:], torch.sigmoid(gate))
    want = align_by_expert_torch(ids, E + 1, 4)
    assert torch.equal(blocks.sorted_pairs, want.sorted_pairs) and torch.equal(blocks.used, want.used)
    used = int(want.used.item()) // 4
    assert torch.equal(blocks.block_experts[:used], want.block_experts[:used])


def test_route_align_takes_the_lower_expert_among_equal_probabilities():
    """Ties: equal logits give equal probabilities, and the lower expert number is picked first (as torch.topk
    on the CPU does); a -inf logit is never picked while others are left."""
    logits = torch.tensor([[0.5, 2.0, 2.0, -float("inf"), 2.0, 0.5, 1.0, 0.5]], device=DEV)
    weights, ids, _ = moe_route_align.route_align(logits, 5, 16)
    assert ids.tolist() == [[1, 2, 4, 6, 0]]
    want_w, _ = moe_route(logits, 5)
    torch.testing.assert_close(weights, want_w)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 4e-3)],
                         ids=["fp32", "fp16", "bf16"])
def test_route_align_picks_the_largest_logits(dtype, tol):
    """Picks by logit (negative ones too, 16-bit logits on 16-bit keys): the k largest, the lower expert number
    first among equal ones; weights the renormalised top-k of the fp32 softmax within one unit of the dtype."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    logits = torch.randn(3, 256, generator=gen, device=DEV) * 3
    logits[1] = (logits[1] * 2).round() / 2  # many equal logits
    logits[2] = -logits[2].abs() - 1  # all negative
    logits = logits.to(dtype)
    weights, ids, _ = moe_route_align.route_align(logits, 8, 16)
    by_value = [sorted(range(256), key=lambda e: (-float(row[e]), e))[:8] for row in logits.cpu()]
    assert ids.tolist() == by_value
    probs = torch.softmax(logits.float(), -1).gather(1, ids.long())
    torch.testing.assert_close(weights.float(), probs / probs.sum(-1, keepdim=True), atol=tol, rtol=0)


def test_route_align_without_a_shared_expert():
    _, logits, _, *_ = block_args(3, 12, 4, 8, 8, 5, torch.float32)
    weights, ids, blocks = moe_route_align.route_align(logits, 4, 16)
    want_w, want_ids = moe_route(logits, 4)
    assert torch.equal(ids.long(), want_ids) and blocks.numel == 20
    torch.testing.assert_close(weights, want_w)


def test_route_align_refuses_what_one_program_cannot_take():
    logits = torch.randn(moe_route_align.MAX_TOKENS + 1, 8, device=DEV)
    assert not moe_route_align.fits(logits.shape[0], 8, 2, shared=True)
    with pytest.raises(ValueError, match="one program routes"):
        moe_route_align.route_align(logits, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_one_launch_equals_the_grouped_path(dtype):
    """``moe_one_token``: gate_up and down of one token in one grid (routing it as ``route_align`` does) give the
    grouped path's slot rows, and leave the arrival counters at zero for the next launch (twice, fresh inputs)."""
    from ninfer.ops.launch import arrival_counters
    from ninfer.ops.triton import moe_one_token

    tiles = moe_one_token.OneTokenTiles(up_n=16, up_k=32, down_n=16, down_k=16)
    for seed in (21, 22):
        args = block_args(seed, 10, 3, 64, 48, 1, dtype)
        rows = moe_one_token.moe_one_token(*args, tiles=tiles)
        two = moe_block(*args, summed=False, one_launch=False)[0]
        assert rows.shape == (4, 64)
        torch.testing.assert_close(rows, two, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=1e-5)
        assert not arrival_counters(rows.device, 8)[:8].any()
    assert torch.equal(moe_block(*args, summed=False)[0], moe_one_token.moe_one_token(*args))
