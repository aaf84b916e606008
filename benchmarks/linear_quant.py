"""Quantized linears on the GPU (``ninfer.ops.triton.linear_quant``) beside the dense bf16 ones, at Qwen3.5 shapes.

Decode (few rows): per weight [N x K] of the 9B and 0.8B projections and rows M, the microseconds of the bf16
few-row kernel (``linear.linear``), of ``linear_fp8`` (Qwen's 128 x 128 blocks) and of ``linear_nvfp4``, each a
CUDA graph of one launch, with the weight bytes read per microsecond (GB/s: the planes' bytes, scales included).
``--sweep`` also times each quantized kernel over a grid of tiles (block_n, block_k, split_k, num_stages) and
prints the best, the input of a tuning table entry.

Prefill (many rows): TFLOP/s of cuBLAS on bf16 weights, of the W8A8 path (activation quantization + FP8 GEMM)
and of the dequantize-then-cuBLAS path for FP8 and NVFP4.

    python -m benchmarks.linear_quant [--sweep] [--json out.json]          # on the GPU machine
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

DECODE = {"9b": ((4096, 4096), (12288, 4096), (12352, 4096), (24576, 4096), (4096, 12288)),
          "0.8b": ((1024, 2048), (1024, 3584), (5120, 1024), (7168, 1024), (8224, 1024))}
PREFILL = ((4096, 4096), (24576, 4096), (4096, 12288))
SWEEP = {"block_n": (32, 64, 128), "block_k": (128, 256), "split_k": (1, 2, 4, 8), "num_stages": (3, 4)}


def _weights(N: int, K: int) -> dict:
    from ninfer.ops.quant import quantize_fp8_block, quantize_nvfp4

    w = torch.randn(N, K, device="cuda") * K ** -0.5
    return {"bf16": w.bfloat16(), "fp8": quantize_fp8_block(w), "nvfp4": quantize_nvfp4(w)}


def _us(fn) -> float:
    from ninfer.ops.triton.tune import graph_time

    return graph_time(fn) * 1e3


def decode(rows: tuple[int, ...], sweep: bool) -> list[dict]:
    from ninfer.ops.triton import linear, linear_quant

    kernels = {"bf16": linear.linear, "fp8": linear_quant.linear_fp8, "nvfp4": linear_quant.linear_nvfp4}
    out = []
    for model, shapes in DECODE.items():
        for N, K in shapes:
            ws = _weights(N, K)
            for m in rows:
                x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
                for fmt, fn in kernels.items():
                    w = ws[fmt]
                    nbytes = w.numel() * w.element_size() if fmt == "bf16" else w.nbytes
                    us = _us(lambda fn=fn, w=w, x=x: fn(x, w))
                    row = {"model": model, "shape": f"{N}x{K}", "rows": m, "format": fmt, "us": us,
                           "gb_s": nbytes / us / 1e3}
                    if sweep and fmt != "bf16":
                        row["best"] = _sweep(fn, x, w, fmt)
                    out.append(row)
                    print(json.dumps(row), flush=True)
    return out


def _sweep(fn, x, w, fmt: str) -> dict:
    best = None
    for values in itertools.product(*SWEEP.values()):
        knobs = dict(zip(SWEEP, values, strict=True))
        if fmt == "fp8" and w.block[1] % knobs["block_k"]:
            continue
        try:
            us = _us(lambda knobs=knobs: fn(x, w, **knobs))
        except Exception as e:  # noqa: BLE001  (a tile that does not fit the device: skip it)
            print(f"  {fmt} {knobs}: {type(e).__name__}", file=sys.stderr)
            continue
        if best is None or us < best["us"]:
            best = {**knobs, "us": us}
    return best or {}


def prefill(rows: tuple[int, ...]) -> list[dict]:
    import torch.nn.functional as F

    from ninfer.contract.quant import A8
    from ninfer.ops.triton import linear_quant

    out = []
    for N, K in PREFILL:
        ws = _weights(N, K)
        paths = {"bf16 cuBLAS": (F.linear, ws["bf16"]),
                 "fp8 W8A8": (linear_quant.linear_fp8_w8a8, ws["fp8"].with_activation(A8)),
                 "fp8 dequant": (linear_quant.linear_dequant, ws["fp8"]),
                 "nvfp4 dequant": (linear_quant.linear_dequant, ws["nvfp4"])}
        for m in rows:
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            for name, (fn, w) in paths.items():
                us = _us(lambda fn=fn, w=w, x=x: fn(x, w))
                row = {"shape": f"{N}x{K}", "rows": m, "path": name, "us": us, "tflops": 2 * m * N * K / us / 1e6}
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time each quantized decode kernel over a grid of tiles")
    p.add_argument("--rows", default="1,8", help="decode rows (comma-separated)")
    p.add_argument("--prefill-rows", default="512,4096", help="prefill rows (comma-separated; empty: none)")
    p.add_argument("--json", help="write every row to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.linear_quant needs a CUDA device")
        return 0
    results = {"decode": decode(tuple(int(r) for r in args.rows.split(",")), args.sweep),
               "prefill": prefill(tuple(int(r) for r in args.prefill_rows.split(",") if r))}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
