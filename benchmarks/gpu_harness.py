"""The timing harness of ``benchmarks/gpu_check.py`` and its topic modules: the registry of timings (``timed``),
the context a timing writes its rows to (``Ctx``), CUDA-graph replays over rotated inputs (``graph_bench``), and
the model dimensions a timing draws its shapes from.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch

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


def state_image(ctx: Ctx, slots: int, per_slot: tuple, pad: int, dtype) -> torch.Tensor:
    """A strided [slots, *per_slot] view into a wider per-slot image, as the Program's state pools hand out."""
    size = math.prod(per_slot)
    return ctx.randn(slots, size + 2 * pad, scale=0.1, dtype=dtype)[:, pad:pad + size].view(slots, *per_slot)


# ------------------------------------------------------------------------------------------------ timings
