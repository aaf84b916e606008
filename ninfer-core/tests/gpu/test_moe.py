"""The routed-experts Triton kernels (ninfer.ops.triton.moe) against ``moe_experts_ref`` on the GPU: the
Qwen3.5-35B-A3B expert bank (E=256, top-8, H=2048, I=512) and smaller banks whose sizes fill no tile, bf16 and
fp32, one decode token to a 4096-token prefill chunk; then the whole call inside a CUDA graph. Up to
``moe_align_kernel.MAX_PAIRS`` pairs the routing is grouped by the one-program alignment kernel, past it by the
torch steps, so both paths run here; the alignment tests compare the two directly.

The reference runs in fp32 on the upcast inputs. bf16 rounds where the unfused ops round (both projections,
silu(gate), their product, each expert's output times its weight), so its tolerance is that of two chained
bf16 GEMMs; fp32 multiplies in full fp32 (no TF32), so its tolerance is an fp32 one.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.gpu

A3B = (256, 8, 2048, 512)  # experts, top-k, hidden, moe intermediate
SMALL = [(64, 4, 1024, 384), (10, 3, 200, 72)]
TOKENS = (1, 8, 64, 77, 512, 4096)
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def routing(case, experts, top_k, hidden, tokens, dtype):
    """Fresh activations and a softmax top-k routing of random router logits: (x, ids, weights)."""
    from ninfer.ops.moe import moe_route

    x = case.randn(tokens, hidden, dtype=dtype)
    weights, ids = moe_route(case.randn(tokens, experts, dtype=torch.float32), top_k)
    return x, ids, weights.to(dtype)


def routed_bank(case, experts, top_k, hidden, inter, tokens, dtype):
    """moe_experts' inputs: (x, gate_up, down, ids, weights)."""
    gate_up = case.randn(experts, 2 * inter, hidden, scale=hidden ** -0.5, dtype=dtype)
    down = case.randn(experts, hidden, inter, scale=inter ** -0.5, dtype=dtype)
    x, ids, weights = routing(case, experts, top_k, hidden, tokens, dtype)
    return x, gate_up, down, ids, weights


def reference(x, gate_up, down, ids, weights):
    from ninfer.ops.moe import moe_experts_ref

    return moe_experts_ref(x.float(), gate_up.float(), down.float(), ids, weights.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", TOKENS, ids=lambda n: f"N{n}")
def test_a3b_bank(case, dtype, tokens):
    from ninfer.ops.triton.moe import moe_experts

    args = routed_bank(case, *A3B, tokens, dtype)
    out = case.nans(tokens, A3B[2], dtype=dtype)
    moe_experts(*args, out=out)
    case.within(out, reference(*args), TOL[dtype], "35B-A3B bank")


@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "E{}k{}H{}I{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", (1, 5, 300, 1500), ids=lambda n: f"N{n}")
def test_small_banks(case, shape, dtype, tokens):
    from ninfer.ops.triton.moe import moe_experts

    args = routed_bank(case, *shape, tokens, dtype)
    out = case.nans(tokens, shape[2], dtype=dtype)
    moe_experts(*args, out=out)
    case.within(out, reference(*args), TOL[dtype], "small bank")


def test_skewed_routing(case):
    """Every token on the same few experts (many blocks for one expert, most experts idle)."""
    from ninfer.ops.triton.moe import moe_experts

    x, gate_up, down, _, weights = routed_bank(case, *A3B, 700, torch.bfloat16)
    ids = torch.arange(8, device=x.device).repeat(700, 1)
    case.within(moe_experts(x, gate_up, down, ids, weights), reference(x, gate_up, down, ids, weights), 1e-2)


def test_rows_do_not_depend_on_their_batch(case):
    """A token's output is bitwise the same alone as in a batch (the sum is in slot order, no atomics)."""
    from ninfer.ops.triton.moe import default_config, moe_experts

    args = routed_bank(case, *A3B, 64, torch.bfloat16)
    cfg = default_config(64, torch.bfloat16)
    full = moe_experts(*args, config=cfg)
    x, gate_up, down, ids, weights = args
    assert torch.equal(moe_experts(x[10:11], gate_up, down, ids[10:11], weights[10:11], config=cfg), full[10:11])
    assert torch.equal(moe_experts(*args, config=cfg), full)  # and the same on every run


