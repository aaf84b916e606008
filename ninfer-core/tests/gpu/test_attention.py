"""The attention kernels (ninfer.ops.triton.attention) against fp32 references at Qwen3.5 shapes, bf16, on the
GPU: paged attention for decode (split context) and prefill, its gated epilogue, the K/V store and the fused
q/k norm + rotary + K/V store."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
TOL = 1e-2  # P is rounded to bf16 for the PV product


def _attention_ref(args):
    from ninfer.ops.attention import paged_attention_ref

    q, kc, vc, *rest = args
    return paged_attention_ref(q.float(), kc.float(), vc.float(), *rest)


def _decode_seqs(case, batch: int, context: str) -> list[tuple[int, int]]:
    if context == "mixed":  # every row at its own length, up to 8k
        return [(1, int(c)) for c in case.randint(8192, batch).tolist()]
    return [(1, int(context) - 1)] * batch


@pytest.mark.parametrize("context", ["1024", "8192", "mixed"])
def test_paged_attention_decode(model, case, batch, context):
    from ninfer.ops.triton.attention import paged_attention

    args = case.paged(model, _decode_seqs(case, batch, context))
    out = case.nans(*args[0].shape)
    paged_attention(*args, out=out)
    case.within(out, _attention_ref(args), TOL)


@pytest.mark.parametrize("kind", ["prompt", "chunk-after-context", "mixed-batch"])
def test_paged_attention_prefill(model, case, kind):
    from ninfer.ops.triton.attention import paged_attention

    P = case.prefill
    seqs = {"prompt": [(P, 0)], "chunk-after-context": [(P, 3000)],
            "mixed-batch": [(P, 3000), (512, 0), (1, 7000), (1, 100)]}[kind]
    args = case.paged(model, seqs)
    out = case.nans(*args[0].shape)
    paged_attention(*args, out=out)
    case.within(out, _attention_ref(args), TOL)


@pytest.mark.parametrize("rows", ["decode-B1", "decode-B8", "prefill"])
def test_paged_attention_gated(model, case, rows):
    """Qwen3.5's output gate as the epilogue, the gate the strided half of each head's [query | gate] block."""
    from ninfer.ops.triton.attention import paged_attention_gated

    seqs = {"decode-B1": [(1, 1023)], "decode-B8": [(1, 1023)] * 8, "prefill": [(case.prefill, 0)]}[rows]
    args = case.paged(model, seqs)
    q = args[0]
    gate = case.randn(q.shape[0], q.shape[1], 2 * q.shape[2])[..., q.shape[2]:]
    y = paged_attention_gated(*args, gate)
    case.within(y, _attention_ref(args) * torch.sigmoid(gate.float()), TOL)


def _caches(model, case, n: int):
    page = case.page
    n_pages = -(-n // page) * 2 + 4
    return (case.randn(n_pages, page, model.kv_heads, model.head_dim),
            case.randn(n_pages, page, model.kv_heads, model.head_dim), case.randperm(n_pages * page)[:n])


def test_write_kv_is_exact_and_touches_only_its_slots(model, case, tokens):
    from ninfer.ops.attention import write_kv_ref
    from ninfer.ops.triton.attention import write_kv

    k, v = case.randn(tokens, model.kv_heads, model.head_dim), case.randn(tokens, model.kv_heads, model.head_dim)
    k_cache, v_cache, slots = _caches(model, case, tokens)
    rk, rv = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, rk, rv, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)


def _rope_inputs(model, case, n: int, inv_freq):
    """norm_rope_write_kv's arguments as the model hands them over: q of per-head [query | gate] blocks, k and v
    slices of one projection row."""
    H, KVH, D = model.heads, model.kv_heads, model.head_dim
    kv = case.randn(n, 2 * KVH * D)
    return (case.randn(n, H, 2 * D)[..., :D], kv[:, :KVH * D].view(n, KVH, D), kv[:, KVH * D:].view(n, KVH, D),
            case.randn(D, scale=0.1), case.randn(D, scale=0.1), case.randint(200_000, n), inv_freq,
            *_caches(model, case, n))


def test_norm_rope_write_kv_against_fp32(model, case, tokens):
    from ninfer.ops.attention import norm_rope_write_kv_ref
    from ninfer.ops.rope import rope_inv_freq
    from ninfer.ops.triton.attention import norm_rope_write_kv

    inv_freq = rope_inv_freq(model.rotary_dim, 1e7, case.device)
    q, k, v, qw, kw, pos, inv, kc, vc, slots = _rope_inputs(model, case, tokens, inv_freq)
    kc0, vc0 = kc.clone(), vc.clone()
    ref_kc, ref_vc = kc.float(), vc.float()
    ref_q = norm_rope_write_kv_ref(q.float(), k.float(), v.float(), qw.float(), kw.float(), model.eps, pos, inv,
                                   ref_kc, ref_vc, slots)
    out = norm_rope_write_kv(q, k, v, qw, kw, model.eps, pos, inv, kc, vc, slots)
    case.within((out, kc, vc), (ref_q, ref_kc, ref_vc), TOL)
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=case.device)
    untouched[slots] = False
    assert torch.equal(kc.flatten(0, 1)[untouched], kc0.flatten(0, 1)[untouched])
    assert torch.equal(vc.flatten(0, 1)[untouched], vc0.flatten(0, 1)[untouched])


def test_norm_rope_write_kv_against_the_kernels_it_replaces(model, case, tokens):
    """Against rms_norm, the cos/sin table, apply_rope and write_kv in bf16: rounding-level only."""
    from ninfer.ops.rope import rope_angles_cos_sin, rope_inv_freq
    from ninfer.ops.triton.attention import norm_rope_write_kv, write_kv
    from ninfer.ops.triton.norm import rms_norm
    from ninfer.ops.triton.rope import apply_rope

    inv_freq = rope_inv_freq(model.rotary_dim, 1e7, case.device)
    q, k, v, qw, kw, pos, inv, kc, vc, slots = _rope_inputs(model, case, tokens, inv_freq)
    want_kc, want_vc = kc.clone(), vc.clone()
    cos, sin = rope_angles_cos_sin(pos, inv, q.dtype)
    want_q = apply_rope(rms_norm(q, qw, model.eps), cos, sin, model.rotary_dim)
    write_kv(apply_rope(rms_norm(k, kw, model.eps), cos, sin, model.rotary_dim), v, want_kc, want_vc, slots)
    got = norm_rope_write_kv(q, k, v, qw, kw, model.eps, pos, inv, kc, vc, slots)
    case.within((got, kc, vc), (want_q, want_kc, want_vc), 4e-3)
