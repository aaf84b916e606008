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