def test_no_host_sync(case):
    from ninfer.ops.triton.moe import moe_experts

    args = routed_bank(case, *A3B, 8, torch.bfloat16)
    case.no_host_sync(lambda: moe_experts(*args))


@pytest.mark.parametrize("tokens", (1, 8, 64), ids=lambda n: f"N{n}")
def test_cuda_graph_replays_as_eager(case, tokens):
    """The whole call captured at a fixed token count replays exactly as eager, also after new inputs (a new
    routing included) are copied into the captured tensors: nothing of the routing is baked into the graph."""
    from ninfer.ops.triton.moe import moe_experts

    static = routed_bank(case, *A3B, tokens, torch.bfloat16)
    x, gate_up, down, ids, weights = static
    out = case.nans(tokens, A3B[2])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_experts(*static, out=out)  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_experts(*static, out=out)
    for _ in range(2):
        replay_with_new_routing(case, graph, static, out, tokens)
        assert torch.equal(out, moe_experts(x, gate_up, down, ids, weights))


def replay_with_new_routing(case, graph, static, out, tokens: int) -> None:
    """Copy fresh activations and a fresh routing into the captured inputs, poison the output, replay."""
    x, _, _, ids, weights = static
    for captured, new in zip((x, ids, weights), routing(case, A3B[0], A3B[1], A3B[2], tokens, torch.bfloat16),
                             strict=True):
        captured.copy_(new)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def test_dispatch_reaches_the_kernel(case, monkeypatch):
    """ops.moe.moe_experts hands CUDA tensors to the kernel (under NINFER_OPS=triton, as when listed)."""
    from ninfer.ops import moe as ops_moe
    from ninfer.ops.triton.moe import moe_experts

    args = routed_bank(case, 16, 4, 256, 64, 9, torch.bfloat16)
    monkeypatch.setenv("NINFER_OPS", "triton")
    assert torch.equal(ops_moe.moe_experts(*args), moe_experts(*args))


@pytest.fixture
def align_launches(monkeypatch):
    """The calls of the one-program alignment kernel, counted (it still runs)."""
    from ninfer.ops.triton import moe_align_kernel

    launches = []
    small = moe_align_kernel.align_small

    def counted(*args):
        launches.append(args)
        return small(*args)

    monkeypatch.setattr(moe_align_kernel, "align_small", counted)
    return launches


def torch_aligned(monkeypatch):
    """moe_experts grouping the routing with the torch steps (inside ``with monkeypatch.context()``)."""
    from ninfer.ops.triton import moe as t_moe
    from ninfer.ops.triton.moe_align import align_by_expert

    monkeypatch.setattr(t_moe, "align_by_expert", functools.partial(align_by_expert, kernel=False))
    return t_moe.moe_experts


@pytest.mark.parametrize("block_m", (16, 32))
@pytest.mark.parametrize("tokens", (1, 2, 3, 8, 16, 33, 64, 100, 128, 256), ids=lambda n: f"N{n}")
def test_alignment_kernel_equals_the_torch_steps(case, align_launches, tokens, block_m):
    """CUDA routings of the 35B-A3B bank up to the kernel's limit (256 tokens at top-8) take the kernel, which
    lays them out exactly as the torch steps do."""
    from ninfer.ops.triton.moe_align import align_by_expert, align_by_expert_torch

    experts, top_k = A3B[:2]
    for _ in range(3):
        _, ids, _ = routing(case, experts, top_k, 16, tokens, torch.bfloat16)
        got, want = align_by_expert(ids, experts, block_m), align_by_expert_torch(ids, experts, block_m)
        assert torch.equal(got.sorted_pairs, want.sorted_pairs) and torch.equal(got.used, want.used)
        blocks = int(want.used.item()) // block_m
        assert torch.equal(got.block_experts[:blocks], want.block_experts[:blocks])
        assert (got.block_experts[blocks:] == 0).all()
    assert len(align_launches) == 3


