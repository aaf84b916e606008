"""The fused attention-input kernel (q/k norm, rotary embedding, K/V store) against the torch reference,
on the CPU through Triton's interpreter (fp32/fp16: the interpreter has no bf16 arithmetic)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from ninfer.ops import attention, rope_inv_freq  # noqa: E402
from ninfer.ops.triton import attention as t_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _inputs(dtype, N=5, H=4, KVH=2, D=64, pages=6, page=4, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    # As the model hands them over: q of per-head [query | gate] blocks, k and v column slices of one row.
    q = randn(N, H, 2 * D)[..., :D]
    kv = randn(N, 2 * KVH * D + 3)
    k, v = kv[:, :KVH * D].view(N, KVH, D), kv[:, KVH * D:2 * KVH * D].view(N, KVH, D)
    positions = torch.tensor([0, 3, 70000, 12, 9, 262143, 1, 2][:N], device=DEV)
    slots = torch.randperm(pages * page, generator=gen, device=DEV)[:N]
    caches = randn(pages, page, KVH, D), randn(pages, page, KVH, D)
    return q, k, v, randn(D, scale=0.1), randn(D, scale=0.1), positions, slots, caches


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rot", [16, 64])
def test_norm_rope_write_kv_matches_reference(dtype, tol, rot):
    q, k, v, qw, kw, positions, slots, (k_cache, v_cache) = _inputs(dtype)
    inv_freq = rope_inv_freq(rot, 1e7, DEV)
    rk, rv = k_cache.clone(), v_cache.clone()
    ref = attention.norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, positions, inv_freq, rk, rv, slots)
    out = t_attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, positions, inv_freq, k_cache, v_cache, slots)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.float(), rk.float(), atol=tol, rtol=tol)
    assert torch.equal(v_cache, rv)  # v is copied, and every slot not in slot_mapping is untouched
    untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], rk.flatten(0, 1)[untouched])


def test_norm_rope_write_kv_rejects_mismatched_shapes():
    q, k, v, qw, kw, positions, slots, (k_cache, v_cache) = _inputs(torch.float32)
    inv_freq = rope_inv_freq(16, 1e7, DEV)
    with pytest.raises(ValueError, match="norm_rope_write_kv"):
        t_attention.norm_rope_write_kv(q, k, v, qw, kw, 1e-6, positions[:2], inv_freq, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="norm_rope_write_kv"):
        t_attention.norm_rope_write_kv(q, k, v[:, :1], qw, kw, 1e-6, positions, inv_freq, k_cache, v_cache, slots)
