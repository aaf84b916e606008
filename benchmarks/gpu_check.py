"""GPU timings: every Triton kernel at Qwen3.5 shapes in bf16, beside what it replaces (torch, cuBLAS, the
unfused kernel sequence), and the configuration sweeps its defaults were chosen from.

Correctness is the job of ``ninfer-core/tests/gpu`` (``python3 -m pytest -q -m gpu ninfer-core/tests/gpu``);
only the ``moe`` entry also checks its kernel against the reference, on the routings it times. Run on the GPU
machine through ``scripts/gpu-check`` (the tests, then this):

    scripts/gpu-check                     # tests, then every timing at 9B shapes
    scripts/gpu-check --only linear --shape 0.8b
    scripts/gpu-check --list

A row is the median time per call of CUDA-graph replays over fresh input sets rotated so that together they
exceed L2 (memory-bound kernels then read HBM; no launch gaps), against the bytes the kernel must move and
the copy bandwidth measured in the same run; fla's prefill is timed with ``do_bench`` too (it launches from
Python). The full log and a JSON file go to ``--out``. The harness is ``benchmarks/gpu_harness.py``; the attention
and MoE timings live in ``gpu_check_attention.py`` and ``gpu_check_moe.py``. ``--shape tiny`` with
``TRITON_INTERPRET=1`` calls every input factory once on the CPU (a smoke test of this script, no timings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from functools import partial

import attrs
import torch

from benchmarks import gpu_check_attention, gpu_check_moe  # noqa: F401  (their timings register on import)
from benchmarks.gpu_harness import TIMINGS, Ctx, Result, dims, format_row, nbytes, sizes, state_image, timed
from benchmarks.shapes import MOE_SHAPES, SHAPES


@timed("copy")
def time_copy(ctx: Ctx) -> None:
    """Device-to-device copy bandwidth (bytes read + written), the ceiling for the memory-bound kernels."""
    if not ctx.gpu:
        return
    from benchmarks.ceilings import copy_bandwidth

    ctx.copy_tbps = copy_bandwidth(2.0)
    r = Result("copy", "2 GiB device-to-device", tbps=ctx.copy_tbps, copy_frac=1.0)
    ctx.results.append(r)
    ctx.log(format_row(r))


@timed("rms_norm")
def time_rms_norm(ctx: Ctx) -> None:
    from ninfer.ops.triton.norm import rms_norm

    d = dims(ctx.cfg)
    eps, H, D = d["eps"], d["heads"], d["head_dim"]
    for n in sizes(ctx)["tokens"]:
        for shape in ((n, d["hidden"]), (n, H, D)):
            ctx.timing(f"x{list(shape)}", nbytes=(2 * math.prod(shape) + shape[-1]) * 2, make=lambda s=shape: partial(
                rms_norm, ctx.randn(*s), ctx.randn(s[-1], scale=0.1), eps))
        # The model's q: the query half of each head's [query | gate] block, read in place.
        ctx.timing(f"q of [query|gate] [{n},{H},{2 * D}]", nbytes=2 * n * H * D * 2, make=lambda n=n: partial(
            rms_norm, ctx.randn(n, H, 2 * D)[..., :D], ctx.randn(D, scale=0.1), eps))


@timed("rms_norm_gated")
def time_rms_norm_gated(ctx: Ctx) -> None:
    from ninfer.ops.triton.norm import rms_norm_gated

    d = dims(ctx.cfg)
    eps, hv, dv = d["eps"], d["hv"], d["dv"]
    for n in sizes(ctx)["tokens"]:
        ctx.timing(f"x,z[{n},{hv},{dv}]", nbytes=3 * n * hv * dv * 2, make=lambda n=n: partial(
            rms_norm_gated, ctx.randn(n, hv, dv), ctx.randn(n, hv, dv), 1.0 + ctx.randn(dv, scale=0.1), eps))


@timed("add_rms_norm")
def time_add_rms_norm(ctx: Ctx) -> None:
    """Residual add + RMSNorm in one kernel, beside the torch add + rms_norm kernel on the same bytes."""
    from ninfer.ops.triton.norm import add_rms_norm, rms_norm

    d = dims(ctx.cfg)
    H, eps = d["hidden"], d["eps"]

    def unfused(x, r, w, out, r_out):
        torch.add(r, x, out=r_out)
        return rms_norm(r_out, w, eps, out=out)

    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            x = ctx.randn(n, H)
            return x, ctx.randn(n, H), ctx.randn(H, scale=0.1), torch.empty_like(x), torch.empty_like(x)

        moved = nbytes(*inputs())
        ctx.timing(f"x,res[{n},{H}]", nbytes=moved, make=lambda f=inputs: partial(
            lambda x, r, w, o, ro: add_rms_norm(x, r, w, eps, out=o, residual_out=ro), *f()))
        ctx.timing(f"unfused add + rms_norm [{n},{H}]", nbytes=moved, note="bytes of the fused op",
                   make=lambda f=inputs: partial(unfused, *f()))


@timed("linear")
def time_linear(ctx: Ctx) -> None:
    """The few-row linear at every distinct decode weight shape beside cuBLAS on the same bytes, and the
    block_n x block_k x split sweep at 1 and 8 rows that ``_MEASURED`` was chosen from."""
    import torch.nn.functional as F

    from benchmarks.shapes import decode_weight_shapes
    from ninfer.ops.triton.linear import default_config, linear

    for N, K in sorted(set(decode_weight_shapes(ctx.cfg))):
        def inputs(M, N=N, K=K):
            return ctx.randn(M, K), ctx.randn(N, K, scale=K ** -0.5)

        lm_head = N == ctx.cfg["vocab_size"]
        for M in sizes(ctx)["rows"]:
            moved = (M * K + N * K + M * N) * 2
            ctx.timing(f"[{N}x{K}] M={M}", nbytes=moved, make=lambda M=M, f=inputs: partial(linear, *f(M)),
                       note=f"cfg {default_config(N, K)}")
            ctx.timing(f"[{N}x{K}] M={M} cuBLAS F.linear", nbytes=moved,
                       make=lambda M=M, f=inputs: partial(F.linear, *f(M)))
            if lm_head or M not in (1, 8) or ctx.tiny:
                continue
            for bn in (16, 32, 64):
                for bk in (128, 256):
                    for split in (1, 2, 4, 8):
                        if K // split < bk:
                            continue
                        ctx.timing(f"[{N}x{K}] M={M} block_n {bn} block_k {bk} split {split}", nbytes=moved,
                                   make=lambda M=M, f=inputs, bn=bn, bk=bk, sp=split: partial(
                                       linear, *f(M), block_n=bn, block_k=bk, split_k=sp))


@timed("swiglu")
def time_swiglu(ctx: Ctx) -> None:
    """The MLP's gate_up projection with silu_and_mul as its epilogue, beside the unfused kernels it replaces."""
    import torch.nn.functional as F

    from ninfer.ops.triton.activation import silu_and_mul
    from ninfer.ops.triton.linear import linear, swiglu

    H, inter = ctx.cfg["hidden_size"], dims(ctx.cfg)["inter"]
    for M in sizes(ctx)["rows"]:
        def inputs(M=M):
            return ctx.randn(M, H), ctx.randn(2 * inter, H, scale=H ** -0.5)

        moved = (M * H + 2 * inter * H + M * inter) * 2
        ctx.timing(f"[{2 * inter}x{H}] M={M}", nbytes=moved, make=lambda f=inputs: partial(swiglu, *f()))
        ctx.timing(f"[{2 * inter}x{H}] M={M} unfused Triton", nbytes=moved,
                   make=lambda f=inputs: partial(lambda a, b: silu_and_mul(linear(a, b)), *f()))
        if M in (1, 8):
            ctx.timing(f"[{2 * inter}x{H}] M={M} unfused cuBLAS", nbytes=moved,
                       make=lambda f=inputs: partial(lambda a, b: silu_and_mul(F.linear(a, b)), *f()))
            for bn in (16, 32, 64):
                ctx.timing(f"[{2 * inter}x{H}] M={M} block_n {bn}", nbytes=moved,
                           make=lambda f=inputs, bn=bn: partial(swiglu, *f(), block_n=bn))


