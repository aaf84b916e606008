"""The vision encoder's attention (ninfer.ops.triton.vision_attention, and the torch path it replaces: SDPA once
per distinct length) against an fp32 reference on the GPU, bf16, at the Qwen3.5 vision heads: 16 x 72 (every
published size from 2B up; 72 is no power of two) and 12 x 64 (0.8B).

Inputs are q, k, v as strided views of one fused [N, 3H, D] projection, as the encoder hands them over; the
kernel's output starts as NaN. Length mixes: one token, a 448 x 448 image (784 patches), a 1024 x 1024 image
(4096 patches: many query blocks and key tiles), eight video frames, many 4-patch images, and a mix of all
with equal lengths apart (the torch path gathers those). Tolerance: relative error 1e-2 (P is rounded to bf16
for the PV product, as in the paged attention tests); the measured errors and times are in
``benchmarks/vision.py``'s attention table, not here.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
TOL = 1e-2
HEADS = {"9b": (16, 72), "0.8b": (12, 64)}
MIXES = {
    "one-token": [1],
    "448": [784],
    "1024": [4096],
    "video-8-frames": [256] * 8,
    "many-small": [4] * 64 + [16] * 16,
    "mixed": [4, 784, 1, 96, 4096, 784, 4],
}


def _qkv(case, lengths, heads, head_dim, dtype=torch.bfloat16):
    qkv = case.randn(sum(lengths), 3 * heads, head_dim, dtype=dtype)
    return qkv[:, :heads], qkv[:, heads:2 * heads], qkv[:, 2 * heads:]


def _reference(q, k, v, lengths, first: int = 0, count: int | None = None):
    """fp32 softmax(q k^T / sqrt(D)) v per sequence (TF32 off: the conftest), for sequences first..first+count."""
    count = len(lengths) - first if count is None else count
    start = sum(lengths[:first])
    out = []
    for n in lengths[first:first + count]:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        scores = qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5
        out.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.fixture(params=sorted(HEADS))
def heads(request):
    return HEADS[request.param]


# The Triton kernel hit an illegal address on the H200 (split head, 448- and 1024-pixel images) in its first
# device run; it is not listed in TRITON_OPS and its tests stay off until it is rewritten (docs/kernels.md).
QUARANTINED = pytest.mark.skip(reason="the Triton vision attention kernel is quarantined: docs/kernels.md")


@QUARANTINED
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("head_split", [True, False], ids=["split-head", "padded-head"])
def test_kernel_against_fp32(case, heads, mix, head_split):
    from ninfer.ops.triton.vision_attention import vision_attention
    from ninfer.ops.vision import PackedSequences

    lengths = MIXES[mix]
    q, k, v = _qkv(case, lengths, *heads)
    seqs = PackedSequences.of(lengths, case.device)
    out = case.nans(*q.shape)
    vision_attention(q, k, v, seqs, out=out, head_split=head_split)
    case.within(out, _reference(q, k, v, lengths), TOL, f"{mix} {heads}")


@QUARANTINED
@pytest.mark.parametrize("block_m", [64, 128])
def test_kernel_tiles(case, heads, block_m):
    """Both query-block sizes the default rule picks from, on the mixed lengths."""
    from ninfer.ops.triton.vision_attention import vision_attention
    from ninfer.ops.vision import PackedSequences

    lengths = MIXES["mixed"]
    q, k, v = _qkv(case, lengths, *heads)
    out = vision_attention(q, k, v, PackedSequences.of(lengths, case.device), block_m=block_m)
    case.within(out, _reference(q, k, v, lengths), TOL, f"block_m {block_m}")


@pytest.mark.parametrize("mix", ["mixed", "video-8-frames"])
def test_torch_path_against_fp32(case, heads, mix):
    """The path before the kernel is listed (and with NINFER_OPS=torch): SDPA once per distinct length."""
    from ninfer.ops.vision import PackedSequences, vision_attention_ref

    lengths = MIXES[mix]
    q, k, v = _qkv(case, lengths, *heads)
    out = vision_attention_ref(q, k, v, PackedSequences.of(lengths, case.device))
    case.within(out, _reference(q, k, v, lengths), TOL, mix)


@QUARANTINED
def test_fp16_and_fp32_inputs(case):
    from ninfer.ops.triton.vision_attention import vision_attention
    from ninfer.ops.vision import PackedSequences

    lengths = [33, 784, 1]
    seqs = PackedSequences.of(lengths, case.device)
    for dtype, tol in ((torch.float16, TOL), (torch.float32, 1e-5)):
        q, k, v = _qkv(case, lengths, 16, 72, dtype)
        out = vision_attention(q, k, v, seqs)
        assert out.dtype == dtype
        case.within(out, _reference(q, k, v, lengths), tol, str(dtype))


@QUARANTINED
def test_offsets_past_int32(case):
    """622,080 rows of a fused 16-head projection: element offsets pass 2 ** 31, so the kernel takes 64-bit
    offsets; the last sequences (and the first) are checked."""
    from ninfer.ops.triton.vision_attention import _wide_offsets, vision_attention
    from ninfer.ops.vision import PackedSequences

    lengths = [256] * 2430
    q, k, v = _qkv(case, lengths, 16, 72)
    assert _wide_offsets(q.shape[0], q, k, v)
    out = vision_attention(q, k, v, PackedSequences.of(lengths, case.device))
    case.within(out[-4 * 256:], _reference(q, k, v, lengths, first=len(lengths) - 4), TOL, "last sequences")
    case.within(out[:2 * 256], _reference(q, k, v, lengths, count=2), TOL, "first sequences")


@QUARANTINED
def test_graph_replay_equals_eager(case):
    """No host sync in the launch: captured once, replayed on new contents, equal to an eager call bitwise."""
    from ninfer.ops.triton.vision_attention import vision_attention
    from ninfer.ops.vision import PackedSequences

    lengths = MIXES["mixed"]
    seqs = PackedSequences.of(lengths, case.device)
    q, k, v = _qkv(case, lengths, 16, 72)
    out = case.nans(*q.shape)
    vision_attention(q, k, v, seqs, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vision_attention(q, k, v, seqs, out=out)
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(case.randn(*x.shape))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, vision_attention(q, k, v, seqs))


@QUARANTINED
def test_dispatch_on_cuda(case, monkeypatch):
    """``ninfer.ops.vision.vision_attention`` on CUDA: the torch path under NINFER_OPS=torch, the kernel under
    NINFER_OPS=triton (listed or not); both within the tolerance."""
    from ninfer.ops import vision as ops_vision

    lengths = MIXES["mixed"]
    q, k, v = _qkv(case, lengths, 16, 72)
    seqs = ops_vision.PackedSequences.of(lengths, case.device)
    ref = _reference(q, k, v, lengths)
    for mode in ("torch", "triton"):
        monkeypatch.setenv("NINFER_OPS", mode)
        case.within(ops_vision.vision_attention(q, k, v, seqs), ref, TOL, mode)