def test_alignment_past_the_kernel_limit_takes_the_torch_steps(case, align_launches):
    from ninfer.ops.triton.moe_align import align_by_expert, align_by_expert_torch
    from ninfer.ops.triton.moe_align_kernel import MAX_PAIRS

    experts, top_k = A3B[:2]
    _, ids, _ = routing(case, experts, top_k, 16, MAX_PAIRS // top_k + 1, torch.bfloat16)
    assert torch.equal(align_by_expert(ids, experts, 16).sorted_pairs,
                       align_by_expert_torch(ids, experts, 16).sorted_pairs)
    assert align_launches == []


def test_decode_call_is_four_launches(case):
    """One decode token: the alignment kernel and the three grouped kernels, nothing else on the device."""
    from torch.profiler import ProfilerActivity, profile

    from ninfer.ops.triton.moe import moe_experts

    args = routed_bank(case, *A3B, 1, torch.bfloat16)
    out = case.nans(1, A3B[2])
    moe_experts(*args, out=out)  # compiled outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moe_experts(*args, out=out)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]  # kernels and copies
    assert len(kernels) == 4 and any("_align_kernel" in name for name in kernels), kernels


@pytest.mark.parametrize("pdl", (False, True), ids=("plain", "pdl"))
@pytest.mark.parametrize("tokens", (1, 8), ids=lambda n: f"N{n}")
def test_cuda_graph_with_the_alignment_kernel(case, align_launches, monkeypatch, tokens, pdl):
    """The decode call captured with the alignment kernel, with and without PDL, replays new routings exactly
    as eager runs them, and as the call grouped by the torch steps does."""
    from ninfer.ops import launch
    from ninfer.ops.triton.moe import moe_experts

    static = routed_bank(case, *A3B, tokens, torch.bfloat16)
    x, gate_up, down, ids, weights = static
    out = case.nans(tokens, A3B[2])
    with launch.scope(pdl):
        moe_experts(*static, out=out)  # compile and warm outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_experts(*static, out=out)
    assert len(align_launches) == 2
    for _ in range(2):
        replay_with_new_routing(case, graph, static, out, tokens)
        assert torch.equal(out, moe_experts(x, gate_up, down, ids, weights))
        with monkeypatch.context() as mp:
            assert torch.equal(out, torch_aligned(mp)(x, gate_up, down, ids, weights))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", (1, 8, 512, 4096), ids=lambda n: f"N{n}")
def test_route_kernel_at_a3b(case, dtype, tokens):
    """The one-launch router (E=256, top-8) from the strided logits of the fused router projection: the experts
    it picks have the reference's top-k probabilities (two experts within an ulp may swap), and its weights are
    the renormalised ones."""
    from ninfer.ops.triton.moe_route import moe_route as route_kernel

    experts, top_k = A3B[0], A3B[1]
    fused = case.randn(tokens, experts + 1, scale=2.0, dtype=dtype)
    logits = fused[:, :experts]
    weights, ids = route_kernel(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    top, _ = torch.topk(probs, top_k, dim=-1)
    picked = torch.gather(probs, 1, ids).sort(dim=-1, descending=True).values
    torch.testing.assert_close(picked, top, rtol=1e-5, atol=1e-7)
    assert all(len(set(row)) == top_k for row in ids.tolist()), "an expert picked twice for one token"
    case.within(weights.float(), picked / picked.sum(-1, keepdim=True), TOL[dtype], "route weights")


@pytest.mark.parametrize("tokens", (1, 8, 512), ids=lambda n: f"N{n}")
def test_shared_expert_joins_the_last_step_at_a3b(case, tokens):
    from ninfer.ops.moe import moe_experts_ref
    from ninfer.ops.triton.moe import moe_experts

    x, gate_up, down, ids, weights = routed_bank(case, *A3B, tokens, torch.bfloat16)
    gate = case.randn(tokens, A3B[0] + 1)[:, -1:]  # the shared-gate column of the fused router projection
    shared = case.randn(tokens, A3B[2], scale=0.1)
    out = moe_experts(x, gate_up, down, ids, weights, shared=shared, shared_gate=gate)
    ref = moe_experts_ref(x.float(), gate_up.float(), down.float(), ids, weights.float(), shared.float(), gate.float())
    case.within(out, ref, TOL[torch.bfloat16], "routed + shared")
