"""GPU check: every Triton kernel against its torch reference at Qwen3.5-9B shapes, in bf16, with timings.

Run on the GPU machine through ``scripts/gpu-check`` (it installs the carried wheels and sets the paths):

    scripts/gpu-check                     # every check
    scripts/gpu-check --only gdn_decode,paged_attention_decode
    scripts/gpu-check --list

Each check draws fresh random inputs, poisons the output buffers (NaN) before the kernel runs, compares
with the pure-torch reference computed in fp32 on the upcast inputs (‖out − ref‖ / ‖ref‖ and the largest
absolute error, against a stated tolerance), checks that in-place state updates touch only their slots,
and times the kernel (median of ``triton.testing.do_bench``, which flushes L2 before every run) against
the bytes it must move and the copy bandwidth measured in the same run. A table is printed last; the
full log and a JSON file go to ``--out``.

The checks are a named list (``@check``): the model-level checks and benchmarks join the same list.
``--shape tiny`` with ``TRITON_INTERPRET=1`` runs every check on the CPU at toy sizes (a smoke test of
this script, no timings).
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

from benchmarks.shapes import SHAPES

CHECKS: dict[str, Callable[[Ctx], None]] = {}


def check(name: str):
    def register(fn):
        CHECKS[name] = fn
        return fn
    return register


@attrs.frozen
class Result:
    check: str
    case: str
    ok: bool
    rel_err: float | None = None
    max_err: float | None = None
    tol: float | None = None
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

    def record(self, case: str, out, ref, tol: float, *, make=None, fn=None, nbytes: int | None = None,
               flops: float | None = None, note: str = "", extra_ok: bool = True) -> Result:
        """A checked row: errors of out against ref (computed first), then the timing of ``make``/``fn``."""
        rel, mx = errors(out, ref)
        ok = bool(rel <= tol) and extra_ok
        r = Result(self.current, case, ok, rel, mx, tol, note=note)
        if self.gpu and (make is not None or fn is not None):
            r = attrs.evolve(r, **self._time(make, fn, nbytes, flops, note))
        elif make is not None:
            make()()  # CPU smoke run: the timing's input factory works
        self.results.append(r)
        self.log(format_row(r))
        return r

    def timing(self, case: str, *, make=None, fn=None, nbytes: int | None = None, flops: float | None = None,
               note: str = "") -> None:
        """A timing-only row (a variant of a kernel whose result was checked above)."""
        if not self.gpu:
            if make is not None:
                make()()  # CPU smoke run: the variant's factory and keywords work
            return
        r = Result(self.current, case, True, **self._time(make, fn, nbytes, flops, note))
        self.results.append(r)
        self.log(format_row(r))

    def _time(self, make, fn, nbytes, flops, note) -> dict:
        if make is not None:
            # Fresh input sets, rotated so that together they exceed L2 (each call then reads from HBM
            # unless a single set is tiny), all launched from one CUDA graph (no launch gaps).
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

    def fail(self, case: str, note: str) -> None:
        r = Result(self.current, case, False, note=note)
        self.results.append(r)
        self.log(format_row(r))


def errors(out, ref) -> tuple[float, float]:
    """(‖out − ref‖ / ‖ref‖, max |out − ref|); NaN or inf anywhere in out gives inf."""
    if isinstance(out, (tuple, list)):
        pairs = [errors(o, r) for o, r in zip(out, ref, strict=True)]
        return max(p[0] for p in pairs), max(p[1] for p in pairs)
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf, math.inf
    diff = (o - r)
    denom = r.norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    return rel, diff.abs().max().item() if diff.numel() else 0.0


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


def poison(*tensors) -> None:
    for t in tensors:
        t.fill_(float("nan"))


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def format_row(r: Result) -> str:
    def f(x, spec):
        return format(x, spec) if x is not None else "-"
    status = "ok" if r.ok else "FAIL"
    return (f"{r.check:<24} {r.case:<34} {status:<4} rel {f(r.rel_err, '.2e'):>8} (tol {f(r.tol, '.0e'):>5}) "
            f"max {f(r.max_err, '.2e'):>8}  {f(r.ms and r.ms * 1e3, '9.1f')} us  {f(r.tbps, '5.2f')} TB/s "
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
        return {"tokens": [1, 5], "batches": [1, 3], "contexts": [20, 37], "page": 4,
                "prefill": [(9, 0), (6, 11)], "mixed": [(5, 7), (3, 0), (1, 30)], "gdn_T": [1, 9, 70],
                "conv_T": [1, 2, 9]}
    return {"tokens": [1, 8, 4096], "batches": [1, 8], "contexts": [1024, 8192], "page": 16,
            "prefill": [(4096, 0), (2048, 4096)], "mixed": [(1000, 3000), (512, 0), (1, 7000), (1, 100)],
            "gdn_T": [1, 63, 1000, 4096], "conv_T": [1, 3, 1000, 4096]}


def fp32(*tensors):
    return tuple(t.float() for t in tensors)


# ------------------------------------------------------------------------------------------------ checks


@check("copy")
def check_copy(ctx: Ctx) -> None:
    """Device-to-device copy bandwidth (bytes read + written), the ceiling for the memory-bound kernels."""
    if not ctx.gpu:
        return
    from benchmarks.ceilings import copy_bandwidth

    ctx.copy_tbps = copy_bandwidth(2.0)
    r = Result("copy", "2 GiB device-to-device", True, tbps=ctx.copy_tbps, copy_frac=1.0)
    ctx.results.append(r)
    ctx.log(format_row(r))


@check("rms_norm")
def check_rms_norm(ctx: Ctx) -> None:
    from ninfer.ops.norm import rms_norm_ref
    from ninfer.ops.triton.norm import rms_norm

    d = dims(ctx.cfg)
    for n in sizes(ctx)["tokens"]:
        for shape, width in (((n, d["hidden"]), d["hidden"]), ((n, d["heads"], d["head_dim"]), d["head_dim"])):
            def inputs(shape=shape, width=width):
                x = ctx.randn(*shape)
                return x, ctx.randn(width, scale=0.1), torch.empty_like(x)

            def run(x, w, out):
                return rms_norm(x, w, d["eps"], out=out)

            x, w, out = inputs()
            poison(out)
            run(x, w, out)
            ctx.record(f"x{list(shape)}", out, rms_norm_ref(*fp32(x, w), d["eps"]), 5e-3,
                       make=lambda inputs=inputs, run=run: partial(run, *inputs()), nbytes=nbytes(x, w, out))
        # The model's q: the query half of each head's [query | gate] block, read in place (heads=True) or
        # copied to rows first (the default until STRIDED_HEADS is set after this check).
        qg = ctx.randn(n, d["heads"], 2 * d["head_dim"])
        q, w = qg[..., :d["head_dim"]], ctx.randn(d["head_dim"], scale=0.1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for heads in (False, True):
            poison(out)
            rms_norm(q, w, d["eps"], out=out, heads=heads)
            ctx.record(f"q of [query|gate] [{n},{d['heads']},{2 * d['head_dim']}] heads={heads}", out,
                       rms_norm_ref(*fp32(q, w), d["eps"]), 5e-3,
                       make=lambda n=n, h=heads: partial(rms_norm, ctx.randn(n, d["heads"], 2 * d["head_dim"])[
                           ..., :d["head_dim"]], ctx.randn(d["head_dim"]), d["eps"], heads=h))
        for heads in (False, True):  # plain rows through both addressings
            x, w = ctx.randn(n, d["hidden"]), ctx.randn(d["hidden"], scale=0.1)
            ctx.record(f"x[{n},{d['hidden']}] heads={heads}", rms_norm(x, w, d["eps"], heads=heads),
                       rms_norm_ref(*fp32(x, w), d["eps"]), 5e-3)


@check("rms_norm_gated")
def check_rms_norm_gated(ctx: Ctx) -> None:
    from ninfer.ops.norm import rms_norm_gated_ref
    from ninfer.ops.triton.norm import rms_norm_gated

    d = dims(ctx.cfg)
    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            x = ctx.randn(n, d["hv"], d["dv"])
            return x, ctx.randn(n, d["hv"], d["dv"]), 1.0 + ctx.randn(d["dv"], scale=0.1), torch.empty_like(x)

        def run(x, z, w, out):
            return rms_norm_gated(x, z, w, d["eps"], out=out)

        x, z, w, out = inputs()
        poison(out)
        run(x, z, w, out)
        ctx.record(f"x,z[{n},{d['hv']},{d['dv']}]", out, rms_norm_gated_ref(*fp32(x, z, w), d["eps"]), 5e-3,
                   make=lambda inputs=inputs, run=run: partial(run, *inputs()), nbytes=nbytes(x, z, w, out))
        # z as the model passes it: a column slice of the in_proj output row, viewed per value head.
        C, V = d["conv_dim"], d["hv"] * d["dv"]
        proj = ctx.randn(n, C + V + 2 * d["hv"])
        z = proj[:, C:C + V].reshape(n, d["hv"], d["dv"])
        for heads in (False, True):
            poison(out)
            rms_norm_gated(x, z, w, d["eps"], out=out, heads=heads)
            ctx.record(f"z sliced from in_proj [{n},{C + V + 2 * d['hv']}] heads={heads}", out,
                       rms_norm_gated_ref(*fp32(x, z, w), d["eps"]), 5e-3)


@check("add_rms_norm")
def check_add_rms_norm(ctx: Ctx) -> None:
    """Residual add + RMSNorm in one kernel (x and the residual read once, both results written once), with the
    unfused torch add + rms_norm kernel timed on the same bytes for comparison."""
    from ninfer.ops.norm import add_rms_norm_ref
    from ninfer.ops.triton.norm import add_rms_norm, rms_norm

    d = dims(ctx.cfg)
    H, eps = d["hidden"], d["eps"]
    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            x = ctx.randn(n, H)
            return x, ctx.randn(n, H), ctx.randn(H, scale=0.1), torch.empty_like(x), torch.empty_like(x)

        def run(x, r, w, out, r_out):
            return add_rms_norm(x, r, w, eps, out=out, residual_out=r_out)

        def unfused(x, r, w, out, r_out):
            torch.add(r, x, out=r_out)
            return rms_norm(r_out, w, eps, out=out)

        x, r, w, out, r_out = inputs()
        poison(out, r_out)
        run(x, r, w, out, r_out)
        moved = nbytes(x, r, w, out, r_out)
        ctx.record(f"x,res[{n},{H}]", (out, r_out), add_rms_norm_ref(*fp32(x, r, w), eps), 5e-3,
                   make=lambda inputs=inputs, run=run: partial(run, *inputs()), nbytes=moved)
        ctx.timing(f"unfused add + rms_norm [{n},{H}]", make=lambda inputs=inputs, f=unfused: partial(f, *inputs()),
                   nbytes=moved, note="bytes of the fused op")

        # In place into a residual stream that is a row slice of a wider buffer: the rows around it stay as they were.
        image = ctx.randn(n + 2, H)
        r = image[1:n + 1]
        ref = add_rms_norm_ref(*fp32(x, r, w), eps)
        edges = image[[0, -1]].clone()
        poison(out)
        add_rms_norm(x, r, w, eps, out=out, residual_out=r)
        ctx.record(f"in place, res rows 1..{n} of [{n + 2},{H}]", (out, r), ref, 5e-3,
                   extra_ok=torch.equal(image[[0, -1]], edges))


@check("linear")
def check_linear(ctx: Ctx) -> None:
    """The few-row linear (decode projections) against fp32 references at every distinct decode weight shape,
    timed beside cuBLAS on the same bytes, with a configuration sweep at 1 and 8 rows."""
    import torch.nn.functional as F

    from benchmarks.shapes import decode_weight_shapes
    from ninfer.ops.triton.linear import default_config, linear

    shapes = sorted(set(decode_weight_shapes(ctx.cfg)))
    rows = [1, 3] if ctx.tiny else [1, 2, 4, 8]
    for N, K in shapes:
        def inputs(M, N=N, K=K):
            return ctx.randn(M, K), ctx.randn(N, K, scale=K ** -0.5)

        lm_head = N == ctx.cfg["vocab_size"]
        for M in rows:
            x, w = inputs(M)
            moved = nbytes(x, w) + M * N * x.element_size()
            ref = F.linear(x.float(), w.float())
            y = linear(x, w)
            # Row 0 without neighbours is bitwise the same on the Triton path (its configuration ignores M);
            # fp32 (the CPU smoke run) goes to cuBLAS/BLAS, which promises nothing of the kind.
            same = torch.equal(linear(x[:1], w), y[:1])
            ctx.record(f"[{N}x{K}] M={M} (row alone bitwise: {same})", y, ref, 5e-3, nbytes=moved,
                       make=lambda M=M: partial(linear, *inputs(M)), note=f"cfg {default_config(N, K)}",
                       extra_ok=same or x.dtype == torch.float32)
            ctx.timing(f"[{N}x{K}] M={M} cuBLAS F.linear", nbytes=moved, make=lambda M=M: partial(F.linear, *inputs(M)))
            if lm_head or M not in (1, 8) or ctx.tiny:
                continue
            for bn in (16, 32, 64):
                for bk in (128, 256):
                    for split in (1, 2, 4, 8):
                        if K // split < bk:
                            continue
                        ctx.timing(f"[{N}x{K}] M={M} block_n {bn} block_k {bk} split {split}", nbytes=moved,
                                   make=lambda M=M, bn=bn, bk=bk, sp=split: partial(
                                       linear, *inputs(M), block_n=bn, block_k=bk, split_k=sp))


@check("swiglu")
def check_swiglu(ctx: Ctx) -> None:
    """The MLP's gate_up projection with silu_and_mul as its epilogue, against fp32 and against the unfused
    kernels it replaces (timed side by side)."""
    import torch.nn.functional as F

    from ninfer.ops.linear import swiglu_ref
    from ninfer.ops.triton.activation import silu_and_mul
    from ninfer.ops.triton.linear import linear, swiglu

    H, inter = ctx.cfg["hidden_size"], dims(ctx.cfg)["inter"]
    for M in ([1, 3] if ctx.tiny else [1, 2, 4, 8]):
        def inputs(M=M):
            return ctx.randn(M, H), ctx.randn(2 * inter, H, scale=H ** -0.5)

        x, w = inputs()
        moved = nbytes(x, w) + M * inter * x.element_size()
        y = swiglu(x, w)
        same = torch.equal(y, silu_and_mul(linear(x, w)))
        ctx.record(f"[{2 * inter}x{H}] M={M} (== unfused bitwise: {same})", y, swiglu_ref(x.float(), w.float()),
                   5e-3, nbytes=moved, make=lambda f=inputs: partial(swiglu, *f()))
        ctx.timing(f"[{2 * inter}x{H}] M={M} unfused Triton", nbytes=moved,
                   make=lambda f=inputs: partial(lambda a, b: silu_and_mul(linear(a, b)), *f()))
        if M in (1, 8):
            ctx.timing(f"[{2 * inter}x{H}] M={M} unfused cuBLAS", nbytes=moved,
                       make=lambda f=inputs: partial(lambda a, b: silu_and_mul(F.linear(a, b)), *f()))
            for bn in (16, 32, 64):
                ctx.timing(f"[{2 * inter}x{H}] M={M} block_n {bn}", nbytes=moved,
                           make=lambda f=inputs, bn=bn: partial(swiglu, *f(), block_n=bn))


@check("linear_fp32_out")
def check_linear_fp32_out(ctx: Ctx) -> None:
    """The lm_head with fp32 logits straight from the kernel's accumulator, against fp32 references; rounded to
    bf16 it must be bitwise the bf16 kernel's result. Timed beside the bf16 kernel + .float() it replaces."""
    import torch.nn.functional as F

    from ninfer.ops.triton.linear import default_config, linear

    hiddens = [ctx.cfg["hidden_size"]] if ctx.tiny else [1024, 4096]  # Qwen3.5-0.8B, -9B
    V = ctx.cfg["vocab_size"]
    for K in hiddens:
        for M in ([1, 3] if ctx.tiny else [1, 8]):
            def inputs(M=M, K=K):
                return ctx.randn(M, K), ctx.randn(V, K, scale=K ** -0.5)

            x, w = inputs()
            out = torch.empty(M, V, dtype=torch.float32, device=ctx.device)
            poison(out)
            linear(x, w, out=out)
            same = torch.equal(out.to(x.dtype), linear(x, w))
            moved = nbytes(x, w, out)
            ctx.record(f"[{V}x{K}] M={M} fp32 out (rounded == bf16 out: {same})", out,
                       F.linear(x.float(), w.float()), 1e-5, nbytes=moved, extra_ok=same,
                       make=lambda f=inputs: partial(linear, *f(), out_dtype=torch.float32),
                       note=f"cfg {default_config(V, K)}")
            ctx.timing(f"[{V}x{K}] M={M} bf16 out + .float()", nbytes=moved,
                       make=lambda f=inputs: partial(lambda a, b: linear(a, b).float(), *f()))


