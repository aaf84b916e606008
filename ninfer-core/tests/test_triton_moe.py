"""The routed-experts Triton kernels (ninfer.ops.triton.moe) against ``moe_experts_ref``, on the CPU through Triton's
interpreter: tiny shapes, fp32/fp16 (the interpreter has no bf16 arithmetic). Real shapes, bf16 and CUDA-graph
capture are the GPU tests' job (ninfer-core/tests/gpu/test_moe.py). The dispatch only picks Triton for CUDA
tensors, so these call the kernel's entry point directly; on CPU tensors the routing is grouped by the torch
steps unless a test asks for the one-program alignment kernel (``kernel_alignment``)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from ninfer.ops.moe import moe_experts_ref, moe_route  # noqa: E402
from ninfer.ops.triton import moe as t_moe  # noqa: E402
from ninfer.ops.triton import moe_align_kernel  # noqa: E402
from ninfer.ops.triton.moe_align import align_by_expert  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter converts 1-element arrays to ints, which numpy deprecates; not our code.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def bank(seed: int, experts: int, hidden: int, inter: int, tokens: int, top_k: int, dtype: torch.dtype):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    x = randn(tokens, hidden)
    gate_up = randn(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    down = randn(experts, hidden, inter, scale=inter ** -0.5)
    weights, ids = moe_route(randn(tokens, experts), top_k)
    return x, gate_up, down, ids, weights


def close(out, ref, tol):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.fixture
def kernel_alignment(monkeypatch):
    """moe_experts groups the routing with the one-program kernel, as it does for small CUDA routings; the
    returned list counts the kernel's launches."""
    launches = []
    small = moe_align_kernel.align_small

    def counted(*args):
        launches.append(args)
        return small(*args)

    monkeypatch.setattr(moe_align_kernel, "align_small", counted)
    monkeypatch.setattr(t_moe, "align_by_expert", functools.partial(align_by_expert, kernel=True))
    return launches


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("tokens", [1, 5, 9])
def test_matches_the_reference(dtype, tol, tokens):
    x, gate_up, down, ids, weights = bank(tokens, 4, 32, 16, tokens, 2, dtype)
    ref = moe_experts_ref(x.float(), gate_up.float(), down.float(), ids, weights.float())
    close(t_moe.moe_experts(x, gate_up, down, ids, weights), ref, tol)


@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_matches_the_reference_through_the_alignment_kernel(kernel_alignment, tokens):
    """Small decode-like calls grouped by the one-program kernel: the same output as the torch steps give."""
    x, gate_up, down, ids, weights = bank(tokens + 20, 8, 32, 16, tokens, 4, torch.float32)
    ref = moe_experts_ref(x, gate_up, down, ids, weights)
    out = t_moe.moe_experts(x, gate_up, down, ids, weights)
    assert len(kernel_alignment) == 1
    close(out, ref, 1e-5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(t_moe, "align_by_expert", functools.partial(align_by_expert, kernel=False))
        assert torch.equal(out, t_moe.moe_experts(x, gate_up, down, ids, weights))


def test_k_loop_edges_blocks_and_strides():
    """Several K steps with a ragged last one, intermediate and hidden sizes that fill no tile, more pairs per
    expert than one block, a strided x and an fp32 routing weight beside fp16 activations."""
    x, gate_up, down, ids, weights = bank(11, 3, 40, 24, 9, 2, torch.float16)
    wide = torch.randn(9, 56, device=DEV).to(x.dtype)  # columns outside the view must never be read
    wide[:, 8:48] = x
    cfg = t_moe.MoeConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
    out = torch.full((9, 40), float("nan"), dtype=x.dtype, device=DEV)
    t_moe.moe_experts(wide[:, 8:48], gate_up, down, ids, weights.float(), out=out, config=cfg)
    close(out, moe_experts_ref(x.float(), gate_up.float(), down.float(), ids, weights.float()), 3e-3)


def test_rows_do_not_depend_on_their_batch():
    """A token's output is the same alone as beside others (fixed tiles, slot-order sums, no atomics)."""
    x, gate_up, down, ids, weights = bank(5, 4, 32, 16, 7, 2, torch.float32)
    cfg = t_moe.default_config(7, torch.float32)
    full = t_moe.moe_experts(x, gate_up, down, ids, weights, config=cfg)
    alone = t_moe.moe_experts(x[3:4], gate_up, down, ids[3:4], weights[3:4], config=cfg)
    assert torch.equal(full[3:4], alone)


def test_mixed_dtypes_are_refused():
    x, gate_up, down, ids, weights = bank(2, 4, 32, 16, 3, 2, torch.float32)
    with pytest.raises(ValueError, match="must share one of"):
        t_moe.moe_experts(x.half(), gate_up, down, ids, weights)


def test_default_tiles_grow_with_tokens():
    sizes = [t_moe.default_config(n, torch.bfloat16).block_m for n in (1, 8, 64, 512, 1024, 4096)]
    assert sizes == [16, 16, 16, 16, 32, 128]
    assert t_moe.default_config(4096, torch.float32).num_stages <= 2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_the_shared_expert_joins_in_the_last_step(dtype, tol):
    """shared / shared_gate: routed + sigmoid(gate) * shared, the gate a strided column as the fused router
    projection gives it."""
    x, gate_up, down, ids, weights = bank(5, experts=6, hidden=40, inter=24, tokens=7, top_k=2, dtype=dtype)
    fused = torch.randn(7, 7, device=DEV).to(dtype)  # [6 routing logits | 1 shared-gate logit]
    gate = fused[:, 6:]
    shared = torch.randn(7, 40, device=DEV).to(dtype)
    out = t_moe.moe_experts(x, gate_up, down, ids, weights, shared=shared, shared_gate=gate)
    close(out, moe_experts_ref(x, gate_up, down, ids, weights, shared, gate), tol)


@pytest.mark.parametrize("experts,top_k,tokens", [(8, 2, 1), (10, 3, 5), (256, 8, 3), (7, 7, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_route_kernel_picks_the_reference_experts(experts, top_k, tokens, dtype):
    """One launch: the fp32 softmax's k largest, renormalised, from strided logits; ids in descending order."""
    from ninfer.ops.triton.moe_route import moe_route as route_kernel

    gen = torch.Generator(device=DEV).manual_seed(experts + tokens)
    fused = (torch.randn(tokens, experts + 1, generator=gen, device=DEV) * 3).to(dtype)
    logits = fused[:, :experts]
    weights, ids = route_kernel(logits, top_k)
    ref_w, ref_ids = moe_route(logits.cpu(), top_k)  # CPU tensors take the torch path
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids.cpu(), ref_ids)
    close(weights.cpu(), ref_w, 1e-6 if dtype == torch.float32 else 1e-3)


def test_the_route_kernel_breaks_ties_by_the_lower_expert_number():
    from ninfer.ops.triton.moe_route import moe_route as route_kernel

    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], device=DEV)
    weights, ids = route_kernel(logits, 3)
    assert ids.tolist() == [[1, 2, 4]]
    close(weights, torch.full((1, 3), 1 / 3, device=DEV), 1e-6)
