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
