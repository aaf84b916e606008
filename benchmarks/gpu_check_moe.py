"""gpu_check's MoE entry (``--only moe``): the routed experts over the Qwen3.5-35B-A3B bank against the fp32
reference and the hit experts' bytes, with a tile sweep; then the whole decode block (routing, shared expert,
routed experts) folded into four launches against the same block as its parts.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from benchmarks.gpu_harness import nbytes, timed

# The Qwen3.5-35B-A3B routed-expert bank (SHAPES holds the dense models): experts, top-k, hidden, moe intermediate.
MOE_A3B = (256, 8, 2048, 512)


@timed("moe")
def time_moe(ctx) -> None:
    """Routed experts over the 35B-A3B bank: the kernel against the fp32 reference (a failure is reported),
    then its time per call against the bytes of the experts the routing hits (each read once) and of x and
    the output; the torch reference beside it at decode sizes (it reads the routing on the host: do_bench),
    and a sweep of the tiles."""
    from ninfer.ops.moe import moe_experts_ref, moe_route
    from ninfer.ops.triton.moe import default_config, moe_experts

    E, k, H, inter = (8, 2, 64, 32) if ctx.tiny else MOE_A3B
    tol = 1e-2 if ctx.dtype == torch.bfloat16 else 1e-5
    gate_up = ctx.randn(E, 2 * inter, H, scale=H ** -0.5)
    down = ctx.randn(E, H, inter, scale=inter ** -0.5)
    per_expert = nbytes(gate_up[0], down[0])

    def inputs(n):
        weights, ids = moe_route(torch.randn(n, E, device=ctx.device), k)
        return ctx.randn(n, H), ids, weights.to(ctx.dtype)

    def call(args, config=None):
        return partial(moe_experts, args[0], gate_up, down, args[1], args[2], config=config)

    for n in ([1, 3] if ctx.tiny else [1, 8, 64, 512, 4096]):
        x, ids, weights = inputs(n)
        ref = moe_experts_ref(x.float(), gate_up.float(), down.float(), ids, weights.float())
        out = moe_experts(x, gate_up, down, ids, weights).float()
        rel = ((out - ref).norm() / ref.norm()).item() if torch.isfinite(out).all() else math.inf
        ctx.log(f"moe N={n}: relative error {rel:.2e} against the fp32 reference (tolerance {tol:.0e})")
        if not rel <= tol:
            ctx.failed.append(f"moe N={n}: relative error {rel:.2e} over {tol:.0e}")
        hit = int(torch.unique(ids).numel())
        moved = hit * per_expert + 2 * nbytes(x) + nbytes(ids, weights)
        case = f"N={n} E={E} top{k} H={H} I={inter} ({hit} hit)"
        ctx.timing(case, nbytes=moved, note=_tiles(default_config(n, ctx.dtype)), make=lambda n=n: call(inputs(n)))
        if n <= 64 and ctx.gpu:
            ctx.timing(f"{case} torch reference", nbytes=moved, fn=partial(
                moe_experts_ref, x, gate_up, down, ids, weights))
        for cfg in _moe_sweep(n, ctx):
            try:
                ctx.timing(f"{case} sweep", nbytes=moved, note=_tiles(cfg), make=lambda n=n, c=cfg: call(inputs(n), c))
            except Exception as exc:  # a swept tile may not fit the SM (shared memory, registers): skip it
                ctx.log(f"moe N={n} {_tiles(cfg)}: {type(exc).__name__}: {exc}"[:200])


def _tiles(cfg) -> str:
    return f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"


def _moe_sweep(n: int, ctx) -> list:
    """Tiles to time beside the default at ``n`` tokens (none on the CPU)."""
    from ninfer.ops.triton.moe import MoeConfig

    if not ctx.gpu:
        return []
    if n <= 64:
        return [MoeConfig(16, bn, bk, 4, st) for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 4)]
    return [MoeConfig(bm, bn, 64, w, 3) for bm in (16, 32, 64, 128) for bn, w in ((128, 4), (256, 8))]


@timed("moe_block")
def time_moe_block(ctx) -> None:
    """The sparse MoE block at decode sizes: the Triton block (``moe.moe_block``: the shared expert folded in as
    expert E, one routing-and-grouping program) against the fp32 parts, and timed beside the parts as they ran
    before it (route kernel, the shared expert's two linears, ``moe_experts`` joining them), against the bytes
    of the hit experts and the shared expert."""
    from ninfer.ops.moe import moe_block_ref
    from ninfer.ops.triton.moe import moe_block

    E, k, H, inter = (8, 2, 64, 32) if ctx.tiny else MOE_A3B
    tol = 1e-2 if ctx.dtype == torch.bfloat16 else 1e-5
    bank = (ctx.randn(E, 2 * inter, H, scale=H ** -0.5), ctx.randn(E, H, inter, scale=inter ** -0.5))
    shared = (ctx.randn(2 * inter, H, scale=H ** -0.5), ctx.randn(H, inter, scale=inter ** -0.5))
    per_expert = nbytes(bank[0][0], bank[1][0])

    def inputs(n):
        fused = ctx.randn(n, E + 1, scale=2.0)
        return ctx.randn(n, H), fused[:, :E], fused[:, E:]

    for n in ([1, 3] if ctx.tiny else [1, 2, 8, 16]):
        x, logits, gate = inputs(n)
        args = (x, logits, gate, *bank, *shared, k)
        ref = moe_block_ref(*(t.float() for t in args[:-1]), k)
        out = moe_block(*args).float()
        rel = ((out - ref).norm() / ref.norm()).item() if torch.isfinite(out).all() else math.inf
        ctx.log(f"moe_block N={n}: relative error {rel:.2e} against the fp32 parts (tolerance {tol:.0e})")
        if not rel <= tol:
            ctx.failed.append(f"moe_block N={n}: relative error {rel:.2e} over {tol:.0e}")
        hit = int(torch.unique(torch.topk(logits.float(), k, dim=-1).indices).numel())
        moved = (hit + 1) * per_expert + 2 * nbytes(x) + nbytes(logits)
        case = f"N={n} E={E} top{k} H={H} I={inter} ({hit} hit + shared)"

        def call(fn, n=n):
            return partial(fn, *inputs(n), *bank, *shared, k)

        ctx.timing(f"{case} folded", nbytes=moved, make=lambda c=call: c(moe_block))
        ctx.timing(f"{case} parts", nbytes=moved, make=lambda c=call: c(moe_block_ref))
