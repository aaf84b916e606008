"""gpu_check's attention timings (paged decode and prefill attention, the gated variant, the KV write, the fused
norm-rotary-write) and the decode sequence in one CUDA graph: registered in ``benchmarks/gpu_check.py``'s list
when it imports this module.
"""

from __future__ import annotations

from functools import partial

import torch

from benchmarks.gpu_harness import Ctx, dims, sizes, timed


def _paged_inputs(ctx: Ctx, seqs: list[tuple[int, int]]):
    """Paged K/V for sequences given as (query length, earlier context), pages scattered at random."""
    from ninfer.testing.paged import paged_attention_inputs

    d = dims(ctx.cfg)
    return paged_attention_inputs(seqs, page=sizes(ctx)["page"], heads=d["heads"], kv_heads=d["kv_heads"],
                                  head_dim=d["head_dim"], randn=ctx.randn,
                                  randperm=lambda n: torch.randperm(n, device=ctx.device), device=ctx.device)


def _attn_cost(ctx: Ctx, seqs) -> tuple[int, float]:
    """Bytes of K/V the attention must read (each visible position once) and its matmul FLOPs."""
    d = dims(ctx.cfg)
    row = d["kv_heads"] * d["head_dim"] * (2 if ctx.dtype != torch.float32 else 4)
    kv_bytes = sum(2 * (q + c) * row for q, c in seqs)
    q_bytes = sum(q for q, _ in seqs) * d["heads"] * d["head_dim"] * 2 * 2  # q read, o written
    visible = sum(q * c + q * (q + 1) / 2 for q, c in seqs)
    return kv_bytes + q_bytes, 4.0 * visible * d["heads"] * d["head_dim"]


def _attn_call(ctx: Ctx, seqs, **kw):
    from ninfer.ops.triton.attention import paged_attention

    args = _paged_inputs(ctx, seqs)
    return partial(paged_attention, *args, out=torch.empty_like(args[0]), **kw)