@check("greedy")
def check_greedy(ctx: Ctx) -> None:
    """The split-row argmax against torch.argmax, bitwise (token ids), on random logits, planted ties (the first
    index must win) and special rows (-inf rows, NaN above +inf, -0.0 tying +0.0); timed beside torch.argmax."""
    from ninfer.ops.triton.sampling import greedy

    vocabs = [ctx.cfg["vocab_size"], 3001] if ctx.tiny else [248320, 151936]  # Qwen3.5, Qwen3
    dtypes = [torch.bfloat16, torch.float32] if ctx.gpu else [torch.float16, torch.float32]
    for V in vocabs:
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            for B in ([1, 3] if ctx.tiny else [1, 2, 4, 8]):
                def inputs(B=B, V=V, dtype=dtype):
                    return (ctx.randn(B, V, scale=3.0, dtype=dtype),)

                x, = inputs()
                tied = x.clone()
                at = torch.randint(0, V, (B, 3), device=ctx.device)
                tied.scatter_(1, at, (tied.float().amax(-1, keepdim=True) + 1).to(dtype).expand(B, 3))
                for label, logits in (("random", x), ("3 tied maxima", tied)):
                    out = torch.full((B,), -1, dtype=torch.int64, device=ctx.device)
                    greedy(logits, out=out)
                    ref = logits.argmax(-1)
                    ctx.record(f"{name} [{B}x{V}] {label}", out, ref, 0.0, extra_ok=torch.equal(out, ref),
                               nbytes=nbytes(x), make=(lambda f=inputs: partial(greedy, *f())) if label == "random"
                               else None)
                ctx.timing(f"{name} [{B}x{V}] torch.argmax", nbytes=nbytes(x),
                           make=lambda f=inputs: partial(lambda t: t.argmax(-1), *f()))
            special = torch.randn(4, V, device=ctx.device).to(dtype)
            special[0] = float("-inf")
            special[1, [V // 2, V - 1]] = float("nan")
            special[1, 7] = float("inf")
            special[2] = 0.0
            special[2, :V // 3] = -0.0
            special[3, V // 2:] = float("nan")
            out, ref = greedy(special), special.argmax(-1)
            ctx.record(f"{name} [4x{V}] -inf, NaN, -0.0 rows {out.tolist()}", out, ref, 0.0,
                       extra_ok=torch.equal(out, ref))


@check("paged_attention_gated")
def check_paged_attention_gated(ctx: Ctx) -> None:
    """Attention with Qwen3.5's output gate as its epilogue (the gate a strided slice of [query | gate]),
    against the fp32 reference times the gate, timed beside the plain kernel plus torch's gate ops."""
    from ninfer.ops.triton.attention import paged_attention, paged_attention_gated

    sz = sizes(ctx)
    for seqs in [[(1, sz["contexts"][0] - 1)] * b for b in sz["batches"]] + [[sz["prefill"][0]]]:
        def inputs(seqs=seqs):
            args = _paged_inputs(ctx, seqs)
            q = args[0]
            return args, ctx.randn(q.shape[0], q.shape[1], 2 * q.shape[2])[..., q.shape[2]:]

        args, gate = inputs()
        moved, _ = _attn_cost(ctx, seqs)
        y = paged_attention_gated(*args, gate)
        ref = _attn_ref(ctx, args) * torch.sigmoid(gate.float())
        label = f"B={len(seqs)} q={seqs[0][0]} ctx={seqs[0][1] + seqs[0][0]}"
        ctx.record(label, y, ref, 1e-2, nbytes=moved, make=lambda f=inputs: partial(
            lambda a, g: paged_attention_gated(*a, g), *f()))
        ctx.timing(f"{label} unfused (kernel, sigmoid, mul)", nbytes=moved, make=lambda f=inputs: partial(
            lambda a, g: paged_attention(*a) * torch.sigmoid(g), *f()))


@check("silu_and_mul")
def check_silu_and_mul(ctx: Ctx) -> None:
    from ninfer.ops.activation import silu_and_mul_ref
    from ninfer.ops.triton.activation import silu_and_mul

    d = dims(ctx.cfg)
    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            return ctx.randn(n, 2 * d["inter"]), torch.empty(n, d["inter"], dtype=ctx.dtype, device=ctx.device)

        def run(x, out):
            return silu_and_mul(x, out=out)

        x, out = inputs()
        poison(out)
        run(x, out)
        ctx.record(f"x[{n},{2 * d['inter']}]", out, silu_and_mul_ref(x.float()), 5e-3,
                   make=lambda inputs=inputs: partial(run, *inputs()), nbytes=nbytes(x, out))


@check("apply_rope")
def check_apply_rope(ctx: Ctx) -> None:
    from ninfer.ops.rope import apply_rope_ref, rope_cos_sin
    from ninfer.ops.triton.rope import apply_rope

    d = dims(ctx.cfg)
    rot = d["rotary_dim"]
    for n in sizes(ctx)["tokens"]:
        for heads in (d["heads"], d["kv_heads"]):
            def inputs(n=n, heads=heads):
                x = ctx.randn(n, heads, d["head_dim"])
                cos, sin = rope_cos_sin(torch.randint(0, 8192, (n,), device=ctx.device), rot, 1e7, torch.float32)
                return x, cos, sin, torch.empty_like(x)

            def run(x, cos, sin, out):
                return apply_rope(x, cos, sin, rot, out=out)

            x, cos, sin, out = inputs()
            poison(out)
            run(x, cos, sin, out)
            ctx.record(f"x[{n},{heads},{d['head_dim']}] rot {rot}", out, apply_rope_ref(x.float(), cos, sin, rot),
                       5e-3, make=lambda inputs=inputs, run=run: partial(run, *inputs()),
                       nbytes=nbytes(x, cos, sin, out))


@check("gdn_gates")
def check_gdn_gates(ctx: Ctx) -> None:
    from ninfer.ops.gdn import gdn_gates_ref
    from ninfer.ops.triton.gdn import gdn_gates

    d = dims(ctx.cfg)
    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            g = torch.empty(n, d["hv"], device=ctx.device)
            return (ctx.randn(n, d["hv"], scale=3.0), ctx.randn(n, d["hv"], scale=3.0),
                    ctx.randn(d["hv"], dtype=torch.float32), ctx.randn(d["hv"], dtype=torch.float32),
                    g, torch.empty_like(g))

        def run(a, b, a_log, dt_bias, g, beta):
            return gdn_gates(a, b, a_log, dt_bias, out=(g, beta))

        a, b, a_log, dt_bias, g, beta = inputs()
        poison(g, beta)
        run(a, b, a_log, dt_bias, g, beta)
        ctx.record(f"a,b[{n},{d['hv']}]", (g, beta), gdn_gates_ref(a.float(), b.float(), a_log, dt_bias), 1e-5,
                   make=lambda inputs=inputs, run=run: partial(run, *inputs()), nbytes=nbytes(a, b, g, beta))


def _state_image(ctx: Ctx, slots: int, per_slot: tuple, pad: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A [slots, pad + prod(per_slot) + pad] image and the strided [slots, *per_slot] view into it."""
    size = math.prod(per_slot)
    image = ctx.randn(slots, size + 2 * pad, scale=0.1, dtype=dtype)
    return image, image[:, pad:pad + size].view(slots, *per_slot)


@check("gdn_decode")
def check_gdn_decode(ctx: Ctx) -> None:
    from ninfer.ops.gdn import gdn_decode_ref
    from ninfer.ops.triton.gdn import _default_block_v, gdn_decode

    d = dims(ctx.cfg)
    batches = sizes(ctx)["batches"] if ctx.tiny else [1, 2, 4, 8]
    per_slot = (d["hv"], d["dk"], d["dv"])

    def inputs(B, S):
        image, states = _state_image(ctx, S, per_slot, 32, torch.float32)
        q, k = ctx.randn(B, d["hk"], d["dk"]), ctx.randn(B, d["hk"], d["dk"])
        v = ctx.randn(B, d["hv"], d["dv"])
        g = -torch.rand(B, d["hv"], device=ctx.device) * 2
        beta = torch.rand(B, d["hv"], device=ctx.device)
        slots = torch.randperm(S, device=ctx.device)[:B]
        return image, (q, k, v, g, beta, states, slots, torch.empty(B, d["hv"], d["dv"], dtype=ctx.dtype,
                                                                       device=ctx.device))

    for B in batches:
        S = 3 * B + 2
        image, args = inputs(B, S)
        q, k, v, g, beta, states, slots, out = args
        ref_image = image.clone()
        ref_states = ref_image[:, 32:32 + math.prod(per_slot)].view(S, *per_slot)
        o_ref = gdn_decode_ref(*fp32(q, k, v), g, beta, ref_states, slots)
        poison(out)
        gdn_decode(*args[:-1], out=out)
        others = torch.ones(S, dtype=torch.bool, device=ctx.device)
        others[slots] = False
        untouched = torch.equal(image[others], ref_image[others])
        ctx.record(f"B={B} state (others untouched: {untouched})", image[slots], ref_image[slots], 1e-5,
                   extra_ok=untouched)
        moved = 2 * B * math.prod(per_slot) * 4 + nbytes(q, k, v, g, beta, out)
        ctx.record(f"B={B} out", out, o_ref, 5e-3, nbytes=moved,
                   make=lambda B=B: partial(gdn_decode, *inputs(B, B)[1][:-1]),
                   note=f"block_v {_default_block_v(B, d['hv'], d['dv'])}")
        for block_v in (16, 32, 64):
            for warps in (2, 4, 8):
                ctx.timing(f"B={B} block_v {block_v} warps {warps}", nbytes=moved,
                           make=lambda B=B, bv=block_v, w=warps: partial(gdn_decode, *inputs(B, B)[1][:-1],
                                                                       block_v=bv, num_warps=w))


@check("gdn_decode_fused")
def check_gdn_decode_fused(ctx: Ctx) -> None:
    """The fused GDN decode step (conv update + gates + recurrent step, one launch) against fp32 references,
    with the unfused kernel sequence it replaces (gates, conv, gdn_decode) timed on the same bytes."""
    from ninfer.ops.conv1d import causal_conv1d_decode_ref
    from ninfer.ops.gdn import gdn_decode_ref, gdn_gates_ref
    from ninfer.ops.triton.conv1d import causal_conv1d_decode
    from ninfer.ops.triton.gdn import _default_block_v, gdn_decode, gdn_decode_fused, gdn_gates

    d = dims(ctx.cfg)
    hk, hv, dk, dv, C, K = d["hk"], d["hv"], d["dk"], d["dv"], d["conv_dim"], d["conv_k"]
    batches = sizes(ctx)["batches"] if ctx.tiny else [1, 2, 4, 8]
    per_slot = (hv, dk, dv)

    def inputs(B, S):
        # mixed, b and a are column slices of one in_proj output row, as the model hands them over.
        proj = ctx.randn(B, C + 2 * hv, scale=2.0)
        conv_image = ctx.randn(S, C, K + 1)
        image, states = _state_image(ctx, S, per_slot, 32, torch.float32)
        return (image, conv_image), (
            proj[:, :C], proj[:, C + hv:], proj[:, C:C + hv], ctx.randn(C, K, scale=0.5), conv_image[:, :, 1:K],
            ctx.randn(hv, dtype=torch.float32), ctx.randn(hv, dtype=torch.float32), states,
            torch.randperm(S, device=ctx.device)[:B], torch.empty(B, hv, dv, dtype=ctx.dtype, device=ctx.device))

    def unfused(mixed, a, b, w, conv_states, a_log, dt_bias, states, slots, out):
        B = mixed.shape[0]
        g, beta = gdn_gates(a, b, a_log, dt_bias)
        y = causal_conv1d_decode(mixed, w, conv_states, slots)
        q, k, v = y.split((hk * dk, hk * dk, hv * dv), dim=-1)
        return gdn_decode(q.view(B, hk, dk), k.view(B, hk, dk), v.view(B, hv, dv), g, beta, states, slots, out=out)

    for B in batches:
        S = 3 * B + 2
        (image, conv_image), args = inputs(B, S)
        mixed, a, b, w, conv_states, a_log, dt_bias, states, slots, out = args
        ref_image, ref_conv_image = image.clone(), conv_image.clone()
        image_before, conv_before = image.clone(), conv_image.clone()
        ref_states = ref_image[:, 32:32 + math.prod(per_slot)].view(S, *per_slot)
        # fp32 references on the upcast inputs; the conv output is rounded to the activation dtype, where the
        # unfused conv kernel stores it and the fused kernel rounds it.
        g, beta = gdn_gates_ref(a.float(), b.float(), a_log, dt_bias)
        y = causal_conv1d_decode_ref(mixed.float(), w.float(), ref_conv_image[:, :, 1:K], slots).to(ctx.dtype).float()
        q, k, v = y.split((hk * dk, hk * dk, hv * dv), dim=-1)
        o_ref = gdn_decode_ref(q.view(B, hk, dk), k.view(B, hk, dk), v.view(B, hv, dv), g, beta, ref_states, slots)
        poison(out)
        gdn_decode_fused(*args[:-1], out=out)
        others = torch.ones(S, dtype=torch.bool, device=ctx.device)
        others[slots] = False
        untouched = torch.equal(image[others], ref_image[others])
        conv_exact = torch.equal(conv_image, ref_conv_image)
        ctx.record(f"B={B} state (others untouched: {untouched})", image[slots], ref_image[slots], 1e-4,
                   extra_ok=untouched)
        ctx.record(f"B={B} conv state (exact: {conv_exact})", conv_image, ref_conv_image, 0.0, extra_ok=conv_exact)
        moved = (2 * B * math.prod(per_slot) * 4 + 2 * B * C * (K - 1) * conv_image.element_size()
                 + nbytes(mixed, a, b, w, a_log, dt_bias, out))
        ctx.record(f"B={B} out", out, o_ref, 5e-3, nbytes=moved,
                   make=lambda B=B: partial(gdn_decode_fused, *inputs(B, B)[1][:-1]),
                   note=f"block_v {_default_block_v(B, hv, dv)}")
        # The per-key-head variant (no arrival counters, HK * B programs), checked on the same inputs.
        (image2, conv_image2), args2 = inputs(B, S)
        image2.copy_(image_before)
        conv_image2.copy_(conv_before)
        out2 = args2[-1]
        poison(out2)
        gdn_decode_fused(*args[:2], *args[2:4], conv_image2[:, :, 1:K], *args[5:7],
                         image2[:, 32:32 + math.prod(per_slot)].view(S, *per_slot), slots, out=out2, per_key_head=True)
        same = torch.equal(image2, image) and torch.equal(out2, out)
        conv_exact = torch.equal(conv_image2, ref_conv_image)
        ctx.record(f"B={B} per_key_head state (== default bitwise: {same})", image2[slots], ref_image[slots], 1e-4,
                   extra_ok=torch.equal(image2[others], ref_image[others]))
        ctx.record(f"B={B} per_key_head out (conv state exact: {conv_exact})", out2, o_ref, 5e-3, extra_ok=conv_exact)
        ctx.timing(f"B={B} unfused gates+conv+gdn_decode", nbytes=moved, note="bytes of the fused op",
                   make=lambda B=B: partial(unfused, *inputs(B, B)[1]))
        for per_key_head in (False, True):
            for block_v in (16, 32, 64):
                for warps in (2, 4, 8):
                    ctx.timing(f"B={B} {'per_key_head ' if per_key_head else ''}block_v {block_v} warps {warps}",
                               nbytes=moved, make=lambda B=B, bv=block_v, wp=warps, pk=per_key_head: partial(
                                   gdn_decode_fused, *inputs(B, B)[1][:-1], block_v=bv, num_warps=wp,
                                   per_key_head=pk))
    if not ctx.gpu:
        return
    # Captured once in a CUDA graph, replayed on new inputs and slots: the same bits as eager calls (the arrival
    # counters are left at zero by every launch, so replays start from the same counter state).
    B = batches[-1]
    S = 3 * B + 2
    (image, conv_image), args = inputs(B, S)
    mixed, a, b, slots, out = args[0], args[1], args[2], args[8], args[9]
    gdn_decode_fused(*args[:-1], out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gdn_decode_fused(*args[:-1], out=out)
    for seed in (1, 2):
        gen = torch.Generator(device=ctx.device).manual_seed(seed)
        for t in (mixed, a, b):
            t.copy_(torch.randn(t.shape, generator=gen, device=ctx.device))
        slots.copy_(torch.randperm(S, generator=gen, device=ctx.device)[:B])
        before = (image.clone(), conv_image.clone())
        graph.replay()
        got = (out.clone(), image.clone(), conv_image.clone())
        image.copy_(before[0])
        conv_image.copy_(before[1])
        gdn_decode_fused(*args[:-1], out=out)
        same = all(torch.equal(x, y) for x, y in zip(got, (out, image, conv_image), strict=True))
        ctx.record(f"graph replay {seed} B={B}: == eager bitwise: {same}", got[0], out, 0.0, extra_ok=same)


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
    scale = d["head_dim"] ** -0.5
    return (q, k_cache, v_cache, block_tables, seq_t, qsl, max(q_lens), max(seq_lens), scale)


def _attn_cost(ctx: Ctx, seqs) -> tuple[int, float]:
    """Bytes of K/V the attention must read (each visible position once) and its matmul FLOPs."""
    d = dims(ctx.cfg)
    row = d["kv_heads"] * d["head_dim"] * (2 if ctx.dtype != torch.float32 else 4)
    kv_bytes = sum(2 * (q + c) * row for q, c in seqs)
    q_bytes = sum(q for q, _ in seqs) * d["heads"] * d["head_dim"] * 2 * 2  # q read, o written
    visible = sum(q * c + q * (q + 1) / 2 for q, c in seqs)
    return kv_bytes + q_bytes, 4.0 * visible * d["heads"] * d["head_dim"]


def _attn_ref(ctx: Ctx, args):
    from ninfer.ops.attention import paged_attention_ref

    q, kc, vc, *rest = args
    return paged_attention_ref(q.float(), kc.float(), vc.float(), *rest)


def _attn_run(ctx: Ctx, seqs):
    """Fresh paged inputs for ``seqs`` and paged_attention's output on them (written over poison)."""
    from ninfer.ops.triton.attention import paged_attention

    args = _paged_inputs(ctx, seqs)
    out = torch.empty_like(args[0])
    poison(out)
    paged_attention(*args, out=out)
    return args, out


def _attn_call(ctx: Ctx, seqs, **kw):
    from ninfer.ops.triton.attention import paged_attention

    args = _paged_inputs(ctx, seqs)
    return partial(paged_attention, *args, out=torch.empty_like(args[0]), **kw)


@check("paged_attention_decode")
def check_paged_attention_decode(ctx: Ctx) -> None:
    from ninfer.ops.triton.attention import _decode_splits

    sz = sizes(ctx)
    cases = [[(1, c - 1)] * b for b in sz["batches"] for c in sz["contexts"]]
    gen = torch.Generator().manual_seed(0)
    longest = max(sz["contexts"])
    cases.append([(1, int(torch.randint(0, longest, (1,), generator=gen))) for _ in range(max(sz["batches"]))])
    for seqs in cases:
        args, out = _attn_run(ctx, seqs)
        moved, _ = _attn_cost(ctx, seqs)
        splits = _decode_splits(len(seqs), args[1].shape[2], args[7], 32)
        label = f"B={len(seqs)} ctx={'mixed' if len({c for _, c in seqs}) > 1 else seqs[0][1] + 1}"
        ctx.record(label, out, _attn_ref(ctx, args), 1e-2, make=lambda seqs=seqs: _attn_call(ctx, seqs),
                   nbytes=moved, note=f"splits {splits}")
        for splits_v, tile in ((max(1, splits // 2), 32), (min(64, splits * 2), 32), (splits, 64)):
            ctx.timing(f"{label} splits {splits_v} tile {tile}", nbytes=moved,
                       make=lambda seqs=seqs, s=splits_v, t=tile: _attn_call(ctx, seqs, num_splits=s, tile_n=t))


@check("paged_attention_prefill")
def check_paged_attention_prefill(ctx: Ctx) -> None:
    sz = sizes(ctx)
    cases = [[c] for c in sz["prefill"]] + [sz["mixed"]]
    for seqs in cases:
        args, out = _attn_run(ctx, seqs)
        moved, flops = _attn_cost(ctx, seqs)
        label = " + ".join(f"q{q}@{c}" for q, c in seqs)
        ctx.record(label, out, _attn_ref(ctx, args), 1e-2, make=lambda seqs=seqs: _attn_call(ctx, seqs),
                   nbytes=moved, flops=flops)
        for block_q, tile, warps, stages in ((32, 64, 8, 2), (32, 32, 8, 3), (16, 64, 4, 3)):
            ctx.timing(f"{label} bq {block_q} tile {tile} w{warps} s{stages}", nbytes=moved, flops=flops,
                       make=lambda seqs=seqs, bq=block_q, t=tile, w=warps, s=stages: _attn_call(
                           ctx, seqs, block_q=bq, tile_n=t, num_warps=w, num_stages=s))


@check("write_kv")
def check_write_kv(ctx: Ctx) -> None:
    from ninfer.ops.attention import write_kv_ref
    from ninfer.ops.triton.attention import write_kv

    d = dims(ctx.cfg)
    page = sizes(ctx)["page"]
    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            n_pages = -(-n // page) * 2 + 4
            return (ctx.randn(n, d["kv_heads"], d["head_dim"]), ctx.randn(n, d["kv_heads"], d["head_dim"]),
                    ctx.randn(n_pages, page, d["kv_heads"], d["head_dim"]),
                    ctx.randn(n_pages, page, d["kv_heads"], d["head_dim"]),
                    torch.randperm(n_pages * page, device=ctx.device)[:n])

        k, v, k_cache, v_cache, slots = inputs()
        rk, rv = k_cache.clone(), v_cache.clone()
        write_kv_ref(k, v, rk, rv, slots)
        write_kv(k, v, k_cache, v_cache, slots)
        exact = torch.equal(k_cache, rk) and torch.equal(v_cache, rv)
        ctx.record(f"N={n} (exact, rest untouched: {exact})", (k_cache, v_cache), (rk, rv), 0.0, extra_ok=exact,
                   make=lambda inputs=inputs: partial(write_kv, *inputs()), nbytes=2 * nbytes(k, v) + nbytes(slots))


@check("norm_rope_write_kv")
def check_norm_rope_write_kv(ctx: Ctx) -> None:
    from ninfer.ops.attention import norm_rope_write_kv_ref
    from ninfer.ops.rope import rope_angles_cos_sin, rope_inv_freq
    from ninfer.ops.triton.attention import norm_rope_write_kv, write_kv
    from ninfer.ops.triton.norm import rms_norm
    from ninfer.ops.triton.rope import apply_rope

    d = dims(ctx.cfg)
    H, KVH, D, eps = d["heads"], d["kv_heads"], d["head_dim"], d["eps"]
    page = sizes(ctx)["page"]
    inv_freq = rope_inv_freq(d["rotary_dim"], ctx.cfg.get("rope_theta", 1e7), ctx.device)
    for n in sizes(ctx)["tokens"]:
        def inputs(n=n):
            # As the model hands them over: q of per-head [query | gate] blocks, k and v slices of one row.
            q = ctx.randn(n, H, 2 * D)[..., :D]
            kv = ctx.randn(n, 2 * KVH * D)
            n_pages = -(-n // page) * 2 + 4
            return (q, kv[:, :KVH * D].view(n, KVH, D), kv[:, KVH * D:].view(n, KVH, D),
                    ctx.randn(D, scale=0.1), ctx.randn(D, scale=0.1),
                    torch.randint(0, 200_000, (n,), device=ctx.device), inv_freq,
                    ctx.randn(n_pages, page, KVH, D), ctx.randn(n_pages, page, KVH, D),
                    torch.randperm(n_pages * page, device=ctx.device)[:n])

        def unfused(q, k, v, qw, kw, pos, inv, kc, vc, slots):
            cos, sin = rope_angles_cos_sin(pos, inv, q.dtype)
            out = apply_rope(rms_norm(q, qw, eps), cos, sin, d["rotary_dim"])
            write_kv(apply_rope(rms_norm(k, kw, eps), cos, sin, d["rotary_dim"]), v, kc, vc, slots)
            return out

        args = list(inputs())
        kc0, vc0 = args[7].clone(), args[8].clone()
        ref_args = [t.float() if t.is_floating_point() and t is not inv_freq else t for t in args]
        ref_q = norm_rope_write_kv_ref(*ref_args[:5], eps, *ref_args[5:])
        out = norm_rope_write_kv(*args[:5], eps, *args[5:])
        untouched = torch.ones(kc0.shape[0] * page, dtype=torch.bool, device=ctx.device)
        untouched[args[9]] = False
        kept = torch.equal(args[7].flatten(0, 1)[untouched], kc0.flatten(0, 1)[untouched]) \
            and torch.equal(args[8].flatten(0, 1)[untouched], vc0.flatten(0, 1)[untouched])
        moved = nbytes(args[0], args[1], args[2]) * 2 + nbytes(args[5])
        ctx.record(f"N={n} H={H} KVH={KVH} vs fp32 (rest untouched: {kept})", (out, args[7], args[8]),
                   (ref_q, ref_args[7], ref_args[8]), 1e-2, extra_ok=kept,
                   make=lambda inputs=inputs: partial(lambda a: norm_rope_write_kv(*a[:5], eps, *a[5:]),
                                                      inputs()), nbytes=moved)
        # Against the five kernels (and the cos/sin table) it replaces, in the same dtype: rounding-level only.
        args2 = list(inputs())
        c2 = [args2[7].clone(), args2[8].clone()]
        want = unfused(*args2[:7], *c2, args2[9])
        got = norm_rope_write_kv(*args2[:5], eps, *args2[5:])
        ctx.record(f"N={n} vs the unfused kernels", (got, args2[7], args2[8]), (want, *c2), 4e-3,
                   make=lambda inputs=inputs: partial(lambda a: unfused(*a), inputs()), nbytes=moved,
                   note="timing: unfused")


@check("causal_conv1d_decode")
def check_conv1d_decode(ctx: Ctx) -> None:
    from ninfer.ops.conv1d import causal_conv1d_decode_ref
    from ninfer.ops.triton.conv1d import causal_conv1d_decode

    d = dims(ctx.cfg)
    C, K = d["conv_dim"], d["conv_k"]
    for B in sizes(ctx)["batches"]:
        def inputs(B=B, S=3 * B + 2):
            image = ctx.randn(S, C, K + 1)
            x = ctx.randn(B, C)
            # states: [S, C, K-1], a strided view
            return image, (x, ctx.randn(C, K, scale=0.5), image[:, :, 1:K], torch.randperm(S, device=ctx.device)[:B],
                           torch.empty_like(x))

        image, (x, w, states, slots, out) = inputs()
        ref_image = image.clone()
        ref = causal_conv1d_decode_ref(x.float(), w.float(), ref_image[:, :, 1:K], slots)
        poison(out)
        causal_conv1d_decode(x, w, states, slots, out=out)
        exact = torch.equal(image, ref_image)
        ctx.record(f"B={B} C={C} (states exact: {exact})", out, ref, 5e-3, extra_ok=exact,
                   make=lambda inputs=inputs: partial(causal_conv1d_decode, *inputs()[1][:4]),
                   nbytes=nbytes(x, w, out) + 2 * B * C * (K - 1) * x.element_size())


@check("causal_conv1d_prefill")
def check_conv1d_prefill(ctx: Ctx) -> None:
    from ninfer.ops.conv1d import causal_conv1d_prefill_ref
    from ninfer.ops.triton.conv1d import causal_conv1d_prefill

    d = dims(ctx.cfg)
    C, K = d["conv_dim"], d["conv_k"]

    def run(x, w, state, out, has_state):
        return causal_conv1d_prefill(x, w, state, has_state, out=out)

    for T in sizes(ctx)["conv_T"]:
        for has_state in (False, True):
            def inputs(T=T):
                x = ctx.randn(T, C)
                return x, ctx.randn(C, K, scale=0.5), ctx.randn(C, K - 1), torch.empty_like(x)

            x, w, state, out = inputs()
            ref_state = state.clone()
            ref = causal_conv1d_prefill_ref(x.float(), w.float(), ref_state, has_state)
            poison(out)
            causal_conv1d_prefill(x, w, state, has_state, out=out)
            exact = torch.equal(state, ref_state.to(state.dtype))
            ctx.record(f"T={T} init={has_state} (state exact: {exact})", out, ref, 5e-3, extra_ok=exact,
                       make=lambda inputs=inputs, hs=has_state: partial(run, *inputs(), hs),
                       nbytes=nbytes(x, w, out, state, state))


@check("cuda_graph")
def check_cuda_graph(ctx: Ctx) -> None:
    """Decode kernels captured in one CUDA graph, replayed on new slots, lengths and block tables."""
    if not ctx.gpu:
        return
    from ninfer.ops.triton.attention import paged_attention, write_kv
    from ninfer.ops.triton.gdn import gdn_decode_fused

    d = dims(ctx.cfg)
    B, S, page, ctx_cap = 8, 32, sizes(ctx)["page"], 8192
    pages_per_seq = ctx_cap // page
    n_pages = B * pages_per_seq + 1
    conv_img = ctx.randn(S, d["conv_dim"], d["conv_k"] - 1)
    rec = ctx.randn(S, d["hv"], d["dk"], d["dv"], scale=0.1, dtype=torch.float32)
    k_cache = ctx.randn(n_pages, page, d["kv_heads"], d["head_dim"])
    v_cache = ctx.randn(n_pages, page, d["kv_heads"], d["head_dim"])
    conv_w = ctx.randn(d["conv_dim"], d["conv_k"], scale=0.5)
    a_log, dt_bias = ctx.randn(d["hv"], dtype=torch.float32), ctx.randn(d["hv"], dtype=torch.float32)
    # Static inputs, rewritten in place before each replay.
    x = ctx.randn(B, d["conv_dim"])
    ab = ctx.randn(B, 2 * d["hv"])
    slots = torch.zeros(B, dtype=torch.int64, device=ctx.device)
    q = ctx.randn(B, d["heads"], d["head_dim"])
    kv_new = ctx.randn(2, B, d["kv_heads"], d["head_dim"])
    slot_mapping = torch.zeros(B, dtype=torch.int64, device=ctx.device)
    block_tables = torch.zeros(B, pages_per_seq, dtype=torch.int32, device=ctx.device)
    seq_lens = torch.ones(B, dtype=torch.int32, device=ctx.device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=ctx.device)

    def step():  # the model's decode sequence: fused GDN step (conv + gates + recurrence), KV write, attention
        o = gdn_decode_fused(x, ab[:, :d["hv"]], ab[:, d["hv"]:], conv_w, conv_img, a_log, dt_bias, rec, slots)
        write_kv(kv_new[0], kv_new[1], k_cache, v_cache, slot_mapping)
        a = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, 1, ctx_cap, d["head_dim"] ** -0.5)
        return o, a

    def set_inputs(seed: int):
        gen = torch.Generator(device=ctx.device).manual_seed(seed)
        for t in (x, ab, q, kv_new):
            t.copy_(torch.randn(t.shape, generator=gen, device=ctx.device))
        slots.copy_(torch.randperm(S, generator=gen, device=ctx.device)[:B])
        perm = torch.randperm(n_pages - 1, generator=gen, device=ctx.device)[:B * pages_per_seq]
        block_tables.copy_(perm.view(B, pages_per_seq).to(torch.int32))
        seq_lens.copy_(torch.randint(1, ctx_cap + 1, (B,), generator=gen, device=ctx.device).to(torch.int32))
        last = (seq_lens.long() - 1)
        slot_mapping.copy_(block_tables.long().gather(1, (last // page)[:, None])[:, 0] * page + last % page)

    set_inputs(0)
    step()  # compile and warm every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, a_static = step()
    for seed in (1, 2):
        set_inputs(seed)
        before = (conv_img.clone(), rec.clone(), k_cache.clone(), v_cache.clone())
        graph.replay()
        got = (o_static.clone(), a_static.clone(), conv_img.clone(), rec.clone())
        for t, s in zip((conv_img, rec, k_cache, v_cache), before, strict=True):
            t.copy_(s)
        o_e, a_e = step()
        want = (o_e, a_e, conv_img, rec)
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ctx.record(f"replay {seed}: graph == eager bitwise: {same}", got[:2], want[:2], 0.0, extra_ok=same)
    ctx.timing("replay: gdn_decode_fused+write_kv+attention B=8", fn=graph.replay)


@check("gdn_prefill")
def check_gdn_prefill(ctx: Ctx) -> None:
    """fla-core's chunked kernel (GPU only) against the chunked torch reference, with and without state."""
    if not ctx.gpu:
        return
    from ninfer.ops.gdn import gdn_prefill_ref
    from ninfer.ops.triton.gdn import fla_available, gdn_prefill

    if not fla_available():
        ctx.fail("import", "fla-core not importable (carry its wheel in .whl/)")
        return
    d = dims(ctx.cfg)
    for T in sizes(ctx)["gdn_T"]:
        for has_state in (False, True):
            q, k = ctx.randn(T, d["hk"], d["dk"]), ctx.randn(T, d["hk"], d["dk"])
            v = ctx.randn(T, d["hv"], d["dv"])
            g = torch.nn.functional.logsigmoid(torch.randn(T, d["hv"], device=ctx.device))
            beta = torch.rand(T, d["hv"], device=ctx.device)
            state0 = ctx.randn(d["hv"], d["dk"], d["dv"], scale=0.1, dtype=torch.float32)
            ref_state = state0.clone()
            o_ref = gdn_prefill_ref(*fp32(q, k, v), g, beta, ref_state, has_state)
            state = state0.clone()
            out = torch.empty(T, d["hv"], d["dv"], dtype=v.dtype, device=ctx.device)
            poison(out)
            gdn_prefill(q, k, v, g, beta, state, has_state, out=out)
            ctx.record(f"T={T} init={has_state} out", out, o_ref, 1e-2,
                       fn=lambda q=q, k=k, v=v, g=g, beta=beta, st=state.clone(), hs=has_state, out=out:
                       gdn_prefill(q, k, v, g, beta, st, hs, out=out),
                       nbytes=nbytes(q, k, v, g, beta, out) + 2 * nbytes(state))
            ctx.record(f"T={T} init={has_state} state", state, ref_state, 1e-2)
    # fla launches many kernels from Python (do_bench above is host-bound): also time it inside a graph.
    T = max(sizes(ctx)["gdn_T"])
    q, k = ctx.randn(T, d["hk"], d["dk"]), ctx.randn(T, d["hk"], d["dk"])
    v = ctx.randn(T, d["hv"], d["dv"])
    g = torch.nn.functional.logsigmoid(torch.randn(T, d["hv"], device=ctx.device))
    beta = torch.rand(T, d["hv"], device=ctx.device)
    state = ctx.randn(d["hv"], d["dk"], d["dv"], scale=0.1, dtype=torch.float32)
    out = torch.empty_like(v)
    try:
        ctx.timing(f"T={T} init=True in a CUDA graph", nbytes=nbytes(q, k, v, g, beta, out) + 2 * nbytes(state),
                   make=lambda: partial(gdn_prefill, q, k, v, g, beta, state, True, out=out))
    except Exception as exc:  # fla may sync on the host; then prefill stays eager, as planned
        ctx.log(f"fla chunk_gated_delta_rule not graph-capturable: {type(exc).__name__}: {exc}"[:300])


def report_kernels(ctx: Ctx) -> None:
    """Registers, spills and shared memory of every compiled variant of our kernels (the compiler's report)."""
    import importlib

    import triton

    for module in ("norm", "activation", "rope", "gdn", "conv1d", "attention"):
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
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    p.add_argument("--out", default=os.environ.get("OUT") or ".gpu-out", help="folder for the log and JSON")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CHECKS))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    if "copy" not in names:
        names.insert(0, "copy")
    gpu = torch.cuda.is_available()
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("no CUDA device: run on the GPU machine, or set TRITON_INTERPRET=1 with --shape tiny")
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    with open(os.path.join(args.out, "gpu_check.log"), "w") as log_file:
        ctx = Ctx(args.shape, SHAPES[args.shape], "cuda" if gpu else "cpu",
                  torch.bfloat16 if gpu else torch.float32, args.out, log_file)
        if gpu:
            import triton

            ctx.log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
        t_all = time.perf_counter()
        for name in names:
            ctx.current = name
            t0 = time.perf_counter()
            try:
                CHECKS[name](ctx)
            except Exception as exc:  # a broken check is reported and the others still run
                ctx.log(traceback.format_exc())
                ctx.fail("exception", f"{type(exc).__name__}: {exc}"[:200])
            ctx.log(f"# {name} took {time.perf_counter() - t0:.1f} s")
        ctx.log(f"# all checks took {time.perf_counter() - t_all:.1f} s")
        if gpu:
            report_kernels(ctx)
        failed = [r for r in ctx.results if not r.ok]
        summary = {"shape": args.shape, "device": torch.cuda.get_device_name() if gpu else "cpu",
                   "copy_tbps": ctx.copy_tbps, "failed": len(failed),
                   "results": [attrs.asdict(r) for r in ctx.results]}
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(summary, f, indent=1)
        ctx.log("\n" + "=" * 60 + " summary (checked rows)")
        for r in ctx.results:
            if r.rel_err is not None or not r.ok:
                ctx.log(format_row(r))
        ctx.log(f"{len(ctx.results) - len(failed)} of {len(ctx.results)} rows ok; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
