"""MRoPE in the rotary ops: the interleaved slot-to-axis map against transformers' Qwen3.5 rotary embedding, the
attention-input op at [3, N] positions (torch path, and the Triton kernel through the interpreter on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from ninfer.ops import attention, rope_inv_freq
from ninfer.ops.rope import mrope_axes, rope_angles_cos_sin

TRITON = (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1") \
    and __import__("importlib").util.find_spec("triton") is not None
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_axes_follow_the_published_section():
    axes = mrope_axes(64, (11, 11, 10)).tolist()
    assert [j for j, a in enumerate(axes) if a == 0] == list(range(0, 32, 3))
    assert [j for j, a in enumerate(axes) if a == 1] == list(range(1, 32, 3))
    assert [j for j, a in enumerate(axes) if a == 2] == list(range(2, 30, 3))
    assert mrope_axes(16, (11, 11, 10)).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_axes(16, (6, 1, 1)).tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="three"):
        mrope_axes(16, (8, 8))


@pytest.mark.parametrize("head_dim, factor, section", [(256, 0.25, [11, 11, 10]), (32, 0.5, [3, 3, 2]),
                                                       (64, 0.5, [4, 2, 2])])
def test_cos_sin_match_transformers(head_dim, factor, section):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    cfg = transformers.Qwen3_5TextConfig(head_dim=head_dim, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": factor, "mrope_section": section})
    hf = Qwen3_5TextRotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 300_000, (3, 9), generator=gen)
    want_cos, want_sin = hf(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    rot = int(head_dim * factor)
    cos, sin = rope_angles_cos_sin(pos, rope_inv_freq(rot, 1e7), torch.float32, mrope_axes(rot, tuple(section)))
    # HF duplicates the 32 angles to 64 for rotate_half; ours keeps one half
    assert torch.equal(want_cos[0, :, :rot // 2], cos) and torch.equal(want_sin[0, :, :rot // 2], sin)


def _inputs(dtype, N=6, H=4, KVH=2, D=32, pages=5, page=4, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    q = randn(N, H, 2 * D)[..., :D]  # as the model hands it over: a strided slice of [query | gate]
    kv = randn(N, 2 * KVH * D)
    k, v = kv[:, :KVH * D].view(N, KVH, D), kv[:, KVH * D:].view(N, KVH, D)
    positions = torch.randint(0, 70_000, (3, N), generator=gen, device=DEV)
    slots = torch.randperm(pages * page, generator=gen, device=DEV)[:N]
    return q, k, v, randn(D, scale=0.1), randn(D, scale=0.1), positions, slots, randn(pages, page, KVH, D), \
        randn(pages, page, KVH, D)


def test_equal_axes_are_plain_rope():
    """Text: all three rows equal gives exactly the 1-D rotation."""
    q, k, v, qw, kw, pos, slots, kc, vc = _inputs(torch.float32)
    inv, axes = rope_inv_freq(16, 1e7, DEV), mrope_axes(16, (3, 3, 2), DEV)
    kc1, vc1 = kc.clone(), vc.clone()
    flat = attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, pos[0], inv, kc1, vc1, slots)
    three = attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, pos[0].expand(3, -1), inv, kc, vc, slots, axes=axes)
    assert torch.equal(flat, three) and torch.equal(kc, kc1) and torch.equal(vc, vc1)


def test_the_rows_matter_and_shapes_are_checked():
    q, k, v, qw, kw, pos, slots, kc, vc = _inputs(torch.float32)
    inv, axes = rope_inv_freq(16, 1e7, DEV), mrope_axes(16, (3, 3, 2), DEV)
    base = attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, pos, inv, kc.clone(), vc.clone(), slots, axes=axes)
    for row in range(3):
        moved = pos.clone()
        moved[row] += 1
        out = attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, moved, inv, kc.clone(), vc.clone(), slots,
                                           axes=axes)
        assert not torch.equal(out, base)
    with pytest.raises(ValueError, match="norm_rope_write_kv"):
        attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, pos, inv, kc, vc, slots)  # [3, N] without axes
    with pytest.raises(ValueError, match="norm_rope_write_kv"):
        attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, pos[:2], inv, kc, vc, slots, axes=axes)


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rot", [16, 32])
def test_kernel_matches_reference(dtype, tol, rot):
    from ninfer.ops.triton import attention as t_attention

    q, k, v, qw, kw, pos, slots, kc, vc = _inputs(dtype)
    inv, axes = rope_inv_freq(rot, 1e7, DEV), mrope_axes(rot, (11, 11, 10), DEV)
    rk, rv = kc.clone(), vc.clone()
    ref = attention.norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, pos, inv, rk, rv, slots, axes=axes)
    out = t_attention.norm_rope_write_kv_mrope(q, k, v, qw, kw, 1e-6, pos, inv, kc, vc, slots, axes)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kc.float(), rk.float(), atol=tol, rtol=tol)
    assert torch.equal(vc, rv)
    # the 1-D entry is unchanged: the same kernel at one row equals the reference at that row
    kc1, vc1 = kc.clone(), vc.clone()
    flat = t_attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, pos[1], inv, kc1, vc1, slots)
    ref_flat = attention.norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, pos[1], inv, kc.clone(), vc.clone(), slots)
    torch.testing.assert_close(flat.float(), ref_flat.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="axes"):
        t_attention.norm_rope_write_kv_mrope(q, k, v, qw, kw, 1e-6, pos, inv, kc, vc, slots, axes[:2])