@timed("linear_fp32_out")
def time_linear_fp32_out(ctx: Ctx) -> None:
    """The lm_head with fp32 logits straight from the kernel's accumulator, beside the bf16 kernel + .float()."""
    from ninfer.ops.triton.linear import default_config, linear

    V, K = ctx.cfg["vocab_size"], ctx.cfg["hidden_size"]
    for M in sizes(ctx)["batches"]:
        def inputs(M=M):
            return ctx.randn(M, K), ctx.randn(V, K, scale=K ** -0.5)

        moved = (M * K + V * K) * 2 + M * V * 4
        ctx.timing(f"[{V}x{K}] M={M} fp32 out", nbytes=moved, note=f"cfg {default_config(V, K)}",
                   make=lambda f=inputs: partial(linear, *f(), out_dtype=torch.float32))
        ctx.timing(f"[{V}x{K}] M={M} bf16 out + .float()", nbytes=moved,
                   make=lambda f=inputs: partial(lambda a, b: linear(a, b).float(), *f()))


@timed("greedy")
def time_greedy(ctx: Ctx) -> None:
    """The split-row argmax beside torch.argmax, Qwen3.5's and Qwen3's vocabularies."""
    from ninfer.ops.triton.sampling import greedy

    vocabs = [ctx.cfg["vocab_size"], 3001] if ctx.tiny else [248320, 151936]
    dtypes = [torch.bfloat16, torch.float32] if ctx.gpu else [torch.float16, torch.float32]
    for V in vocabs:
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            for B in sizes(ctx)["rows"]:
                def inputs(B=B, V=V, dtype=dtype):
                    return ctx.randn(B, V, scale=3.0, dtype=dtype)

                moved = B * V * torch.finfo(dtype).bits // 8
                ctx.timing(f"{name} [{B}x{V}]", nbytes=moved, make=lambda f=inputs: partial(greedy, f()))
                ctx.timing(f"{name} [{B}x{V}] torch.argmax", nbytes=moved,
                           make=lambda f=inputs: partial(torch.argmax, f(), -1))


