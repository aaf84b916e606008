"""The decode kernels captured together in one CUDA graph replay on new slots, lengths and block tables with
the same bits as eager calls (everything that changes between steps is read from device tensors), with and
without programmatic dependent launch (ninfer.ops.launch): the prologue orders, never changes, results."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _new_rows(case, block_tables, seq_lens, slot_mapping, n_pages: int, ctx_cap: int, page: int) -> torch.Tensor:
    """Fresh page tables and lengths of the decode rows, and the KV slot of each row's new (last) position;
    returns those positions."""
    B, pages_per_seq = block_tables.shape
    block_tables.copy_(case.randperm(n_pages - 1)[:B * pages_per_seq].view(B, pages_per_seq))
    seq_lens.copy_(case.randint(ctx_cap, B) + 1)
    last = seq_lens.long() - 1
    slot_mapping.copy_(block_tables.long().gather(1, (last // page)[:, None])[:, 0] * page + last % page)
    return last


def _capture(step, pdl: bool):
    """(graph, its outputs) of ``step`` captured with PDL on or off, after one warming call."""
    from ninfer.ops import launch

    with launch.scope(pdl):
        step()  # compile and warm every kernel before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    return graph, out


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_decode_step_graph_replays_equal_eager_calls(model, case, pdl):
    from ninfer.ops.triton.attention import paged_attention, write_kv
    from ninfer.ops.triton.gdn import gdn_decode_fused
    from ninfer.ops.triton.linear import linear

    B, S, page, ctx_cap = 8, 32, case.page, 8192
    pages_per_seq = ctx_cap // page
    n_pages = B * pages_per_seq + 1
    hv, kvh, D = model.hv, model.kv_heads, model.head_dim
    conv_img = case.randn(S, model.conv_dim, model.conv_k - 1)
    rec = case.randn(S, hv, model.dk, model.dv, scale=0.1, dtype=torch.float32)
    k_cache, v_cache = case.randn(n_pages, page, kvh, D), case.randn(n_pages, page, kvh, D)
    conv_w = case.randn(model.conv_dim, model.conv_k, scale=0.5)
    a_log, dt_bias = case.randn(hv, dtype=torch.float32), case.randn(hv, dtype=torch.float32)
    o_proj = case.randn(model.hidden, model.heads * D, scale=(model.heads * D) ** -0.5)
    # Static inputs, rewritten in place before each replay.
    x, ab = case.randn(B, model.conv_dim), case.randn(B, 2 * hv)
    q, kv_new = case.randn(B, model.heads, D), case.randn(2, B, kvh, D)
    slots = torch.zeros(B, dtype=torch.int64, device=case.device)
    slot_mapping = torch.zeros(B, dtype=torch.int64, device=case.device)
    block_tables = torch.zeros(B, pages_per_seq, dtype=torch.int32, device=case.device)
    seq_lens = torch.ones(B, dtype=torch.int32, device=case.device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=case.device)

    def step():  # the model's decode kernels: fused GDN step (conv + gates + recurrence), KV write, attention,
        # the few-row output projection (with its L2 prefetch under PDL)
        o = gdn_decode_fused(x, ab[:, :hv], ab[:, hv:], conv_w, conv_img, a_log, dt_bias, rec, slots)
        write_kv(kv_new[0], kv_new[1], k_cache, v_cache, slot_mapping)
        a = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, 1, ctx_cap, D ** -0.5)
        return o, linear(a.view(B, -1), o_proj)

    def new_inputs():
        for t in (x, ab, q, kv_new):
            t.copy_(case.randn(*t.shape))
        slots.copy_(case.randperm(S)[:B])
        _new_rows(case, block_tables, seq_lens, slot_mapping, n_pages, ctx_cap, page)

    new_inputs()
    graph, (o_static, y_static) = _capture(step, pdl)
    for _ in range(2):
        new_inputs()
        before = (conv_img.clone(), rec.clone(), k_cache.clone(), v_cache.clone())
        graph.replay()
        got = (o_static.clone(), y_static.clone(), conv_img.clone(), rec.clone())
        for t, saved in zip((conv_img, rec, k_cache, v_cache), before, strict=True):
            t.copy_(saved)
        o_eager, y_eager = step()  # eager, without PDL
        assert all(torch.equal(g, w) for g, w in zip(got, (o_eager, y_eager, conv_img, rec), strict=True))


def test_attention_right_after_the_kv_write_sees_the_new_keys(model, case):
    """The model's attention pair under PDL: decode attention right behind the fused norm + rotary + K/V write
    that stores its new keys, in one graph, over contexts short enough that every row's new key sits in some
    split's first tile (where a load ahead of the wait would show a stale key). Replays over fresh keys,
    positions and pages equal eager calls without PDL, bit for bit."""
    from ninfer.ops.rope import rope_inv_freq
    from ninfer.ops.triton.attention import norm_rope_write_kv, paged_attention

    B, page, ctx_cap = 8, case.page, 2048  # 64 splits of one 32-key tile at most
    pages_per_seq = ctx_cap // page
    n_pages = B * pages_per_seq + 1
    H, KVH, D = model.heads, model.kv_heads, model.head_dim
    inv_freq = rope_inv_freq(model.rotary_dim, 1e7, case.device)
    k_cache, v_cache = case.randn(n_pages, page, KVH, D), case.randn(n_pages, page, KVH, D)
    qw, kw = case.randn(D, scale=0.1), case.randn(D, scale=0.1)
    q, kv = case.randn(B, H, D), case.randn(2, B, KVH, D)
    positions = torch.zeros(B, dtype=torch.int64, device=case.device)
    slot_mapping = torch.zeros(B, dtype=torch.int64, device=case.device)
    block_tables = torch.zeros(B, pages_per_seq, dtype=torch.int32, device=case.device)
    seq_lens = torch.ones(B, dtype=torch.int32, device=case.device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=case.device)

    def step():
        qr = norm_rope_write_kv(q, kv[0], kv[1], qw, kw, model.eps, positions, inv_freq, k_cache, v_cache,
                                slot_mapping)
        return paged_attention(qr, k_cache, v_cache, block_tables, seq_lens, qsl, 1, ctx_cap, D ** -0.5)

    def new_inputs():
        for t in (q, kv):
            t.copy_(case.randn(*t.shape))
        positions.copy_(_new_rows(case, block_tables, seq_lens, slot_mapping, n_pages, ctx_cap, page))

    new_inputs()
    graph, static = _capture(step, True)
    for _ in range(20):
        new_inputs()
        before = (k_cache.clone(), v_cache.clone())
        graph.replay()
        got = static.clone()
        k_cache.copy_(before[0])
        v_cache.copy_(before[1])
        assert torch.equal(got, step())
