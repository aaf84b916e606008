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
Python). The full log and a JSON file go to ``--out``. ``--shape tiny`` with
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
from collections.abc import Callable
from functools import partial

import attrs
import torch

from benchmarks.shapes import MOE_SHAPES, SHAPES

TIMINGS: dict[str, Callable[[Ctx], None]] = {}


def timed(name: str):
    def register(fn):
        TIMINGS[name] = fn
        return fn
    return register


@attrs.frozen
class Result:
    check: str
    case: str
    ms: float | None = None
    gbytes: float | None = None  # bytes the kernel must move, in GB
    tbps: float | None = None
    copy_frac: float | None = None  # achieved bandwidth over the measured copy bandwidth
    tflops: float | None = None
    note: str = ""


@attrs.define
class Ctx:
    shape: str
    cfg: dict
    device: str
    dtype: torch.dtype
    out_dir: str
    log_file: object
    copy_tbps: float | None = None
    results: list[Result] = attrs.field(factory=list)
    failed: list[str] = attrs.field(factory=list)
    current: str = ""

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def tiny(self) -> bool:
        return self.shape == "tiny"

    def log(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def randn(self, *shape, scale: float = 1.0, dtype=None) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device, dtype=torch.float32) * scale
        return t.to(dtype or self.dtype)

    def timing(self, case: str, *, make=None, fn=None, nbytes: int | None = None, flops: float | None = None,
               note: str = "") -> None:
        """One row: ``make()`` returns a fresh call on fresh inputs (timed in a graph), or ``fn`` is one call."""
        if not self.gpu:
            if make is not None:
                make()()  # CPU smoke run: the factory and its keywords work
            return
        r = Result(self.current, case, **self._time(make, fn, nbytes, flops, note))
        self.results.append(r)
        self.log(format_row(r))

    def _time(self, make, fn, nbytes, flops, note) -> dict:
        if make is not None:
            sets = 8 if not nbytes else max(1, min(64, -(-ROTATE_BYTES // nbytes)))
            ms = graph_bench([make() for _ in range(sets)])
            note = f"{note} graph x{sets} sets".strip()
        else:
            ms = bench(fn)
            note = f"{note} do_bench".strip()
        out = {"ms": ms, "note": note}
        if nbytes:
            tbps = nbytes / (ms * 1e-3) / 1e12
            out.update(gbytes=nbytes / 1e9, tbps=tbps, copy_frac=tbps / self.copy_tbps if self.copy_tbps else None)
        if flops:
            out["tflops"] = flops / (ms * 1e-3) / 1e12
        return out


ROTATE_BYTES = 256 * 2**20  # well past the H200's 60 MB of L2


def graph_bench(fns: list[Callable], min_calls: int = 32, replays: int = 10) -> float:
    """Median ms per call of fns (cycled to at least min_calls calls) captured in one CUDA graph."""
    calls = fns * max(1, -(-min_calls // len(fns)))
    for f in fns:  # compile and warm outside the capture
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    del graph
    return times[len(times) // 2] / len(calls)


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median"))


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def format_row(r: Result) -> str:
    def f(x, spec):
        return format(x, spec) if x is not None else "-"
    return (f"{r.check:<24} {r.case:<44} {f(r.ms and r.ms * 1e3, '9.1f')} us  {f(r.tbps, '5.2f')} TB/s "
            f"({f(r.copy_frac and r.copy_frac * 100, '3.0f')}% copy)  {f(r.tflops, '6.1f')} TFLOP/s  {r.note}")


# ------------------------------------------------------------------------------------------------ dims


def dims(cfg: dict) -> dict:
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    return {
        "hidden": cfg["hidden_size"], "inter": cfg["intermediate_size"], "eps": cfg["rms_norm_eps"],
        "heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
        "rotary_dim": int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 0.25)),
        "hk": hk, "hv": hv, "dk": dk, "dv": dv, "conv_dim": 2 * hk * dk + hv * dv,
        "conv_k": cfg["linear_conv_kernel_dim"],
    }


def sizes(ctx: Ctx) -> dict:
    if ctx.tiny:
        return {"tokens": [1, 5], "batches": [1, 3], "rows": [1, 3], "contexts": [20, 37], "page": 4,
                "prefill": [(9, 0), (6, 11)], "mixed": [(5, 7), (3, 0), (1, 30)], "gdn_T": [1, 70],
                "conv_T": [1, 9]}
    return {"tokens": [1, 8, 4096], "batches": [1, 8], "rows": [1, 2, 4, 8], "contexts": [1024, 8192], "page": 16,
            "prefill": [(4096, 0), (2048, 4096)], "mixed": [(1000, 3000), (512, 0), (1, 7000), (1, 100)],
            "gdn_T": [1, 63, 1000, 4096], "conv_T": [1, 3, 1000, 4096]}


def _state_image(ctx: Ctx, slots: int, per_slot: tuple, pad: int, dtype) -> torch.Tensor:
    """A strided [slots, *per_slot] view into a wider per-slot image, as the Program's state pools hand out."""
    size = math.prod(per_slot)
    return ctx.randn(slots, size + 2 * pad, scale=0.1, dtype=dtype)[:, pad:pad + size].view(slots, *per_slot)


# ------------------------------------------------------------------------------------------------ timings


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
    from ninfer.ops.triton.gdn import _default_block_v, gdn_decode

    d = dims(ctx.cfg)
    per_slot = (d["hv"], d["dk"], d["dv"])

    def inputs(B):
        return (ctx.randn(B, d["hk"], d["dk"]), ctx.randn(B, d["hk"], d["dk"]), ctx.randn(B, d["hv"], d["dv"]),
                -torch.rand(B, d["hv"], device=ctx.device) * 2, torch.rand(B, d["hv"], device=ctx.device),
                _state_image(ctx, B, per_slot, 32, torch.float32), torch.randperm(B, device=ctx.device))

    for B in sizes(ctx)["rows"]:
        moved = 2 * B * math.prod(per_slot) * 4 + B * (2 * d["hk"] * d["dk"] + 2 * d["hv"] * d["dv"]) * 2 \
            + 2 * B * d["hv"] * 4  # state read and written, q k v o, the fp32 gates
        ctx.timing(f"B={B}", nbytes=moved, make=lambda B=B: partial(gdn_decode, *inputs(B)),
                   note=f"block_v {_default_block_v(B, d['hv'], d['dv'])}")
        for block_v in (16, 32, 64):
            for warps in (2, 4, 8):
                ctx.timing(f"B={B} block_v {block_v} warps {warps}", nbytes=moved, make=lambda B=B, bv=block_v,
                           w=warps: partial(gdn_decode, *inputs(B), block_v=bv, num_warps=w))


@timed("gdn_decode_fused")
def time_gdn_decode_fused(ctx: Ctx) -> None:
    """The fused GDN decode step beside the unfused kernel sequence it replaces (gates, conv, gdn_decode) on the
    same bytes, and its block_v x warps sweep."""
    from ninfer.ops.triton.conv1d import causal_conv1d_decode
    from ninfer.ops.triton.gdn import _default_block_v, gdn_decode, gdn_decode_fused, gdn_gates

    d = dims(ctx.cfg)
    hk, hv, dk, dv, C, K = d["hk"], d["hv"], d["dk"], d["dv"], d["conv_dim"], d["conv_k"]

    def inputs(B):
        proj = ctx.randn(B, C + 2 * hv, scale=2.0)  # mixed, b and a: column slices of one in_proj output row
        return (proj[:, :C], proj[:, C + hv:], proj[:, C:C + hv], ctx.randn(C, K, scale=0.5),
                ctx.randn(B, C, K + 1)[:, :, 1:K], ctx.randn(hv, dtype=torch.float32),
                ctx.randn(hv, dtype=torch.float32), _state_image(ctx, B, (hv, dk, dv), 32, torch.float32),
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
                   note=f"block_v {_default_block_v(B, hv, dv)}")
        ctx.timing(f"B={B} unfused gates+conv+gdn_decode", nbytes=moved, note="bytes of the fused op",
                   make=lambda B=B: partial(unfused, *inputs(B)))
        for block_v in (16, 32, 64):
            for warps in (2, 4, 8):
                ctx.timing(f"B={B} block_v {block_v} warps {warps}", nbytes=moved, make=lambda B=B, bv=block_v,
                           wp=warps: partial(gdn_decode_fused, *inputs(B), block_v=bv, num_warps=wp))


def _paged_inputs(ctx: Ctx, seqs: list[tuple[int, int]]):
    """Paged K/V for sequences given as (query length, earlier context), pages scattered at random."""
    d = dims(ctx.cfg)
    page = sizes(ctx)["page"]
    seq_lens = [q + c for q, c in seqs]
    width = max(-(-s // page) for s in seq_lens)
    n_pages = sum(-(-s // page) for s in seq_lens) + 7
    perm = torch.randperm(n_pages, device=ctx.device).to(torch.int32)
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32, device=ctx.device)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // page)
        block_tables[i, :n] = perm[used:used + n]
        used += n
    k_cache = ctx.randn(n_pages, page, d["kv_heads"], d["head_dim"])
    v_cache = ctx.randn(n_pages, page, d["kv_heads"], d["head_dim"])
    q_lens = [q for q, _ in seqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=ctx.device)
    q = ctx.randn(int(qsl[-1]), d["heads"], d["head_dim"])
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=ctx.device)
    return (q, k_cache, v_cache, block_tables, seq_t, qsl, max(q_lens), max(seq_lens), d["head_dim"] ** -0.5)


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
    from ninfer.ops.triton.attention import _decode_splits

    sz = sizes(ctx)
    cases = [[(1, c - 1)] * b for b in sz["batches"] for c in sz["contexts"]]
    gen = torch.Generator().manual_seed(0)
    longest = max(sz["contexts"])
    cases.append([(1, int(torch.randint(0, longest, (1,), generator=gen))) for _ in range(max(sz["batches"]))])
    kv_heads = dims(ctx.cfg)["kv_heads"]
    for seqs in cases:
        moved, _ = _attn_cost(ctx, seqs)
        splits = _decode_splits(len(seqs), kv_heads, max(q + c for q, c in seqs), 32)
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


@timed("moe")
def time_moe(ctx: Ctx) -> None:
    """The routed experts over the 35B-A3B bank and their tile sweep (``benchmarks/gpu_check_moe.py``)."""
    from benchmarks import gpu_check_moe

    gpu_check_moe.time_moe(ctx, nbytes)


@timed("moe_block")
def time_moe_block(ctx: Ctx) -> None:
    """The decode MoE block, folded against its parts (``benchmarks/gpu_check_moe.py``)."""
    from benchmarks import gpu_check_moe

    gpu_check_moe.time_moe_block(ctx, nbytes)


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

    for module in ("norm", "activation", "rope", "gdn", "conv1d", "attention", "linear", "sampling", "moe"):
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
    if "copy" not in names:
        names.insert(0, "copy")
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
