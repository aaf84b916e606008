"""The causal conv1d kernels (ninfer.ops.triton.conv1d) against fp32 references at Qwen3.5's GDN conv, on the
GPU: the one-step update by slot and prefill; both conv states must match the reference exactly."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_causal_conv1d_decode_by_slot(model, case, batch):
    from ninfer.ops.conv1d import causal_conv1d_decode_ref
    from ninfer.ops.triton.conv1d import causal_conv1d_decode

    B, S, C, K = batch, 3 * batch + 2, model.conv_dim, model.conv_k
    image = case.randn(S, C, K + 1)  # the states [S, C, K-1] are a strided view into it
    x, w, slots = case.randn(B, C), case.randn(C, K, scale=0.5), case.randperm(S)[:B]
    ref_image = image.clone()
    ref = causal_conv1d_decode_ref(x.float(), w.float(), ref_image[:, :, 1:K], slots)
    out = case.nans(B, C)
    causal_conv1d_decode(x, w, image[:, :, 1:K], slots, out=out)
    case.within(out, ref, 5e-3)
    assert torch.equal(image, ref_image), "the states (or the image around them) differ from the reference's"


@pytest.mark.parametrize("has_state", [False, True], ids=["zero-state", "with-state"])
def test_causal_conv1d_prefill(model, case, tokens, has_state):
    from ninfer.ops.conv1d import causal_conv1d_prefill_ref
    from ninfer.ops.triton.conv1d import causal_conv1d_prefill

    C, K = model.conv_dim, model.conv_k
    x, w, state = case.randn(tokens, C), case.randn(C, K, scale=0.5), case.randn(C, K - 1)
    ref_state = state.clone()
    ref = causal_conv1d_prefill_ref(x.float(), w.float(), ref_state, has_state)
    out = case.nans(tokens, C)
    causal_conv1d_prefill(x, w, state, has_state, out=out)
    case.within(out, ref, 5e-3)
    assert torch.equal(state, ref_state), "the new conv state is not exactly the last K-1 inputs"