@timed("paged_attention_decode")
def time_paged_attention_decode(ctx: Ctx) -> None:
    """Decode attention per batch and context, and the splits / tile sweep around the default."""
    from ninfer.ops.triton import tuning
    from ninfer.ops.triton.attention import _decode_splits

    sz = sizes(ctx)
    cases = [[(1, c - 1)] * b for b in sz["batches"] for c in sz["contexts"]]
    gen = torch.Generator().manual_seed(0)
    longest = max(sz["contexts"])
    cases.append([(1, int(torch.randint(0, longest, (1,), generator=gen))) for _ in range(max(sz["batches"]))])
    kv_heads = dims(ctx.cfg)["kv_heads"]
    for seqs in cases:
        moved, _ = _attn_cost(ctx, seqs)
        splits = _decode_splits(len(seqs), kv_heads, max(q + c for q, c in seqs), 32,
                                tuning.choices("attention", tuning.device_key(torch.device(ctx.device))))
        label = f"B={len(seqs)} ctx={'mixed' if len({c for _, c in seqs}) > 1 else seqs[0][1] + 1}"
        ctx.timing(label, nbytes=moved, note=f"splits {splits}", make=lambda seqs=seqs: _attn_call(ctx, seqs))
        for splits_v, tile in ((max(1, splits // 2), 32), (min(64, splits * 2), 32), (splits, 64)):
            ctx.timing(f"{label} splits {splits_v} tile {tile}", nbytes=moved,
                       make=lambda seqs=seqs, s=splits_v, t=tile: _attn_call(ctx, seqs, num_splits=s, tile_n=t))


@timed("paged_attention_prefill")
def time_paged_attention_prefill(ctx: Ctx) -> None:
    """Prefill attention (a prompt, a chunk after context, a mixed batch), and a block / tile / warps sweep."""
    sz = sizes(ctx)
    for seqs in [[c] for c in sz["prefill"]] + [sz["mixed"]]:
        moved, flops = _attn_cost(ctx, seqs)
        label = " + ".join(f"q{q}@{c}" for q, c in seqs)
        ctx.timing(label, nbytes=moved, flops=flops, make=lambda seqs=seqs: _attn_call(ctx, seqs))
        for block_q, tile, warps, stages in ((32, 64, 8, 2), (32, 32, 8, 3), (16, 64, 4, 3)):
            ctx.timing(f"{label} bq {block_q} tile {tile} w{warps} s{stages}", nbytes=moved, flops=flops,
                       make=lambda seqs=seqs, bq=block_q, t=tile, w=warps, s=stages: _attn_call(
                           ctx, seqs, block_q=bq, tile_n=t, num_warps=w, num_stages=s))


@timed("paged_attention_gated")
def time_paged_attention_gated(ctx: Ctx) -> None:
    """Attention with the output gate as its epilogue, beside the plain kernel plus torch's sigmoid and mul."""
    from ninfer.ops.triton.attention import paged_attention, paged_attention_gated

    sz = sizes(ctx)
    for seqs in [[(1, sz["contexts"][0] - 1)] * b for b in sz["batches"]] + [[sz["prefill"][0]]]:
        def inputs(seqs=seqs):
            args = _paged_inputs(ctx, seqs)
            q = args[0]
            return args, ctx.randn(q.shape[0], q.shape[1], 2 * q.shape[2])[..., q.shape[2]:]

        moved, _ = _attn_cost(ctx, seqs)
        label = f"B={len(seqs)} q={seqs[0][0]} ctx={seqs[0][1] + seqs[0][0]}"
        ctx.timing(label, nbytes=moved, make=lambda f=inputs: partial(
            lambda a, g: paged_attention_gated(*a, g), *f()))
        ctx.timing(f"{label} unfused (kernel, sigmoid, mul)", nbytes=moved, make=lambda f=inputs: partial(
            lambda a, g: paged_attention(*a) * torch.sigmoid(g), *f()))


@timed("write_kv")
def time_write_kv(ctx: Ctx) -> None:
    from ninfer.ops.triton.attention import write_kv

    d = dims(ctx.cfg)
    page, kvh, D = sizes(ctx)["page"], d["kv_heads"], d["head_dim"]
    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            n_pages = -(-n // page) * 2 + 4
            return (ctx.randn(n, kvh, D), ctx.randn(n, kvh, D), ctx.randn(n_pages, page, kvh, D),
                    ctx.randn(n_pages, page, kvh, D), torch.randperm(n_pages * page, device=ctx.device)[:n])

        ctx.timing(f"N={n}", nbytes=4 * n * kvh * D * 2 + n * 8, make=lambda f=inputs: partial(write_kv, *f()))


@timed("norm_rope_write_kv")
def time_norm_rope_write_kv(ctx: Ctx) -> None:
    """q/k norm + rotary + K/V store in one launch, beside the five kernels (and cos/sin table) it replaces."""
    from ninfer.ops.rope import rope_angles_cos_sin, rope_inv_freq
    from ninfer.ops.triton.attention import norm_rope_write_kv, write_kv
    from ninfer.ops.triton.norm import rms_norm
    from ninfer.ops.triton.rope import apply_rope

    d = dims(ctx.cfg)
    H, KVH, D, eps = d["heads"], d["kv_heads"], d["head_dim"], d["eps"]
    page = sizes(ctx)["page"]
    inv_freq = rope_inv_freq(d["rotary_dim"], ctx.cfg.get("rope_theta", 1e7), ctx.device)

    def unfused(q, k, v, qw, kw, pos, inv, kc, vc, slots):
        cos, sin = rope_angles_cos_sin(pos, inv, q.dtype)
        out = apply_rope(rms_norm(q, qw, eps), cos, sin, d["rotary_dim"])
        write_kv(apply_rope(rms_norm(k, kw, eps), cos, sin, d["rotary_dim"]), v, kc, vc, slots)
        return out

    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            # As the model hands them over: q of per-head [query | gate] blocks, k and v slices of one row.
            kv = ctx.randn(n, 2 * KVH * D)
            n_pages = -(-n // page) * 2 + 4
            return (ctx.randn(n, H, 2 * D)[..., :D], kv[:, :KVH * D].view(n, KVH, D), kv[:, KVH * D:].view(n, KVH, D),
                    ctx.randn(D, scale=0.1), ctx.randn(D, scale=0.1),
                    torch.randint(0, 200_000, (n,), device=ctx.device), inv_freq,
                    ctx.randn(n_pages, page, KVH, D), ctx.randn(n_pages, page, KVH, D),
                    torch.randperm(n_pages * page, device=ctx.device)[:n])

        moved = 2 * n * (H + 2 * KVH) * D * 2 + n * 8
        ctx.timing(f"N={n} H={H} KVH={KVH}", nbytes=moved, make=lambda f=inputs: partial(
            lambda a: norm_rope_write_kv(*a[:5], eps, *a[5:]), f()))
        ctx.timing(f"N={n} unfused kernels", nbytes=moved, make=lambda f=inputs: partial(lambda a: unfused(*a), f()))


@timed("cuda_graph")
def time_cuda_graph(ctx: Ctx) -> None:
    """The decode sequence (fused GDN step, KV write, attention) at B=8 in one CUDA graph, per replay."""
    if not ctx.gpu:
        return
    from ninfer.ops.triton.attention import paged_attention, write_kv
    from ninfer.ops.triton.gdn import gdn_decode_fused

    d = dims(ctx.cfg)
    B, S, page, ctx_cap = 8, 32, sizes(ctx)["page"], 8192
    pages_per_seq = ctx_cap // page
    n_pages = B * pages_per_seq + 1
    hv = d["hv"]
    conv_img = ctx.randn(S, d["conv_dim"], d["conv_k"] - 1)
    rec = ctx.randn(S, hv, d["dk"], d["dv"], scale=0.1, dtype=torch.float32)
    k_cache = ctx.randn(n_pages, page, d["kv_heads"], d["head_dim"])
    v_cache = ctx.randn(n_pages, page, d["kv_heads"], d["head_dim"])
    conv_w = ctx.randn(d["conv_dim"], d["conv_k"], scale=0.5)
    a_log, dt_bias = ctx.randn(hv, dtype=torch.float32), ctx.randn(hv, dtype=torch.float32)
    x, ab = ctx.randn(B, d["conv_dim"]), ctx.randn(B, 2 * hv)
    q, kv_new = ctx.randn(B, d["heads"], d["head_dim"]), ctx.randn(2, B, d["kv_heads"], d["head_dim"])
    slots = torch.randperm(S, device=ctx.device)[:B]
    block_tables = torch.randperm(n_pages - 1, device=ctx.device)[:B * pages_per_seq].view(B, pages_per_seq)
    block_tables = block_tables.to(torch.int32)
    seq_lens = torch.randint(1, ctx_cap + 1, (B,), device=ctx.device).to(torch.int32)
    last = seq_lens.long() - 1
    slot_mapping = block_tables.long().gather(1, (last // page)[:, None])[:, 0] * page + last % page
    qsl = torch.arange(B + 1, dtype=torch.int32, device=ctx.device)

    def step():
        o = gdn_decode_fused(x, ab[:, :hv], ab[:, hv:], conv_w, conv_img, a_log, dt_bias, rec, slots)
        write_kv(kv_new[0], kv_new[1], k_cache, v_cache, slot_mapping)
        return o, paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, 1, ctx_cap, d["head_dim"] ** -0.5)

    step()  # compile and warm every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ctx.timing("replay: gdn_decode_fused+write_kv+attention B=8", fn=graph.replay)
