"""The Gated DeltaNet kernels (ninfer.ops.triton.gdn) against fp32 references at Qwen3.5 shapes, on the GPU:
gates, the recurrent decode step, the fused decode step (conv + gates + recurrence) and fla-core's prefill."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
PAD = 32  # state slots are strided views into wider per-slot images, as the Program's pools hand them out


def test_gdn_gates(model, case, tokens):
    from ninfer.ops.gdn import gdn_gates_ref
    from ninfer.ops.triton.gdn import gdn_gates

    a, b = case.randn(tokens, model.hv, scale=3.0), case.randn(tokens, model.hv, scale=3.0)
    a_log, dt_bias = case.randn(model.hv, dtype=torch.float32), case.randn(model.hv, dtype=torch.float32)
    g, beta = case.nans(tokens, model.hv, dtype=torch.float32), case.nans(tokens, model.hv, dtype=torch.float32)
    gdn_gates(a, b, a_log, dt_bias, out=(g, beta))
    case.within((g, beta), gdn_gates_ref(a.float(), b.float(), a_log, dt_bias), 1e-5)


def _others(case, slots_total: int, slots: torch.Tensor) -> torch.Tensor:
    others = torch.ones(slots_total, dtype=torch.bool, device=case.device)
    others[slots] = False
    return others


def test_gdn_decode_updates_only_its_slots(model, case, batch):
    from ninfer.ops.gdn import gdn_decode_ref
    from ninfer.ops.triton.gdn import gdn_decode

    B, S, per_slot = batch, 3 * batch + 2, (model.hv, model.dk, model.dv)
    image, states = case.state_image(S, per_slot, PAD, torch.float32)
    q, k = case.randn(B, model.hk, model.dk), case.randn(B, model.hk, model.dk)
    v = case.randn(B, model.hv, model.dv)
    g, beta = -case.rand(B, model.hv) * 2, case.rand(B, model.hv)
    slots = case.randperm(S)[:B]
    ref_image = image.clone()
    ref_states = ref_image[:, PAD:PAD + math.prod(per_slot)].view(S, *per_slot)
    o_ref = gdn_decode_ref(q.float(), k.float(), v.float(), g, beta, ref_states, slots)
    out = case.nans(B, model.hv, model.dv)
    gdn_decode(q, k, v, g, beta, states, slots, out=out)
    case.within(image[slots], ref_image[slots], 1e-5, "state")  # fp32 state
    others = _others(case, S, slots)
    assert torch.equal(image[others], ref_image[others]), "a slot outside the batch changed"
    case.within(out, o_ref, 5e-3, "out")


def _fused_inputs(model, case, B: int, S: int):
    """((state image, conv image), the fused op's arguments with a NaN output): mixed, b and a are column slices
    of one in_proj output row, as the model hands them over; both states strided views into their images."""
    C, K, hv = model.conv_dim, model.conv_k, model.hv
    proj = case.randn(B, C + 2 * hv, scale=2.0)
    conv_image = case.randn(S, C, K + 1)
    image, states = case.state_image(S, (hv, model.dk, model.dv), PAD, torch.float32)
    return (image, conv_image), (
        proj[:, :C], proj[:, C + hv:], proj[:, C:C + hv], case.randn(C, K, scale=0.5), conv_image[:, :, 1:K],
        case.randn(hv, dtype=torch.float32), case.randn(hv, dtype=torch.float32), states, case.randperm(S)[:B],
        case.nans(B, hv, model.dv))


def test_gdn_decode_fused_updates_only_its_slots(model, case, batch):
    from ninfer.ops.conv1d import causal_conv1d_decode_ref
    from ninfer.ops.gdn import gdn_decode_ref, gdn_gates_ref
    from ninfer.ops.triton.gdn import gdn_decode_fused

    B, S = batch, 3 * batch + 2
    hk, hv, dk, dv, K = model.hk, model.hv, model.dk, model.dv, model.conv_k
    (image, conv_image), args = _fused_inputs(model, case, B, S)
    mixed, a, b, w, _, a_log, dt_bias, _, slots, out = args
    ref_image, ref_conv_image = image.clone(), conv_image.clone()
    ref_states = ref_image[:, PAD:PAD + hv * dk * dv].view(S, hv, dk, dv)
    # fp32 references on the upcast inputs; the conv output is rounded to bf16, where the unfused conv kernel
    # stores it and the fused kernel rounds it.
    g, beta = gdn_gates_ref(a.float(), b.float(), a_log, dt_bias)
    y = causal_conv1d_decode_ref(mixed.float(), w.float(), ref_conv_image[:, :, 1:K], slots).bfloat16().float()
    q, k, v = y.split((hk * dk, hk * dk, hv * dv), dim=-1)
    o_ref = gdn_decode_ref(q.view(B, hk, dk), k.view(B, hk, dk), v.view(B, hv, dv), g, beta, ref_states, slots)
    gdn_decode_fused(*args[:-1], out=out)
    case.within(image[slots], ref_image[slots], 1e-4, "state")
    others = _others(case, S, slots)
    assert torch.equal(image[others], ref_image[others]), "a slot outside the batch changed"
    assert torch.equal(conv_image, ref_conv_image), "the conv state is not exactly the reference's"
    case.within(out, o_ref, 5e-3, "out")


def test_gdn_decode_fused_graph_replays_equal_eager_calls(model, case):
    """Captured once in a CUDA graph, replayed on new inputs and slots: the same bits as eager calls (every
    launch leaves its arrival counters at zero, so replays start from the same counter state)."""
    from ninfer.ops.triton.gdn import gdn_decode_fused

    B, S = 8, 26
    (image, conv_image), args = _fused_inputs(model, case, B, S)
    mixed, a, b, slots, out = args[0], args[1], args[2], args[8], args[9]
    gdn_decode_fused(*args[:-1], out=out)  # compile and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gdn_decode_fused(*args[:-1], out=out)
    for _ in range(2):
        for t in (mixed, a, b):
            t.copy_(case.randn(*t.shape))
        slots.copy_(case.randperm(S)[:B])
        before = (image.clone(), conv_image.clone())
        graph.replay()
        got = (out.clone(), image.clone(), conv_image.clone())
        image.copy_(before[0])
        conv_image.copy_(before[1])
        gdn_decode_fused(*args[:-1], out=out)
        assert all(torch.equal(x, y) for x, y in zip(got, (out, image, conv_image), strict=True))


@pytest.mark.parametrize("per_graph", (1, 2), ids=("one-step", "two-steps"))
@pytest.mark.parametrize("batch", (1, 8), ids=lambda b: f"B{b}")
def test_gdn_decode_fused_under_pdl_matches_eager_steps_without_it(model, case, batch, per_graph):
    """in_proj (the few-row linear) then the fused step, captured with PDL and replayed for several steps whose
    states chain, give the bits of the same steps run eagerly without PDL from the same start. With two steps in
    one graph, the second step reads the state and conv history that the first step wrote two kernels back (what
    a load moved ahead of the PDL wait would have to see)."""
    from ninfer.ops import launch
    from ninfer.ops.triton.gdn import gdn_decode_fused
    from ninfer.ops.triton.linear import linear

    B, S, C, hv = batch, 3 * batch + 2, model.conv_dim, model.hv
    (image, conv_image), args = _fused_inputs(model, case, B, S)
    _, _, _, w, conv_states, a_log, dt_bias, states, slots, out = args
    x = case.randn(B, model.hidden)
    in_proj = case.randn(C + 2 * hv, model.hidden, scale=model.hidden ** -0.5)

    def step() -> None:
        proj = linear(x, in_proj)
        gdn_decode_fused(proj[:, :C], proj[:, C + hv:], proj[:, C:C + hv], w, conv_states, a_log, dt_bias, states,
                         slots, out=out)

    start = image.clone(), conv_image.clone()
    inputs = [case.randn(B, model.hidden) for _ in range(3)]
    with launch.scope(True):
        step()  # compile the PDL variants outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per_graph):
                step()
    image.copy_(start[0])
    conv_image.copy_(start[1])
    replayed = []
    for fresh in inputs:
        x.copy_(fresh)
        graph.replay()
        replayed.append(out.clone())
    got = replayed, image.clone(), conv_image.clone()
    image.copy_(start[0])
    conv_image.copy_(start[1])
    eager = []
    for fresh in inputs:
        x.copy_(fresh)
        for _ in range(per_graph):
            step()
        eager.append(out.clone())
    assert all(torch.equal(r, e) for r, e in zip(got[0], eager, strict=True)), "outputs differ"
    assert torch.equal(got[1], image) and torch.equal(got[2], conv_image), "states differ"


@pytest.mark.parametrize("has_state", [False, True], ids=["zero-state", "with-state"])
def test_gdn_prefill(model, case, tokens, has_state):
    """fla-core's chunked kernel against the chunked torch reference."""
    from ninfer.ops.gdn import gdn_prefill_ref
    from ninfer.ops.triton.gdn import fla_available, gdn_prefill

    assert fla_available(), "fla-core is not importable: carry its wheel in .whl/ (scripts/gpu installs it)"
    T = tokens
    q, k = case.randn(T, model.hk, model.dk), case.randn(T, model.hk, model.dk)
    v = case.randn(T, model.hv, model.dv)
    g = torch.nn.functional.logsigmoid(case.randn(T, model.hv, dtype=torch.float32))
    beta = case.rand(T, model.hv)
    state = case.randn(model.hv, model.dk, model.dv, scale=0.1, dtype=torch.float32)
    ref_state = state.clone()
    o_ref = gdn_prefill_ref(q.float(), k.float(), v.float(), g, beta, ref_state, has_state)
    out = case.nans(T, model.hv, model.dv)
    gdn_prefill(q, k, v, g, beta, state, has_state, out=out)
    case.within(out, o_ref, 1e-2, "out")  # fla measured about 3e-3
    case.within(state, ref_state, 1e-2, "state")
