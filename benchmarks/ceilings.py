"""Device ceilings measured in the same run as any comparison: copy bandwidth, bf16 matmul rate, and the
cuBLAS matrix-vector chain over a Qwen3.5 model's own decode weights (one CUDA graph, nothing else).

``measure`` gives them all at once; ``scripts/gpu bench`` prints them beside the Engine's figures.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks import harness
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


def host_time_ms(fn, iters: int) -> float:
    for _ in range(2):  # first calls pay one-time library setup
        fn()
    times = []
    for _ in range(iters):
        t = harness.clock()
        fn()
        times.append((harness.clock() - t) * 1e3)
    return statistics.median(times)


def measure(shapes: list[str], batches: list[int], device: str) -> dict:
    """Copy bandwidth, bf16 matmul rate and the matvec chain per shape (CUDA: the functions above;
    CPU: the same quantities at small sizes, timed on the host, for the smoke run)."""
    if device.startswith("cuda"):
        res = {"copy_tb_s": copy_bandwidth(), "matmul_tflops": matmul_rate(),
               "matmul_dtype": "bfloat16", "chain_ms": {}}
        for s in shapes:
            res["chain_ms"][s] = {str(b): ms for b, ms in matvec_chain(s, batches).items()}
        return res
    src = torch.empty(1 << 26, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    copy_ms = host_time_ms(lambda: dst.copy_(src), 5)
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm_ms = host_time_ms(lambda: a @ b, 5)
    res = {"copy_tb_s": 2 * src.numel() / (copy_ms * 1e-3) / 1e12, "matmul_tflops": 2 * n**3 / (mm_ms * 1e-3) / 1e12,
           "matmul_dtype": "float32", "chain_ms": {}}
    for s in shapes:
        weights = [torch.randn(o, i) * 0.02 for o, i in decode_weight_shapes(SHAPES[s])]
        res["chain_ms"][s] = {}
        for B in batches:
            xs = {w.shape[1]: torch.randn(B, w.shape[1]) for w in weights}
            res["chain_ms"][s][str(B)] = host_time_ms(
                lambda xs=xs, ws=weights: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws], 3)
    return res
