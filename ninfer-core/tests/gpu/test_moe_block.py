"""The whole sparse MoE block on the GPU (``ninfer.ops.triton.moe.moe_block``) against its parts in fp32: the
Qwen3.5-35B-A3B bank (E=256, top-8, H=2048, I=512, a shared expert of 512) from the strided logits of the fused
router projection. Decode-sized calls take the folded path (one routing-and-grouping program, the shared expert
as expert E of the grouped kernels, a sum over k + 1 slots: four launches; one token routes itself in the one
launch of gate_up and down: two, one when the caller sums the slot rows); larger calls and shared experts of
another width take the composed one. bf16 rounds where the unfused ops round except the last sum (fp32 over all
k + 1 slots, where the parts round the routed sum first), so the tolerance is that of two chained bf16 GEMMs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

A3B = (256, 8, 2048, 512)  # experts, top-k, hidden, moe intermediate (= the shared expert's)
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def block(case, experts, top_k, hidden, inter, tokens, dtype, shared_inter=None):
    """moe_block's inputs: (x, logits, shared_gate, gate_up, down, shared_gate_up, shared_down, top_k)."""
    si = shared_inter or inter
    fused = case.randn(tokens, experts + 1, scale=2.0, dtype=dtype)  # [routing logits | shared-gate logit]
    return (case.randn(tokens, hidden, dtype=dtype), fused[:, :experts], fused[:, experts:],
            case.randn(experts, 2 * inter, hidden, scale=hidden ** -0.5, dtype=dtype),
            case.randn(experts, hidden, inter, scale=inter ** -0.5, dtype=dtype),
            case.randn(2 * si, hidden, scale=hidden ** -0.5, dtype=dtype),
            case.randn(hidden, si, scale=si ** -0.5, dtype=dtype), top_k)


