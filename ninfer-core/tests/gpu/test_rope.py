"""The rotary embedding kernel (ninfer.ops.triton.rope) against its fp32 reference, bf16, on the GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("which", ["query", "key"])
def test_apply_rope(model, case, tokens, which):
    from ninfer.ops.rope import apply_rope_ref, rope_cos_sin
    from ninfer.ops.triton.rope import apply_rope

    heads = model.heads if which == "query" else model.kv_heads
    x = case.randn(tokens, heads, model.head_dim)
    cos, sin = rope_cos_sin(case.randint(8192, tokens), model.rotary_dim, 1e7, torch.float32)
    out = case.nans(*x.shape)
    apply_rope(x, cos, sin, model.rotary_dim, out=out)
    case.within(out, apply_rope_ref(x.float(), cos, sin, model.rotary_dim), 5e-3)


def test_norm_rope_write_kv_mrope(model, case, tokens):
    """The attention-input kernel at MRoPE positions [3, N] (its ``MROPE`` path, ``norm_rope_write_kv_mrope``)
    against the fp32 reference, bf16, real Qwen3.5 shapes; each of the three rows must reach its frequency slots,
    and the caches' other slots stay untouched."""
    from ninfer.ops.attention import norm_rope_write_kv_ref
    from ninfer.ops.rope import mrope_axes, rope_inv_freq
    from ninfer.ops.triton.attention import norm_rope_write_kv_mrope

    H, KVH, D, rot = model.heads, model.kv_heads, model.head_dim, model.rotary_dim
    inv, axes = rope_inv_freq(rot, 1e7, case.device), mrope_axes(rot, (11, 11, 10), case.device)
    kv = case.randn(tokens, 2 * KVH * D)
    q, k, v = case.randn(tokens, H, 2 * D)[..., :D], kv[:, :KVH * D].view(tokens, KVH, D), kv[:, KVH * D:].view(
        tokens, KVH, D)
    qw, kw = case.randn(D, scale=0.1), case.randn(D, scale=0.1)
    pos = case.randint(200_000, 3, tokens)
    n_pages = -(-tokens // case.page) * 2 + 4
    kc, vc = case.randn(n_pages, case.page, KVH, D), case.randn(n_pages, case.page, KVH, D)
    slots = case.randperm(n_pages * case.page)[:tokens]
    kc0, vc0 = kc.clone(), vc.clone()
    ref_kc, ref_vc = kc.float(), vc.float()
    ref_q = norm_rope_write_kv_ref(q.float(), k.float(), v.float(), qw.float(), kw.float(), model.eps, pos, inv,
                                   ref_kc, ref_vc, slots, axes=axes)
    out = norm_rope_write_kv_mrope(q, k, v, qw, kw, model.eps, pos, inv, kc, vc, slots, axes)
    case.within((out, kc, vc), (ref_q, ref_kc, ref_vc), 1e-2)  # as the 1-D kernel's test in test_attention.py
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=case.device)
    untouched[slots] = False
    assert torch.equal(kc.flatten(0, 1)[untouched], kc0.flatten(0, 1)[untouched])
    assert torch.equal(vc.flatten(0, 1)[untouched], vc0.flatten(0, 1)[untouched])
    # equal rows: exactly the 1-D kernel
    from ninfer.ops.triton.attention import norm_rope_write_kv

    flat = norm_rope_write_kv(q, k, v, qw, kw, model.eps, pos[0], inv, kc0.clone(), vc0.clone(), slots)
    three = norm_rope_write_kv_mrope(q, k, v, qw, kw, model.eps, pos[0].expand(3, -1), inv, kc0.clone(), vc0.clone(),
                                     slots, axes)
    assert torch.equal(flat, three)
