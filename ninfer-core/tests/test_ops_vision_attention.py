"""vision_attention (non-causal attention within packed sequences): the torch path against a float64 loop over the
sequences, and the Triton kernel against both under Triton's interpreter (tiny shapes, fp32 / fp16; bf16 and the
real head shapes are the GPU test's job, ninfer-core/tests/gpu/test_vision_attention.py)."""

from __future__ import annotations

import os

import pytest
import torch

from ninfer.ops.vision import PackedSequences, vision_attention, vision_attention_ref


def _attention64(q, k, v, lengths, scale):
    """softmax(q k^T * scale) v per sequence, in float64."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))
        out.append((torch.softmax(qs @ ks.transpose(1, 2) * scale, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def _qkv(lengths, heads, head_dim, seed, dtype=torch.float32):
    """q, k, v as strided views of one fused [N, 3H, D] projection, as the encoder hands them over."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3 * heads, head_dim, generator=gen).to(dtype)
    return qkv[:, :heads], qkv[:, heads:2 * heads], qkv[:, 2 * heads:]


def _rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_groups_by_length():
    seqs = PackedSequences.of([4, 9, 4, 4, 1], "cpu")
    assert seqs.total == 22 and seqs.max_length == 9
    assert seqs.cu_seqlens.tolist() == [0, 4, 13, 17, 21, 22] and seqs.cu_seqlens.dtype == torch.int32
    by_len = {g.length: g for g in seqs.groups}
    assert sorted(by_len) == [1, 4, 9]
    four = by_len[4]  # rows 0..3, 13..16, 17..20: not one run, so gathered by index
    assert four.count == 3 and four.index.tolist() == [0, 1, 2, 3, 13, 14, 15, 16, 17, 18, 19, 20]
    assert by_len[9].index is None and by_len[9].first == 4
    run = PackedSequences.of([3, 3, 3], "cpu").groups
    assert len(run) == 1 and run[0].index is None and run[0].count == 3


@pytest.mark.parametrize("lengths", [[], [3, 0], [-1]])
def test_bad_lengths_are_refused(lengths):
    with pytest.raises(ValueError, match="positive lengths"):
        PackedSequences.of(lengths, "cpu")


@pytest.mark.parametrize("lengths", [[1], [7], [5, 12, 5, 1, 12, 5], [16, 16, 16]])
def test_reference_matches_float64(lengths):
    q, k, v = _qkv(lengths, heads=3, head_dim=24, seed=len(lengths))
    seqs = PackedSequences.of(lengths, "cpu")
    out = vision_attention(q, k, v, seqs)  # CPU tensors: the torch path
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel(out, _attention64(q, k, v, lengths, 24 ** -0.5)) < 1e-6
    scaled = vision_attention_ref(q, k, v, seqs, scale=0.3)
    assert _rel(scaled, _attention64(q, k, v, lengths, 0.3)) < 1e-6


def test_sequences_do_not_see_each_other():
    q, k, v = _qkv([6, 9], heads=2, head_dim=16, seed=3)
    together = vision_attention(q, k, v, PackedSequences.of([6, 9], "cpu"))
    first = vision_attention(q[:6], k[:6], v[:6], PackedSequences.of([6], "cpu"))
    assert torch.allclose(together[:6], first, atol=1e-6)


def test_shape_errors_are_clear():
    q, k, v = _qkv([4, 4], heads=2, head_dim=16, seed=0)
    with pytest.raises(ValueError, match=r"N = 9 \(the packed lengths' sum\)"):
        vision_attention(q, k, v, PackedSequences.of([4, 5], "cpu"))
    with pytest.raises(ValueError, match="must be"):
        vision_attention(q, k[:, :1], v, PackedSequences.of([4, 4], "cpu"))
    with pytest.raises(ValueError, match="share a dtype"):
        vision_attention(q, k.double(), v, PackedSequences.of([4, 4], "cpu"))


_INTERPRETED = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _INTERPRETED, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("head_dim, split", [(72, True), (72, False), (16, True), (40, True)])
@pytest.mark.parametrize("lengths", [[1], [5, 33, 1, 33], [70]], ids=["one-token", "mixed", "several-blocks"])
def test_kernel_matches_reference(head_dim, split, lengths):
    """Small tiles (16 rows, 16 keys), so 33 and 70 tokens span several query blocks and key tiles; a head of
    72 = 64 + 16 (split) or 128 padded columns, 40 = 32 + 16."""
    pytest.importorskip("triton")
    from ninfer.ops.triton.vision_attention import head_blocks
    from ninfer.ops.triton.vision_attention import vision_attention as kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (x.to(dev) for x in _qkv(lengths, heads=2, head_dim=head_dim, seed=head_dim + len(lengths)))
    seqs = PackedSequences.of(lengths, dev)
    out = torch.full(q.shape, float("nan"), device=dev)  # every element must be written
    kernel(q, k, v, seqs, out=out, block_m=16, block_n=16, head_split=split, num_warps=4)
    ref = _attention64(q.cpu(), k.cpu(), v.cpu(), lengths, head_dim ** -0.5)
    assert _rel(out.cpu(), ref) < 1e-5
    fp16 = kernel(*(x.half() for x in (q, k, v)), seqs, block_m=16, block_n=16, head_split=split, num_warps=4)
    assert fp16.dtype == torch.float16 and _rel(fp16.cpu(), ref) < 5e-3
    assert sum(head_blocks(head_dim, split)) == {(72, True): 80, (72, False): 128, (16, True): 16,
                                                 (40, True): 48}[(head_dim, split)]