def reference(args):
    from ninfer.ops.moe import moe_block_ref

    *tensors, top_k = args
    return moe_block_ref(*(t.float() for t in tensors), top_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", (1, 2, 8, 16, 17, 64), ids=lambda n: f"N{n}")
def test_a3b_block(case, dtype, tokens):
    from ninfer.ops.triton.moe import moe_block

    args = block(case, *A3B, tokens, dtype)
    case.within(moe_block(*args), reference(args), TOL[dtype], f"moe_block N={tokens}")


@pytest.mark.parametrize("tokens", (1, 8), ids=lambda n: f"N{n}")
def test_shared_expert_of_another_width_takes_the_parts(case, tokens):
    from ninfer.ops.triton.moe import moe_block

    args = block(case, 64, 4, 1024, 384, tokens, torch.bfloat16, shared_inter=256)
    case.within(moe_block(*args), reference(args), TOL[torch.bfloat16], "moe_block, shared width 256")


@pytest.mark.parametrize("tokens", (1, 3, 8, 16), ids=lambda n: f"N{n}")
def test_route_align_equals_route_then_align(case, tokens):
    """The one-program routing: the picked experts carry the softmax's top-k (two within an ulp may swap), the
    weights are renormalised, slot k is expert E at sigmoid(gate), and the layout is the torch steps' exactly."""
    from ninfer.ops.triton.moe_align import align_by_expert_torch
    from ninfer.ops.triton.moe_route_align import route_align

    experts, top_k = A3B[:2]
    _, logits, gate, *_ = block(case, experts, top_k, 16, 16, tokens, torch.bfloat16)
    weights, ids, blocks = route_align(logits, top_k, 16, gate)
    probs = torch.softmax(logits.float(), dim=-1)
    top, _ = torch.topk(probs, top_k, dim=-1)
    picked = torch.gather(probs, 1, ids[:, :top_k].long()).sort(dim=-1, descending=True).values
    torch.testing.assert_close(picked, top, rtol=1e-5, atol=1e-7)
    case.within(weights[:, :top_k].float(), picked / picked.sum(-1, keepdim=True), 1e-2, "route weights")
    assert (ids[:, top_k] == experts).all()
    torch.testing.assert_close(weights[:, top_k].float(), torch.sigmoid(gate[:, 0].float()), atol=4e-3, rtol=0)
    want = align_by_expert_torch(ids, experts + 1, 16)
    assert torch.equal(blocks.sorted_pairs, want.sorted_pairs) and torch.equal(blocks.used, want.used)
    used = int(want.used.item()) // 16
    assert torch.equal(blocks.block_experts[:used], want.block_experts[:used])


def test_no_host_sync(case):
    from ninfer.ops.triton.moe import moe_block

    args = block(case, *A3B, 8, torch.bfloat16)
    case.no_host_sync(lambda: moe_block(*args))


@pytest.mark.parametrize("tokens,summed,launches", [(2, True, 4), (1, True, 2), (1, False, 1)],
                         ids=("N2", "N1", "N1-unsummed"))
def test_decode_call_launches(case, tokens, summed, launches):
    """A decode call: the routing-and-grouping program, both grouped kernels and the slot sum; one token is one
    launch of gate_up and down that routes itself (no routing program); unsummed, the slot sum is the caller's.
    Never a shared-expert linear."""
    from torch.profiler import ProfilerActivity, profile

    from ninfer.ops.triton.moe import moe_block

    args = block(case, *A3B, tokens, torch.bfloat16)
    moe_block(*args, summed=summed)  # compiled outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moe_block(*args, summed=summed)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert len(kernels) == launches, kernels
    assert any("_route_align_kernel" in name for name in kernels) == (tokens > 1), kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_launch_equals_the_grouped_path(case, dtype):
    """At the A3B bank, over fresh inputs: ``moe_one_token`` (routing the token itself) gives the slot rows of
    the routing program and the grouped kernels."""
    from ninfer.ops.triton import moe as t_moe
    from ninfer.ops.triton import moe_one_token

    for _ in range(3):
        args = block(case, *A3B, 1, dtype)
        grouped = t_moe.moe_block(*args, summed=False, one_launch=False)[0].float()
        case.within(moe_one_token.moe_one_token(*args), grouped, TOL[dtype], "one launch")


def test_one_launch_replays_many_times_under_pdl(case):
    """Captured with PDL, the one launch replays 40 times over fresh routings, each time as the grouped path run
    eagerly: its counters are zero again after every launch, and no down program reads a slot early (a stale or
    early hidden row would be another routing's)."""
    from ninfer.ops import launch
    from ninfer.ops.launch import arrival_counters
    from ninfer.ops.triton import moe as t_moe
    from ninfer.ops.triton import moe_one_token

    static = block(case, *A3B, 1, torch.bfloat16)
    x, logits, gate = static[:3]
    with launch.scope(True):
        moe_one_token.moe_one_token(*static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_one_token.moe_one_token(*static)
    for _ in range(40):
        fresh = block(case, *A3B, 1, torch.bfloat16)
        x.copy_(fresh[0])
        logits.copy_(fresh[1])
        gate.copy_(fresh[2])
        out.fill_(float("nan"))
        graph.replay()
        want = t_moe.moe_block(*static, summed=False, one_launch=False)[0]
        torch.cuda.synchronize()
        case.within(out, want.float(), TOL[torch.bfloat16], "replayed one launch")
    assert not arrival_counters(x.device, 18)[:18].any()


@pytest.mark.parametrize("pdl", (False, True), ids=("plain", "pdl"))
@pytest.mark.parametrize("tokens,summed", [(1, True), (1, False), (8, True)], ids=("N1", "N1-unsummed", "N8"))
def test_cuda_graph_replays_as_eager(case, tokens, summed, pdl):
    """The block captured at a fixed token count replays new activations and new router logits exactly as
    eager runs them: nothing of the routing is baked into the graph."""
    from ninfer.ops import launch
    from ninfer.ops.triton.moe import moe_block

    static = block(case, *A3B, tokens, torch.bfloat16)
    x, logits, gate = static[:3]
    with launch.scope(pdl):
        moe_block(*static, summed=summed)  # compile and warm outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_block(*static, summed=summed)
    for _ in range(2):
        fresh = block(case, A3B[0], A3B[1], A3B[2], 16, tokens, torch.bfloat16)
        x.copy_(fresh[0])
        logits.copy_(fresh[1])
        gate.copy_(fresh[2])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe_block(*static, summed=summed))


def test_dispatch_reaches_the_kernel(case, monkeypatch):
    """ops.moe.moe_block hands CUDA tensors to the kernel; NINFER_OPS_OFF leaves it to the parts."""
    from ninfer.ops import moe as ops_moe
    from ninfer.ops.triton.moe import moe_block

    args = block(case, *A3B, 2, torch.bfloat16)
    monkeypatch.setenv("NINFER_OPS", "triton")
    assert torch.equal(ops_moe.moe_block(*args), moe_block(*args))
    monkeypatch.setenv("NINFER_OPS_OFF", "moe.moe_block")
    assert torch.equal(ops_moe.moe_block(*args), ops_moe.moe_block_ref(*args))
