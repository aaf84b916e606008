"""Compile every Triton kernel of ``ninfer.ops.triton`` for a GPU architecture on any machine, GPU or not.

Each public wrapper is called once per kernel variant on small bf16 CPU tensors with the launch itself
intercepted: the launch's arguments, bound and specialized by Triton's own launcher code (aligned pointers,
sizes divisible by 16: the build is the vectorized, pipelined code a launch on the GPU compiles), give the
kernel's signature, constexprs and attributes, which ``triton.compile`` then lowers to a cubin for the target
(Triton ships ptxas). With ``--pdl`` every kernel is built with its
programmatic-dependent-launch prologue (``ops/triton/_pdl_jit.py``), the variant the CPU interpreter never
runs. It proves the kernels compile for Hopper, not that they are right: that is the GPU tests' job
(``ninfer-core/tests/gpu``).

    python -m benchmarks.compile_check --pdl          # sm_90, every kernel, PDL on (needs no GPU)
    python -m benchmarks.compile_check --registers    # and each build's registers and spills (ptxas -v)

Run without ``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit`` with a Python emulation).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
import time

import torch


def _calls(gen: torch.Generator) -> list[tuple[str, callable]]:
    """(name, thunk) per kernel variant: each thunk calls a public wrapper once on small bf16 inputs."""
    from ninfer.ops.quant import quantize_fp8_block, quantize_nvfp4
    from ninfer.ops.rope import rope_cos_sin
    from ninfer.ops.triton import (
        activation,
        attention,
        conv1d,
        gdn,
        gdn_verify,
        linear,
        linear_quant,
        moe,
        moe_align_kernel,
        moe_route,
        norm,
        rope,
        sampling,
        vision_attention,
    )
    from ninfer.ops.vision import PackedSequences

    bf = torch.bfloat16

    def randn(*shape, dtype=bf):
        return torch.randn(*shape, generator=gen).to(dtype)

    x, w = randn(3, 256), randn(96, 256)
    q_gate = randn(3, 4, 128)  # [query | gate] per head, D = 64
    pages, page, kvh, D = 8, 16, 2, 64
    kc, vc = randn(pages, page, kvh, D), randn(pages, page, kvh, D)
    tables = torch.arange(pages, dtype=torch.int32).view(2, 4)
    decode = (randn(2, 4, D), kc, vc, tables, torch.tensor([40, 17], dtype=torch.int32),
              torch.tensor([0, 1, 2], dtype=torch.int32), 1, 40, D ** -0.5)
    prefill = (randn(9, 4, D), kc, vc, tables, torch.tensor([9, 30], dtype=torch.int32),
               torch.tensor([0, 4, 9], dtype=torch.int32), 5, 30, D ** -0.5)
    HK, HV, DK, DV, KW, S = 2, 4, 16, 32, 4, 6
    conv_dim = 2 * HK * DK + HV * DV
    fused = (randn(3, conv_dim), randn(3, HV), randn(3, HV), randn(conv_dim, KW), randn(S, conv_dim, KW - 1),
             randn(HV, dtype=torch.float32), randn(HV, dtype=torch.float32),
             randn(S, HV, DK, DV, dtype=torch.float32), torch.tensor([4, 0, 2]))
    cos, sin = rope_cos_sin(torch.arange(3), 16, 1e7, torch.float32)
    vqkv, packed = randn(40, 3 * 4, 72), PackedSequences.of([7, 1, 32], "cpu")  # vision heads: D = 72
    vision = (vqkv[:, :4], vqkv[:, 4:8], vqkv[:, 8:], packed)
    E, H, inter = 8, 128, 64
    xm, logits = randn(3, H), randn(3, E + 1)
    banks = (randn(E, 2 * inter, H), randn(E, H, inter))
    shared = (randn(2 * inter, H), randn(H, inter))
    ids = torch.tensor([[0, 3], [3, 5], [7, 0]])
    w8, w4 = (quantize_fp8_block(randn(96, 256, dtype=torch.float32)),
              quantize_nvfp4(randn(96, 256, dtype=torch.float32)))
    per_channel = quantize_fp8_block(randn(96, 256, dtype=torch.float32), (1, 256))
    xq = randn(130, 256)
    codes = {m: (torch.zeros(m, 256, dtype=torch.float8_e4m3fn), torch.ones(m, 2)) for m in (3, 130)}
    return [
        ("linear", lambda: linear.linear(x, w)),
        ("linear split-K", lambda: linear.linear(x, w, split_k=2, block_k=64)),
        ("linear fp32 out", lambda: linear.linear(x, w, out_dtype=torch.float32)),
        ("linear fp32 out split-K", lambda: linear.linear(x, w, out_dtype=torch.float32, split_k=2, block_k=64)),
        ("linear_fp8 split-K", lambda: linear_quant.linear_fp8(x, w8)),
        ("linear_fp8 per-channel fp32 out", lambda: linear_quant.linear_fp8(x, per_channel, out_dtype=torch.float32,
                                                                            split_k=1)),
        ("linear_nvfp4", lambda: linear_quant.linear_nvfp4(x, w4, split_k=1)),
        ("linear_nvfp4 split-K", lambda: linear_quant.linear_nvfp4(x, w4, block_k=128, split_k=2)),
        ("quantize_activation_fp8", lambda: linear_quant.quantize_activation_fp8(xq)),
        ("w8a8_gemm 64 rows", lambda: linear_quant.w8a8_gemm(*codes[3], w8)),
        ("w8a8_gemm 128 rows", lambda: linear_quant.w8a8_gemm(*codes[130], w8)),
        ("dequantize fp8", lambda: linear_quant.dequantize(w8)),
        ("dequantize nvfp4", lambda: linear_quant.dequantize(w4)),
        ("swiglu", lambda: linear.swiglu(x, randn(192, 256))),
        ("swiglu split-K", lambda: linear.swiglu(x, randn(192, 256), split_k=2, block_k=64)),
        ("rms_norm rows", lambda: norm.rms_norm(x, randn(256), 1e-6)),
        ("rms_norm heads", lambda: norm.rms_norm(q_gate[..., :64], randn(64), 1e-6)),
        ("embed_rms_norm", lambda: norm.embed_rms_norm(torch.tensor([5, 0, 2]), randn(7, 256), randn(256), 1e-6)),
        ("rms_norm_gated heads", lambda: norm.rms_norm_gated(randn(3, 4, 64), q_gate[..., 64:], randn(64), 1e-6)),
        ("add_rms_norm", lambda: norm.add_rms_norm(x, randn(3, 256), randn(256), 1e-6)),
        ("add_rms_norm terms", lambda: norm.add_rms_norm(randn(3, 9, 256), randn(3, 256), randn(256), 1e-6)),
        ("add_rms_norm_linear", lambda: norm.add_rms_norm_linear(x, randn(3, 256), randn(256), 1e-6, w)),
        ("silu_and_mul", lambda: activation.silu_and_mul(randn(3, 256))),
        ("apply_rope", lambda: rope.apply_rope(randn(3, 4, 64), cos, sin, 16)),
        ("write_kv", lambda: attention.write_kv(randn(3, kvh, D), randn(3, kvh, D), kc, vc, torch.tensor([1, 5, 9]))),
        ("norm_rope_write_kv", lambda: attention.norm_rope_write_kv(
            q_gate[..., :D], randn(3, kvh, D), randn(3, kvh, D), randn(D), randn(D), 1e-6, torch.arange(3),
            torch.rand(8), kc, vc, torch.tensor([1, 5, 9]))),
        ("paged_attention decode splits", lambda: attention.paged_attention(*decode, num_splits=4)),
        ("paged_attention_gated decode splits", lambda: attention.paged_attention_gated(
            *decode, q_gate[:2, :, 64:], num_splits=4)),
        ("paged_attention_gated prefill", lambda: attention.paged_attention_gated(*prefill, randn(9, 4, D))),
        ("gdn_decode_fused", lambda: gdn.gdn_decode_fused(*fused)),
        ("gdn_decode", lambda: gdn.gdn_decode(randn(3, HK, DK), randn(3, HK, DK), randn(3, HV, DV),
                                              randn(3, HV, dtype=torch.float32), randn(3, HV, dtype=torch.float32),
                                              fused[7], fused[8])),
        ("gdn_gates", lambda: gdn.gdn_gates(randn(3, HV), randn(3, HV), fused[5], fused[6])),
        ("gdn_verify", lambda: gdn_verify.gdn_verify(randn(6, conv_dim), randn(6, HV), randn(6, HV), *fused[3:],
                                              randn(3, 2, conv_dim, KW - 1),
                                              randn(3, 2, HV, DK, DV, dtype=torch.float32))),
        ("causal_conv1d_decode", lambda: conv1d.causal_conv1d_decode(fused[0], fused[3], fused[4], fused[8])),
        ("causal_conv1d_prefill", lambda: conv1d.causal_conv1d_prefill(randn(20, conv_dim), fused[3],
                                                                        randn(conv_dim, KW - 1), True)),
        ("greedy fp32 split rows", lambda: sampling.greedy(randn(2, 5000, dtype=torch.float32))),
        ("greedy bf16 one chunk", lambda: sampling.greedy(randn(2, 300))),
        ("apply_token_mask fp32", lambda: sampling.apply_token_mask(
            randn(2, 5000, dtype=torch.float32), torch.randint(-2**31, 2**31 - 1, (2, 157), dtype=torch.int32))),
        ("vision_attention split head", lambda: vision_attention.vision_attention(*vision)),
        ("vision_attention padded head", lambda: vision_attention.vision_attention(*vision, head_split=False)),
        ("apply_token_mask bf16", lambda: sampling.apply_token_mask(
            randn(2, 77), torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32))),
        ("moe_route", lambda: moe_route.moe_route(logits[:, :E], 2)),
        ("moe align", lambda: moe_align_kernel.align_small(ids, E, 16)),
        ("moe_experts", lambda: moe.moe_experts(xm, *banks, ids, randn(3, 2))),
        ("moe_block folded", lambda: moe.moe_block(xm, logits[:, :E], logits[:, E:], *banks, *shared, 2)),
        ("moe_block one launch", lambda: moe.moe_block(xm[:1], logits[:1, :E], logits[:1, E:], *banks, *shared, 2,
                                                       summed=False)),
    ]


def _specialized(kernel, args: tuple, kwargs: dict, backend, pdl: bool) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) for triton.compile from one intercepted launch, specialized as
    Triton's launcher does at run time (pointers and integers divisible by 16, integers equal to 1), so the build
    is the code the GPU runs (vectorized, pipelined loads); ``pdl`` turns the prologue on (with the L2 prefetch)."""
    from triton.runtime.jit import create_function_from_signature

    params = inspect.signature(kernel.fn).parameters
    knobs = {"USE_PDL": pdl, "PREFETCH": 2 if pdl else None}
    kwargs = {**kwargs, **{k: v for k, v in knobs.items() if k in params and v}}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}


