"""Device ceilings measured in the same run as any comparison: copy bandwidth, bf16 matmul rate, and the
cuBLAS matrix-vector chain over a Qwen3.5 model's own decode weights (one CUDA graph, nothing else).

    python benchmarks/ceilings.py --shape 9b --batch 1 2 4 8 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.shapes import SHAPES, decode_weight_shapes


def _time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e12


def matmul_rate(n: int = 8192) -> float:
    """bf16 n x n x n product through cuBLAS, TFLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = _time_ms(lambda: a @ b, iters=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def matvec_chain(shape: str, batches: list[int]) -> dict[int, float]:
    """ms per step for F.linear over every decode weight of the model, captured in one CUDA graph."""
    shapes = decode_weight_shapes(SHAPES[shape])
    weights = [torch.randn(o, i, dtype=torch.bfloat16, device="cuda") * 0.02 for o, i in shapes]
    out: dict[int, float] = {}
    for b in batches:
        xs = {i: torch.randn(b, i, dtype=torch.bfloat16, device="cuda") for i in {i for _, i in shapes}}

        def step(weights=weights, xs=xs):
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        out[b] = _time_ms(graph.replay, iters=20)
    del weights
    torch.cuda.empty_cache()
    return out


def weight_bytes(shape: str) -> int:
    return sum(o * i * 2 for o, i in decode_weight_shapes(SHAPES[shape]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ceilings need a CUDA device", file=sys.stderr)
        return 2
    res = {"device": torch.cuda.get_device_name(), "copy_tb_s": copy_bandwidth(), "matmul_bf16_tflops": matmul_rate(),
           "shape": args.shape, "decode_weight_gb": weight_bytes(args.shape) / 1e9,
           "matvec_chain_ms": matvec_chain(args.shape, args.batch)}
    res["bandwidth_floor_ms"] = weight_bytes(args.shape) / (res["copy_tb_s"] * 1e12) * 1e3
    print(f"device {res['device']}: copy {res['copy_tb_s']:.2f} TB/s, bf16 matmul {res['matmul_bf16_tflops']:.0f} TFLOP/s")
    print(f"{args.shape}: decode weights {res['decode_weight_gb']:.2f} GB, floor {res['bandwidth_floor_ms']:.2f} ms/step")
    print("| B | cuBLAS chain ms/step | tokens/s |")
    print("|---|---|---|")
    for b, ms in res["matvec_chain_ms"].items():
        print(f"| {b} | {ms:.3f} | {b * 1000 / ms:.0f} |")
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