@timed("apply_token_mask")
def time_apply_token_mask(ctx: Ctx) -> None:
    """The constrained-decoding mask (random bits: half the tokens refused) beside its torch reference, up to
    32 rows (8 sequences x 4 verify positions)."""
    from ninfer.ops.sampling import apply_token_mask_ref
    from ninfer.ops.triton.sampling import apply_token_mask

    V = ctx.cfg["vocab_size"] if ctx.tiny else 248320
    dtypes = [torch.bfloat16, torch.float32] if ctx.gpu else [torch.float16, torch.float32]
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for B in sizes(ctx)["rows"] + [32]:
            def inputs(B=B, dtype=dtype):
                mask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), dtype=torch.int32, device=ctx.device)
                return ctx.randn(B, V, dtype=dtype), mask

            moved = B * ((V + 31) // 32) * 4 + B * V * torch.finfo(dtype).bits // 16  # mask read, half the row written
            ctx.timing(f"{name} [{B}x{V}]", nbytes=moved, make=lambda f=inputs: partial(apply_token_mask, *f()))
            ctx.timing(f"{name} [{B}x{V}] torch reference", nbytes=moved,
                       make=lambda f=inputs: partial(apply_token_mask_ref, *f()))


@timed("silu_and_mul")
def time_silu_and_mul(ctx: Ctx) -> None:
    from ninfer.ops.triton.activation import silu_and_mul

    inter = dims(ctx.cfg)["inter"]
    for n in sizes(ctx)["tokens"]:
        ctx.timing(f"x[{n},{2 * inter}]", nbytes=3 * n * inter * 2,
                   make=lambda n=n: partial(silu_and_mul, ctx.randn(n, 2 * inter)))


@timed("apply_rope")
def time_apply_rope(ctx: Ctx) -> None:
    from ninfer.ops.rope import rope_cos_sin
    from ninfer.ops.triton.rope import apply_rope

    d = dims(ctx.cfg)
    rot = d["rotary_dim"]
    for n in sizes(ctx)["tokens"]:
        for heads in (d["heads"], d["kv_heads"]):
            def inputs(n=n, heads=heads):
                cos, sin = rope_cos_sin(torch.randint(0, 8192, (n,), device=ctx.device), rot, 1e7, torch.float32)
                return ctx.randn(n, heads, d["head_dim"]), cos, sin

            ctx.timing(f"x[{n},{heads},{d['head_dim']}] rot {rot}", nbytes=nbytes(*inputs()) + n * heads
                       * d["head_dim"] * 2, make=lambda f=inputs: partial(apply_rope, *f(), rot))


@timed("gdn_gates")
def time_gdn_gates(ctx: Ctx) -> None:
    from ninfer.ops.triton.gdn import gdn_gates

    hv = dims(ctx.cfg)["hv"]
    for n in sizes(ctx)["tokens"]:
        ctx.timing(f"a,b[{n},{hv}]", nbytes=n * hv * (2 * 2 + 2 * 4), make=lambda n=n: partial(
            gdn_gates, ctx.randn(n, hv, scale=3.0), ctx.randn(n, hv, scale=3.0), ctx.randn(hv, dtype=torch.float32),
            ctx.randn(hv, dtype=torch.float32)))


@timed("gdn_decode")
def time_gdn_decode(ctx: Ctx) -> None:
    """The recurrent decode step, and its block_v x warps sweep."""
    from ninfer.ops.triton import tuning
    from ninfer.ops.triton.gdn import gdn_decode
    from ninfer.ops.triton.gdn_shared import default_block_v

    d = dims(ctx.cfg)
    per_slot = (d["hv"], d["dk"], d["dv"])

    def inputs(B):
        return (ctx.randn(B, d["hk"], d["dk"]), ctx.randn(B, d["hk"], d["dk"]), ctx.randn(B, d["hv"], d["dv"]),
                -torch.rand(B, d["hv"], device=ctx.device) * 2, torch.rand(B, d["hv"], device=ctx.device),
                state_image(ctx, B, per_slot, 32, torch.float32), torch.randperm(B, device=ctx.device))

    for B in sizes(ctx)["rows"]:
        moved = 2 * B * math.prod(per_slot) * 4 + B * (2 * d["hk"] * d["dk"] + 2 * d["hv"] * d["dv"]) * 2 \
            + 2 * B * d["hv"] * 4  # state read and written, q k v o, the fp32 gates
        ctx.timing(f"B={B}", nbytes=moved, make=lambda B=B: partial(gdn_decode, *inputs(B)),
                   note=f"block_v {default_block_v(B, d['hv'], d['dv'], tuning.device_key(torch.device(ctx.device)))}")
        for block_v in (16, 32, 64):
            for warps in (2, 4, 8):
                ctx.timing(f"B={B} block_v {block_v} warps {warps}", nbytes=moved, make=lambda B=B, bv=block_v,
                           w=warps: partial(gdn_decode, *inputs(B), block_v=bv, num_warps=w))


@timed("gdn_decode_fused")
def time_gdn_decode_fused(ctx: Ctx) -> None:
    """The fused GDN decode step beside the unfused kernel sequence it replaces (gates, conv, gdn_decode) on the
    same bytes, and its block_v x warps sweep."""
    from ninfer.ops.triton import tuning
    from ninfer.ops.triton.conv1d import causal_conv1d_decode
    from ninfer.ops.triton.gdn import gdn_decode, gdn_decode_fused, gdn_gates
    from ninfer.ops.triton.gdn_shared import default_block_v

    d = dims(ctx.cfg)
    hk, hv, dk, dv, C, K = d["hk"], d["hv"], d["dk"], d["dv"], d["conv_dim"], d["conv_k"]

    def inputs(B):
        proj = ctx.randn(B, C + 2 * hv, scale=2.0)  # mixed, b and a: column slices of one in_proj output row
        return (proj[:, :C], proj[:, C + hv:], proj[:, C:C + hv], ctx.randn(C, K, scale=0.5),
                ctx.randn(B, C, K + 1)[:, :, 1:K], ctx.randn(hv, dtype=torch.float32),
                ctx.randn(hv, dtype=torch.float32), state_image(ctx, B, (hv, dk, dv), 32, torch.float32),
                torch.randperm(B, device=ctx.device))

    def unfused(mixed, a, b, w, conv_states, a_log, dt_bias, states, slots):
        B = mixed.shape[0]
        g, beta = gdn_gates(a, b, a_log, dt_bias)
        q, k, v = causal_conv1d_decode(mixed, w, conv_states, slots).split((hk * dk, hk * dk, hv * dv), dim=-1)
        return gdn_decode(q.view(B, hk, dk), k.view(B, hk, dk), v.view(B, hv, dv), g, beta, states, slots)

    for B in sizes(ctx)["rows"]:
        moved = (2 * B * hv * dk * dv * 4 + 2 * B * C * (K - 1) * 2 + (B * (C + 2 * hv + hv * dv) + C * K) * 2
                 + 2 * hv * 4)  # both states read and written, inputs and output, the conv and gate weights
        ctx.timing(f"B={B}", nbytes=moved, make=lambda B=B: partial(gdn_decode_fused, *inputs(B)),
                   note=f"block_v {default_block_v(B, hv, dv, tuning.device_key(torch.device(ctx.device)))}")
        ctx.timing(f"B={B} unfused gates+conv+gdn_decode", nbytes=moved, note="bytes of the fused op",
                   make=lambda B=B: partial(unfused, *inputs(B)))
        for block_v in (16, 32, 64):
            for warps in (2, 4, 8):
                ctx.timing(f"B={B} block_v {block_v} warps {warps}", nbytes=moved, make=lambda B=B, bv=block_v,
                           wp=warps: partial(gdn_decode_fused, *inputs(B), block_v=bv, num_warps=wp))


@timed("causal_conv1d_decode")
def time_conv1d_decode(ctx: Ctx) -> None:
    from ninfer.ops.triton.conv1d import causal_conv1d_decode

    d = dims(ctx.cfg)
    C, K = d["conv_dim"], d["conv_k"]
    for B in sizes(ctx)["batches"]:
        S = 3 * B + 2
        ctx.timing(f"B={B} C={C}", nbytes=(2 * B * C + C * K + 2 * B * C * (K - 1)) * 2, make=lambda B=B, S=S: partial(
            causal_conv1d_decode, ctx.randn(B, C), ctx.randn(C, K, scale=0.5), ctx.randn(S, C, K + 1)[:, :, 1:K],
            torch.randperm(S, device=ctx.device)[:B]))


@timed("causal_conv1d_prefill")
def time_conv1d_prefill(ctx: Ctx) -> None:
    from ninfer.ops.triton.conv1d import causal_conv1d_prefill

    d = dims(ctx.cfg)
    C, K = d["conv_dim"], d["conv_k"]
    for T in sizes(ctx)["conv_T"]:
        for has_state in (False, True):
            ctx.timing(f"T={T} init={has_state}", nbytes=(2 * T * C + C * K + 2 * C * (K - 1)) * 2,
                       make=lambda T=T, hs=has_state: partial(
                           causal_conv1d_prefill, ctx.randn(T, C), ctx.randn(C, K, scale=0.5), ctx.randn(C, K - 1),
                           hs))


@timed("gdn_prefill")
def time_gdn_prefill(ctx: Ctx) -> None:
    """fla-core's chunked kernel (GPU only), eager and inside a CUDA graph."""
    if not ctx.gpu:
        return
    from ninfer.ops.triton.gdn import fla_available, gdn_prefill

    if not fla_available():
        ctx.log("gdn_prefill: fla-core not importable (carry its wheel in .whl/); not timed")
        return
    d = dims(ctx.cfg)

    def inputs(T):
        return (ctx.randn(T, d["hk"], d["dk"]), ctx.randn(T, d["hk"], d["dk"]), ctx.randn(T, d["hv"], d["dv"]),
                torch.nn.functional.logsigmoid(torch.randn(T, d["hv"], device=ctx.device)),
                torch.rand(T, d["hv"], device=ctx.device),
                ctx.randn(d["hv"], d["dk"], d["dv"], scale=0.1, dtype=torch.float32))

    for T in sizes(ctx)["gdn_T"]:
        q, k, v, g, beta, state = inputs(T)
        moved = nbytes(q, k, v, g, beta, v) + 2 * nbytes(state)
        for has_state in (False, True):
            ctx.timing(f"T={T} init={has_state}", nbytes=moved, fn=lambda a=(q, k, v, g, beta, state), hs=has_state:
                       gdn_prefill(*a, hs))
    # fla launches many kernels from Python (do_bench above is host-bound): also time it inside a graph.
    T = max(sizes(ctx)["gdn_T"])
    q, k, v, g, beta, state = inputs(T)
    try:
        ctx.timing(f"T={T} init=True in a CUDA graph", nbytes=nbytes(q, k, v, g, beta, v) + 2 * nbytes(state),
                   make=lambda: partial(gdn_prefill, q, k, v, g, beta, state, True, out=torch.empty_like(v)))
    except Exception as exc:  # fla may sync on the host; then prefill stays eager, as planned
        ctx.log(f"fla chunk_gated_delta_rule not graph-capturable: {type(exc).__name__}: {exc}"[:300])


def report_kernels(ctx: Ctx) -> None:
    """Registers, spills and shared memory of every compiled variant of our kernels (the compiler's report)."""
    import importlib

    import triton

    for module in ("norm", "activation", "rope", "gdn", "conv1d", "attention", "linear", "sampling", "moe",
                   "moe_route", "moe_align_kernel", "moe_route_align"):
        mod = importlib.import_module(f"ninfer.ops.triton.{module}")
        for name, fn in vars(mod).items():
            if not isinstance(fn, triton.runtime.JITFunction):
                continue
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    try:
                        kernel._init_handles()
                        meta = kernel.metadata
                        consts = {k: v for k, v in getattr(kernel, "constants", {}).items()
                                  if isinstance(v, (int, bool, str))}
                        ctx.log(f"kernel {module}.{name}: regs {kernel.n_regs} spills {kernel.n_spills} "
                                f"shared {meta.shared} warps {meta.num_warps} stages {meta.num_stages} {consts}")
                    except Exception as exc:  # the report is informational only
                        ctx.log(f"kernel {module}.{name}: no resource report ({type(exc).__name__}: {exc})")


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated timing names (default: all)")
    p.add_argument("--list", action="store_true", help="list the timings and exit")
    p.add_argument("--shape", default="9b", choices=sorted(SHAPES) + sorted(MOE_SHAPES),
                   help="a dense shape, or a MoE shape for the dense decode weights' timings (linear)")
    p.add_argument("--out", default=os.environ.get("OUT") or ".gpu-out", help="folder for the log and JSON")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(TIMINGS))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(TIMINGS)
    unknown = [n for n in names if n not in TIMINGS]
    if unknown:
        p.error(f"unknown timing(s) {unknown}; known: {', '.join(TIMINGS)}")
    names = ["copy"] + [n for n in names if n != "copy"]  # the bandwidth the other rows are compared with
    gpu = torch.cuda.is_available()
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("no CUDA device: run on the GPU machine, or set TRITON_INTERPRET=1 with --shape tiny")
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    with open(os.path.join(args.out, "gpu_check.log"), "w") as log_file:
        ctx = Ctx(args.shape, SHAPES.get(args.shape) or MOE_SHAPES[args.shape], "cuda" if gpu else "cpu",
                  torch.bfloat16 if gpu else torch.float32, args.out, log_file)
        if gpu:
            import triton

            ctx.log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
        t_all = time.perf_counter()
        for name in names:
            ctx.current = name
            t0 = time.perf_counter()
            try:
                TIMINGS[name](ctx)
            except Exception as exc:  # a broken timing is reported and the others still run
                ctx.log(traceback.format_exc())
                ctx.failed.append(f"{name}: {type(exc).__name__}: {exc}"[:200])
            ctx.log(f"# {name} took {time.perf_counter() - t0:.1f} s")
        ctx.log(f"# all timings took {time.perf_counter() - t_all:.1f} s")
        if gpu:
            report_kernels(ctx)
        summary = {"shape": args.shape, "device": torch.cuda.get_device_name() if gpu else "cpu",
                   "copy_tbps": ctx.copy_tbps, "failed": ctx.failed,
                   "results": [attrs.asdict(r) for r in ctx.results]}
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(summary, f, indent=1)
        ctx.log(f"{len(ctx.results)} rows timed; {len(ctx.failed)} timings failed" +
                "".join(f"\n  {f}" for f in ctx.failed))
    return 1 if ctx.failed else 0


if __name__ == "__main__":
    sys.exit(main())