def _ptxas_report(ptx: str, arch: int) -> dict:
    """Registers per thread and spilled bytes of one build, from ``ptxas -v`` (the assembler Triton ships)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", src, "-o",
                              os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spills.group(1)) if spills else 0}


def run(arch: int, pdl: bool, registers: bool = False) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check needs real triton.jit functions: unset TRITON_INTERPRET")
    launches = []

    def intercept(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = intercept
    try:
        calls = _calls(torch.Generator().manual_seed(0))
        captured = []
        for name, thunk in calls:
            before = len(launches)
            thunk()
            captured += [(name, *launch) for launch in launches[before:]]
            if len(launches) == before:
                raise AssertionError(f"{name}: no Triton kernel was launched (took a torch path?)")
    finally:
        JITFunction.run = original
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    results = []
    for name, kernel, args, kwargs in captured:
        signature, constexprs, attrs, options = _specialized(kernel, args, kwargs, backend, pdl)
        t0 = time.perf_counter()
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=target, options=options)
        ptx = compiled.asm["ptx"]
        results.append({"case": name, "kernel": kernel.fn.__name__, "seconds": time.perf_counter() - t0,
                        "cubin_bytes": len(compiled.asm["cubin"]),
                        "gdc_wait": "griddepcontrol.wait" in ptx,
                        "gdc_launch_dependents": "griddepcontrol.launch_dependents" in ptx,
                        "l2_prefetch": "prefetch.global.L2" in ptx,
                        "cp_async": "cp.async" in ptx,  # loads pipelined through shared memory
                        "pdl_order": _pdl_order(ptx, kernel.fn.__name__ in _READS_EARLY) if pdl else "",
                        **(_ptxas_report(ptx, arch) if registers else {})})
    return results


_GLOBAL_ACCESS = re.compile(r"\b(ld|st|atom|red)\.global|\bcp\.async")  # L2 prefetch hints are not accesses
_GLOBAL_WRITE = re.compile(r"\b(st|atom|red)\.global")
# Kernels that read before their wait what the kernel before them never writes (weights; the batch's index
# tensors, written before the step): only their writes must follow it.
_READS_EARLY = {"_add_rms_norm_linear_kernel", "_paged_attention_kernel"}


def _pdl_order(ptx: str, reads_early: bool = False) -> str:
    """What is out of order in a PDL build's PTX, or "": the wait comes before the first global memory access
    (nothing is read or written early; with ``reads_early``, before the first write); the successor's
    trigger comes before it too."""
    lines = ptx.splitlines()

    def where(pattern: str | re.Pattern) -> list[int]:
        return [i for i, line in enumerate(lines) if re.search(pattern, line)]

    wait, trigger = where(r"griddepcontrol\.wait"), where(r"griddepcontrol\.launch_dependents")
    access = where(_GLOBAL_WRITE if reads_early else _GLOBAL_ACCESS)
    if not wait or not trigger:
        return "no prologue"
    if access and wait[0] > access[0]:
        return "global memory accessed before griddepcontrol.wait"
    return "" if not access or trigger[0] < access[0] else "trigger after the first global memory access"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    p.add_argument("--pdl", action="store_true", help="build the programmatic-dependent-launch variants")
    p.add_argument("--registers", action="store_true", help="also report each build's registers per thread and "
                   "spilled bytes (ptxas -v)")
    args = p.parse_args(argv)
    results = run(args.arch, args.pdl, args.registers)
    for r in results:
        flags = " ".join(k for k in ("gdc_wait", "gdc_launch_dependents", "l2_prefetch", "cp_async") if r[k])
        regs = f" {r['registers']:>3} regs {r['spill_bytes']:>4} B spilled" if args.registers else ""
        print(f"{r['case']:<40} {r['kernel']:<32} sm_{args.arch} cubin {r['cubin_bytes']:>7} B "
              f"{r['seconds']:5.1f} s{regs}  {flags}")
    wrong = [f"{r['case']}: {r['pdl_order']}" for r in results if r["pdl_order"]]
    print(f"{len(results)} kernel builds for sm_{args.arch}" + (f"; PDL prologue out of order: {wrong}" if wrong else ""))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
