"""The GDN speculative verification kernel (ninfer.ops.triton.gdn_verify) at Qwen3.5 shapes, on the GPU: R fused
decode steps per row against an fp32 torch reference step by step and against R launches of the fused decode
kernel, the slots and the other layers of the step buffers untouched, and a CUDA graph replay equal to eager
calls."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
PAD = 32  # state slots are strided views into wider per-slot images, as the Program's pools hand them out
LAYERS, LAYER = 3, 1  # the step buffers are [B, R, L, ...]; the kernel gets one layer's strided view


def _inputs(model, case, B: int, R: int, S: int, dtype: torch.dtype):
    """((state image, conv image, step conv buffer, step state buffer), the op's arguments with a NaN output):
    mixed, b and a are column slices of one in_proj output row per token; the slots are scattered and read
    through a strided index tensor; the step buffers start as NaN."""
    C, K, hv = model.conv_dim, model.conv_k, model.hv
    proj = case.randn(B * R, C + 2 * hv, scale=2.0, dtype=dtype)
    conv_image = case.randn(S, C, K + 1, dtype=dtype)
    image, states = case.state_image(S, (hv, model.dk, model.dv), PAD, torch.float32)
    step_conv = case.nans(B, R, LAYERS, C, K - 1, dtype=dtype)
    step_states = case.nans(B, R, LAYERS, hv, model.dk, model.dv, dtype=torch.float32)
    slots = case.randperm(S)[:2 * B][::2]
    return (image, conv_image, step_conv, step_states), (
        proj[:, :C], proj[:, C + hv:], proj[:, C:C + hv], case.randn(C, K, scale=0.5, dtype=dtype),
        conv_image[:, :, 1:K], case.randn(hv, dtype=torch.float32), case.randn(hv, dtype=torch.float32), states,
        slots, step_conv[:, :, LAYER], step_states[:, :, LAYER], case.nans(B * R, hv, model.dv, dtype=dtype))


def _reference(model, args, dtype: torch.dtype):
    """(o, step conv states, step states): fp32 references on the upcast inputs, token by token from copies of
    the slots; the conv output is rounded to the input dtype, where the unfused conv kernel stores it."""
    from ninfer.ops.conv1d import causal_conv1d_decode_ref
    from ninfer.ops.gdn import gdn_decode_ref, gdn_gates_ref

    mixed, a, b, w, conv_states, a_log, dt_bias, states, slots, step_conv = args[:10]
    B, R = step_conv.shape[:2]
    hk, hv, dk, dv = model.hk, model.hv, model.dk, model.dv
    conv, state, rows = conv_states[slots].clone(), states[slots].clone(), torch.arange(B, device=mixed.device)
    outs, convs, recurrent = [], [], []
    for t in range(R):
        g, beta = gdn_gates_ref(a[t::R].float(), b[t::R].float(), a_log, dt_bias)
        y = causal_conv1d_decode_ref(mixed[t::R].float(), w.float(), conv, rows).to(dtype).float()
        q, k, v = y.split((hk * dk, hk * dk, hv * dv), dim=-1)
        outs.append(gdn_decode_ref(q.view(B, hk, dk), k.view(B, hk, dk), v.view(B, hv, dv), g, beta, state, rows))
        convs.append(conv.clone())
        recurrent.append(state.clone())
    return torch.stack(outs, dim=1).flatten(0, 1), torch.stack(convs, dim=1), torch.stack(recurrent, dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("R", [2, 3, 4], ids=lambda r: f"R{r}")
def test_gdn_verify_keeps_every_step_and_leaves_the_slots(model, case, batch, R, dtype):
    from ninfer.ops.gdn import gdn_verify_ref
    from ninfer.ops.triton.gdn_verify import gdn_verify

    B, S = batch, 3 * batch + 2
    (image, conv_image, step_conv_buf, step_state_buf), args = _inputs(model, case, B, R, S, dtype)
    before = image.clone(), conv_image.clone()
    o_ref, conv_ref, state_ref = _reference(model, args, dtype)
    out = args[-1]
    gdn_verify(*args[:-1], out=out)
    step_conv, step_states = args[9], args[10]
    case.within(step_states, state_ref, 1e-4, "step states")  # fp32 state, as the fused decode test
    assert torch.equal(step_conv, conv_ref), "a step's conv state is not exactly the reference's"
    case.within(out, o_ref, 5e-3, "out")
    assert torch.equal(image, before[0]) and torch.equal(conv_image, before[1]), "a slot changed"
    others = [layer for layer in range(LAYERS) if layer != LAYER]
    assert step_conv_buf[:, :, others].isnan().all() and step_state_buf[:, :, others].isnan().all(), \
        "another layer of the step buffers was written"

    # The op's definition: R successive launches of the fused decode kernel on copies of the steps.
    ref_steps = step_conv.clone(), step_states.clone()
    o_fused = gdn_verify_ref(*args[:9], *ref_steps)
    case.within(ref_steps[1], step_states, 1e-4, "step states against the fused kernel")
    assert torch.equal(ref_steps[0], step_conv), "a step's conv state is not exactly the fused kernel's"
    case.within(out, o_fused, 5e-3, "out against the fused kernel")


def test_gdn_verify_graph_replays_equal_eager_calls(model, case):
    """Captured once in a CUDA graph, replayed on new inputs and slots: the same bits as eager calls."""
    from ninfer.ops.triton.gdn_verify import gdn_verify

    B, R, S = 8, 3, 26
    buffers, args = _inputs(model, case, B, R, S, torch.bfloat16)
    mixed, a, b, slots, out = args[0], args[1], args[2], args[8], args[-1]
    gdn_verify(*args[:-1], out=out)  # compile and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gdn_verify(*args[:-1], out=out)
    for _ in range(2):
        for t in (mixed, a, b):
            t.copy_(case.randn(*t.shape))
        slots.copy_(case.randperm(S)[:2 * B][::2])
        out.fill_(math.nan)
        graph.replay()
        got = [out.clone()] + [x.clone() for x in buffers]
        out.fill_(math.nan)
        gdn_verify(*args[:-1], out=out)
        assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
                   for x, y in zip(got, [out, *buffers], strict=True))
        assert not out.isnan().any()
