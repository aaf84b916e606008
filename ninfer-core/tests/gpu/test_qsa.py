"""QSA's sparse decode attention kernel (ninfer.ops.triton.qsa) against its fp32 reference at the published
Qwen4Exp attention (24 heads over 2 KV heads of 256, 512 chosen blocks of 4) on the GPU, bf16: decode rows over
contexts of a few thousand tokens whose pages are scattered, gated as the model calls it, with no host sync."""

from __future__ import annotations

import pytest
import torch

from benchmarks.shapes import QWEN4EXP_SHAPES

pytestmark = pytest.mark.gpu
TOL = 5e-3
C = QWEN4EXP_SHAPES["qwen4exp-published"]
HEADS, KVH, D = C["num_attention_heads"], C["num_key_value_heads"], C["head_dim"]
RATIO = C["indexer_compress_ratio"]
TOPK = C["indexer_budget"] // RATIO


def _inputs(case, lengths):
    page, B = 16, len(lengths)
    width = -(-max(lengths) // page)
    n_pages = B * width + 7
    tables = case.randperm(n_pages)[:B * width].view(B, width).int()
    kc, vc = case.randn(n_pages, page, KVH, D), case.randn(n_pages, page, KVH, D)
    q, gate = case.randn(B, HEADS, D), case.randn(B, HEADS, D)
    sel = torch.full((B, TOPK), -1, dtype=torch.int32, device="cuda")
    for i, n in enumerate(lengths):  # a random choice among the complete blocks, ascending, -1 after
        keep = case.randperm(n // RATIO)[:TOPK].sort().values
        sel[i, :keep.numel()] = keep.int()
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    return q, kc, vc, tables, lens, qsl, sel, gate


@pytest.mark.parametrize("lengths", [[4099], [1000, 2050, 37, 3001, 4096, 5, 1703, 2222]], ids=["B1", "B8"])
def test_qsa_attention_static(case, lengths):
    from ninfer.ops.qsa import qsa_attention_static_ref
    from ninfer.ops.triton.qsa import qsa_attention_static

    q, kc, vc, tables, lens, qsl, sel, gate = _inputs(case, lengths)
    want = qsa_attention_static_ref(q.float(), kc.float(), vc.float(), tables, lens, qsl, sel, RATIO, D ** -0.5,
                                    gate.float())
    for splits in (None, 1):
        got = qsa_attention_static(q, kc, vc, tables, lens, qsl, sel, RATIO, D ** -0.5, gate, num_splits=splits)
        case.within(got, want, TOL, f"num_splits={splits}")
    case.no_host_sync(lambda: qsa_attention_static(q, kc, vc, tables, lens, qsl, sel, RATIO, D ** -0.5, gate))


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("lengths", [[4099], [1000, 2050, 37, 3001, 4096, 5, 1703, 2222]], ids=["B1", "B8"])
def test_qsa_block_scores(case, lengths, mrope):
    """The indexer's block scores (published: 4 index heads of 128, rotary 64) against the reference on every block
    a query sees, with the graphs' bound of a 262,144-token context (blocks past a query's length load nothing)."""
    from ninfer.ops.qsa import qsa_block_scores_ref, query_positions
    from ninfer.ops.rope import mrope_axes, rope_inv_freq
    from ninfer.ops.triton.qsa import qsa_block_scores

    di, heads, rot = C["indexer_head_dim"], C["indexer_n_heads"], int(D * 0.25)
    page, B = 16, len(lengths)
    width = -(-max(lengths) // page)
    n_pages = B * width + 7
    tables = case.randperm(n_pages)[:B * width].view(B, width).int()
    keys, q, k_norm = case.randn(n_pages, page, di), case.randn(B, heads, di), case.randn(di, scale=0.1)
    inv = rope_inv_freq(rot, 1e7).cuda()
    kw = (None, None)
    if mrope:
        kw = (case.randint(5000, n_pages, page, 3).int(), mrope_axes(rot, (11, 11, 10)).cuda())
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    seq, pos = query_positions(torch.arange(B + 1, dtype=torch.int32, device="cuda"), lens, B)
    M = 262144 // RATIO
    want = qsa_block_scores_ref(q.float(), keys, tables, seq, pos, k_norm, 1e-6, inv, rot, RATIO, 1100, *kw)
    got = qsa_block_scores(q, keys, tables, seq, pos, k_norm, 1e-6, inv, rot, RATIO, M, *kw)
    seen = torch.arange(1100, device="cuda")[None, :] < ((pos + 1) // RATIO)[:, None]
    case.within(got[:, :1100][seen], want[seen], 1e-2)
    case.no_host_sync(lambda: qsa_block_scores(q, keys, tables, seq, pos, k_norm, 1e-6, inv, rot, RATIO, M, *kw))
