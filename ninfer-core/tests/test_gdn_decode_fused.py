"""The fused GDN decode step: its reference is the unfused op sequence, and its Triton kernel matches it
(on the CPU through Triton's interpreter; tiny shapes, fp32/fp16 since the interpreter has no bf16)."""

from __future__ import annotations

import os

import pytest
import torch

from ninfer.ops import conv1d, gdn
from ninfer.ops.launch import arrival_counters

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _case(seed: int, B=3, HK=2, HV=4, DK=16, DV=32, K=4, S=6, dtype=torch.float32):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)

    conv_dim = 2 * HK * DK + HV * DV
    # mixed_qkv is a slice of a wider in_proj output, and both state stores are strided views into wider
    # per-slot images, as the model hands them out.
    wide = randn(B, conv_dim + 24)
    mixed = wide[:, 8:8 + conv_dim]
    ab = randn(B, 2 * HV)
    a, b = ab[:, :HV], ab[:, HV:]
    conv_w = randn(conv_dim, K) * 0.5
    conv_image = randn(S, conv_dim, K + 2)
    A_log = torch.rand(HV, generator=gen, device=DEV).log()
    dt_bias = torch.randn(HV, generator=gen, device=DEV)
    state_image = torch.randn(S, HV * DK * DV + 40, generator=gen, device=DEV) * 0.1
    slots = torch.tensor([4, 0, 2][:B], device=DEV)
    return mixed, a, b, conv_w, conv_image, A_log, dt_bias, state_image, slots, (HV, DK, DV, K)


def _views(conv_image, state_image, dims):
    HV, DK, DV, K = dims
    return conv_image[:, :, 1:K], state_image[:, 8:8 + HV * DK * DV].view(-1, HV, DK, DV)


def _run(fn, case):
    mixed, a, b, conv_w, conv_image, A_log, dt_bias, state_image, slots, dims = case
    conv_image, state_image = conv_image.clone(), state_image.clone()
    conv_states, states = _views(conv_image, state_image, dims)
    o = fn(mixed, a, b, conv_w, conv_states, A_log, dt_bias, states, slots)
    return o, conv_image, state_image


def _unfused(mixed, a, b, conv_w, conv_states, A_log, dt_bias, states, slots):
    # The sequence the model ran before the fused op, written out with the references.
    B, (hv, dk, dv) = mixed.shape[0], states.shape[1:]
    hk = (mixed.shape[1] - hv * dv) // (2 * dk)
    g, beta = gdn.gdn_gates_ref(a, b, A_log, dt_bias)
    qkv = conv1d.causal_conv1d_decode_ref(mixed, conv_w, conv_states, slots)
    q, k, v = qkv.split((hk * dk, hk * dk, hv * dv), dim=-1)
    return gdn.gdn_decode_ref(q.reshape(B, hk, dk), k.reshape(B, hk, dk), v.reshape(B, hv, dv), g, beta,
                              states, slots)


def test_reference_is_bit_identical_to_the_unfused_sequence():
    case = _case(0)
    o, conv_image, state_image = _run(gdn.gdn_decode_fused, case)
    o_want, conv_want, state_want = _run(_unfused, case)
    assert torch.equal(o, o_want) and torch.equal(conv_image, conv_want) and torch.equal(state_image, state_want)
    assert not torch.equal(state_image, case[7])  # the step really updated the state


def test_shape_errors_name_the_op():
    mixed, a, b, conv_w, conv_image, A_log, dt_bias, state_image, slots, dims = _case(1)
    conv_states, states = _views(conv_image, state_image, dims)
    with pytest.raises(ValueError, match="gdn_decode_fused: a and b"):
        gdn.gdn_decode_fused(mixed, a[:, :3], b, conv_w, conv_states, A_log, dt_bias, states, slots)
    with pytest.raises(ValueError, match="conv_dim must be"):
        gdn.gdn_decode_fused(mixed[:, 1:], a, b, conv_w[1:], conv_states[:, 1:], A_log, dt_bias, states, slots)
    with pytest.raises(ValueError, match="states must be fp32"):
        gdn.gdn_decode_fused(mixed, a, b, conv_w, conv_states, A_log, dt_bias, states.double(), slots)


@pytest.mark.parametrize("dtype,tol,block_v,hk", [
    (torch.float32, 1e-5, 16, 2), (torch.float16, 2e-3, 32, 2), (torch.float32, 1e-5, 32, 4)])
def test_triton_kernel_matches_the_reference(dtype, tol, block_v, hk):
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from ninfer.ops.triton import gdn as t_gdn

    case = _case(2, HK=hk, dtype=dtype)

    def fused(*args):
        return t_gdn.gdn_decode_fused(*args, block_v=block_v)

    for _step in range(2):  # a second step starts from the first one's states (and arrival counters)
        o, conv_image, state_image = _run(fused, case)
        o_ref, conv_ref, state_ref = _run(gdn.gdn_decode_fused_ref, case)
        assert o.dtype == dtype and not torch.isnan(o).any()
        torch.testing.assert_close(o.float(), o_ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(state_image, state_ref, atol=tol, rtol=tol)
        # The conv state only moves values, so it matches exactly; slots 1, 3, 5 are untouched everywhere.
        assert torch.equal(conv_image, conv_ref)
        assert torch.equal(state_image[[1, 3, 5]], case[7][[1, 3, 5]])
        assert torch.equal(conv_image[[1, 3, 5]], case[4][[1, 3, 5]])
        case = (*case[:4], conv_ref, *case[5:7], state_ref, *case[8:])
    assert not arrival_counters(o.device, 1).any()  # every launch leaves its counters at zero
