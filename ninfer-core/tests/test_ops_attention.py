"""Paged attention reference vs dense masked attention; K/V writes through a slot mapping."""

import pytest
import torch

from ninfer.ops import paged_attention, write_kv


def dense(q, k, v, scale):
    """Causal GQA attention of the last q.shape[0] positions over k/v [L, KVH, D]."""
    n, H, _ = q.shape
    L, kvh, _ = k.shape
    k, v = k.repeat_interleave(H // kvh, 1), v.repeat_interleave(H // kvh, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None]
    return torch.einsum("hqk,khd->qhd", s.masked_fill(mask, float("-inf")).softmax(-1), v)


def test_prefill_chunks_and_decode_over_scattered_pages():
    torch.manual_seed(0)
    H, KVH, D, page, P = 4, 2, 8, 4, 16
    lens = [11, 1, 6]            # tokens in KV after this call
    qlens = [5, 1, 6]            # seq 0 is a chunk with 6 earlier tokens; seq 1 a decode row; seq 2 a prompt
    k_cache, v_cache = torch.randn(P, page, KVH, D), torch.randn(P, page, KVH, D)  # garbage elsewhere
    perm = torch.randperm(P)
    tables = torch.stack([perm[0:4], perm[4:8], perm[8:12]]).int()
    ks = [torch.randn(L, KVH, D) for L in lens]
    vs = [torch.randn(L, KVH, D) for L in lens]
    # Earlier context already in the cache, written token by token.
    for i, L in enumerate(lens):
        for t in range(L - qlens[i]):
            pg, off = tables[i, t // page].item(), t % page
            k_cache[pg, off], v_cache[pg, off] = ks[i][t], vs[i][t]
    slot_mapping = torch.tensor([tables[i, t // page].item() * page + t % page
                                 for i, L in enumerate(lens) for t in range(L - qlens[i], L)])
    write_kv(torch.cat([ks[i][L - qlens[i]:] for i, L in enumerate(lens)]),
             torch.cat([vs[i][L - qlens[i]:] for i, L in enumerate(lens)]), k_cache, v_cache, slot_mapping)
    q = torch.randn(sum(qlens), H, D)
    qsl = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    o = paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl,
                        max(qlens), max(lens), D ** -0.5)
    for i in range(3):
        lo, hi = qsl[i].item(), qsl[i + 1].item()
        torch.testing.assert_close(o[lo:hi], dense(q[lo:hi], ks[i], vs[i], D ** -0.5))
    # Qwen3.5's output gate: the same attention times sigmoid(gate), the gate a per-head slice.
    gate = torch.randn(sum(qlens), H, 2 * D)[..., D:]
    gated = paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl,
                            max(qlens), max(lens), D ** -0.5, gate=gate)
    torch.testing.assert_close(gated, o * torch.sigmoid(gate))


def test_bad_geometry_is_named():
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(torch.randn(3, 3, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8),
                        torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                        torch.tensor([0, 3], dtype=torch.int32), 3, 3, 1.0)
    with pytest.raises(ValueError, match="write_kv"):
        write_kv(torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8),
                 torch.tensor([1]))


def test_norm_rope_write_kv_is_the_unfused_sequence():
    from ninfer.ops import apply_rope, norm_rope_write_kv, rms_norm, rope_cos_sin, rope_inv_freq
    from ninfer.ops.attention import norm_rope_write_kv_ref

    torch.manual_seed(1)
    N, H, KVH, D, rot = 3, 4, 2, 32, 8
    q, k, v = torch.randn(N, H, D).bfloat16(), torch.randn(N, KVH, D).bfloat16(), torch.randn(N, KVH, D).bfloat16()
    qw, kw = torch.randn(D).bfloat16() * 0.1, torch.randn(D).bfloat16() * 0.1
    positions, slots = torch.tensor([4, 0, 9000]), torch.tensor([5, 0, 13])
    caches = [torch.zeros(4, 4, KVH, D, dtype=torch.bfloat16) for _ in range(4)]
    cos, sin = rope_cos_sin(positions, rot, 1e6, torch.bfloat16)
    want_q = apply_rope(rms_norm(q, qw, 1e-6), cos, sin, rot)
    write_kv(apply_rope(rms_norm(k, kw, 1e-6), cos, sin, rot), v, caches[0], caches[1], slots)
    inv_freq = rope_inv_freq(rot, 1e6)
    got_q = norm_rope_write_kv(q, k, v, qw, kw, 1e-6, positions, inv_freq, caches[2], caches[3], slots)
    assert torch.equal(got_q, want_q) and torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert torch.equal(norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, positions, inv_freq, caches[2], caches[3],
                                              slots), want_q)
    with pytest.raises(ValueError, match="norm_rope_write_kv"):
        norm_rope_write_kv(q, k, v, qw, kw, 1e-6, positions[:2], inv_freq, caches[2], caches[3], slots)
