"""The CPU team's share of host experts at a MoE shape: time per call of ``cpu_experts`` (and ways to divide
the work) for a few missed experts of one token, against the experts' bytes (a table and JSON).

    python -m benchmarks.cpu_experts [--shape 35b-a3b] [--experts 6] [--rows 1] [--threads 15] [--json F]

``--scaling`` first times the product alone: one expert on one thread by each torch path (F.linear, fp32, the
matrix-vector product), then T plain pinned threads with one intra-op thread each, each computing its own
random experts at once (no team, no collective): whether one-thread torch products scale across cores at all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time

import torch
import torch.nn.functional as F

from benchmarks.shapes import MOE_SHAPES
from ninfer.core.cpu_executor import CpuExecutor, single_threaded_caller
from ninfer.models.common.moe.cpu_experts import ExpertRows, cpu_experts


def _time_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def bench_rows(n: int, args, gate_up: torch.Tensor, down: torch.Tensor, per_expert: int) -> list[dict]:
    """Every way of computing ``args.experts`` missed experts for ``n`` token rows, timed: the same experts on
    every call (cache-warm), and with ``args.cold`` a fresh random set of the bank's experts per call (read from
    DRAM, as a decode step meets them)."""
    dtype, (E, H, inter) = gate_up.dtype, down.shape
    x = (torch.randn(n, H) * 0.5).to(dtype)
    gen = torch.Generator().manual_seed(n)
    fixed = list(range(3, 3 + args.experts))
    out = torch.zeros(n, H, dtype=dtype)

    def pick(cold: bool) -> list[int]:
        return torch.randperm(E, generator=gen)[:args.experts].tolist() if cold else fixed

    def work(cold: bool) -> list[ExpertRows]:
        return [ExpertRows(expert=e, rows=torch.arange(n), x=x, weights=torch.full((n, 1), 0.1, dtype=dtype),
                           y=torch.empty(n, H, dtype=dtype)) for e in pick(cold)]

    def serial(cold: bool) -> None:
        for e in pick(cold):
            g, u = F.linear(x, gate_up[e]).split(inter, dim=-1)
            F.linear(F.silu(g) * u, down[e])

    results = []
    for cold in (False, True) if args.cold else (False,):
        tag = "cold" if cold else "warm"
        with torch.inference_mode():
            results.append(_row(n, f"{tag}: torch ops on the caller ({torch.get_num_threads()} intra-op threads)",
                                _time_ms(lambda c=cold: serial(c)), args, per_expert))
        for t in args.threads:
            with CpuExecutor(t) as team:
                # As called before, with the caller's own torch ops on one thread (no OpenMP team of its own left
                # spinning), and with the workers polling between collectives.
                for how, scope in (("", contextlib.nullcontext()), (", caller 1 thread", single_threaded_caller()),
                                   (", keep_active", team.keep_active())):
                    with scope:
                        results.append(_row(n, f"{tag}: cpu_experts, team of {t}{how}",
                                            _time_ms(lambda c=cold: cpu_experts(team, work(c), gate_up, down, out)),
                                            args, per_expert))
    return results


def _expert(e: int, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    g, u = F.linear(x, gate_up[e]).split(down.shape[2], dim=-1)
    F.linear(F.silu(g) * u, down[e])


def _one_thread_ms(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, onednn: bool) -> float:
    """One random expert of ``gate_up`` / ``down`` per call on this thread with one intra-op thread."""
    gen = torch.Generator().manual_seed(0)
    with single_threaded_caller(), torch.backends.mkldnn.flags(enabled=onednn):
        return _time_ms(lambda: _expert(int(torch.randint(gate_up.shape[0], (1,), generator=gen)), x, gate_up, down),
                        iters=40)


def _plain_threads_ms(t: int, experts: int, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> float:
    """ms per round of ``t`` pinned one-thread threads computing ``experts`` random experts each at once."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    rounds, times, start = 10, [0.0] * t, threading.Barrier(t)

    @torch.inference_mode()
    def worker(rank: int) -> None:
        if cpus:
            os.sched_setaffinity(0, {cpus[(rank + 1) % len(cpus)]})
        torch.set_num_threads(1)
        picks = torch.randint(gate_up.shape[0], (rounds + 1, experts), generator=torch.Generator().manual_seed(rank))
        for e in picks[0].tolist():  # warm-up
            _expert(e, x, gate_up, down)
        start.wait()
        t0 = time.perf_counter()
        for r in range(1, rounds + 1):
            for e in picks[r].tolist():
                _expert(e, x, gate_up, down)
        times[rank] = time.perf_counter() - t0

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(t)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return max(times) / rounds * 1e3


def _team_ms(t: int, experts: int, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> float:
    """ms per collective of a CpuExecutor of ``t`` computing ``experts`` random experts per worker."""
    picks = iter(torch.randint(gate_up.shape[0], (24, t, experts), generator=torch.Generator().manual_seed(1)))

    def collective(team: CpuExecutor) -> None:
        row = next(picks)

        @torch.inference_mode()
        def share(rank: int, size: int) -> None:
            for e in row[rank].tolist():
                _expert(e, x, gate_up, down)

        team.run(share)

    with CpuExecutor(t) as team:
        return _time_ms(lambda: collective(team), iters=19)


def bench_scaling(args, gate_up: torch.Tensor, down: torch.Tensor, per_expert: int) -> list[dict]:
    """One token's expert products: per torch path on one thread, then T concurrent pinned one-thread threads
    and a CpuExecutor team of T doing the same products."""
    x = (torch.randn(1, down.shape[1]) * 0.5).to(gate_up.dtype)
    paths = {"F.linear": (x, gate_up, down, True), "F.linear, oneDNN off": (x, gate_up, down, False),
             "F.linear fp32 (first 16 experts)": (x.float(), gate_up[:16].float(), down[:16].float(), True)}
    results = []
    for name, (xx, gu, dn, onednn) in paths.items():
        ms = _one_thread_ms(xx, gu, dn, onednn)
        nbytes = (gu[0].numel() + dn[0].numel()) * gu.element_size()
        print(f"one thread, {name:<36} {ms:8.3f} ms per expert  {nbytes / ms / 1e6:7.1f} GB/s", flush=True)
        results.append({"case": f"one thread, {name}", "ms": ms, "GB_per_s": nbytes / ms / 1e6})
    for t in args.threads:
        for case, ms in ((f"{t:>2} pinned one-thread threads", _plain_threads_ms(t, args.experts, x, gate_up, down)),
                         (f"{t:>2} workers of a CpuExecutor", _team_ms(t, args.experts, x, gate_up, down))):
            gbs = t * args.experts * per_expert / (ms * 1e-3) / 1e9
            print(f"{case}, {args.experts} random experts each: {ms:8.3f} ms per round  {gbs:7.1f} GB/s in all",
                  flush=True)
            results.append({"case": f"{case.strip()} x {args.experts} experts", "ms": ms, "GB_per_s": gbs})
    return results


def _row(n: int, name: str, ms: float, args, per_expert: int) -> dict:
    gbs = args.experts * per_expert / (ms * 1e-3) / 1e9
    print(f"rows={n:<3} {name:<45} {ms:8.3f} ms  {gbs:7.1f} GB/s", flush=True)
    return {"rows": n, "case": name, "ms": ms, "GB_per_s": gbs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="35b-a3b", choices=sorted(MOE_SHAPES))
    p.add_argument("--experts", type=int, default=6, help="missed experts per call")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--threads", type=int, nargs="+", default=[15, 8, 4])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cold", action="store_true", help="also time random experts of the whole bank per call")
    p.add_argument("--pin", action="store_true", help="pin the banks (as host experts beside a CUDA model are)")
    p.add_argument("--scaling", action="store_true", help="first time the torch paths and thread scaling alone")
    p.add_argument("--json")
    args = p.parse_args(argv)
    cfg = MOE_SHAPES[args.shape]
    H, inter, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    dtype = getattr(torch, args.dtype)
    gate_up = (torch.randn(E, 2 * inter, H) * 0.02).to(dtype)
    down = (torch.randn(E, H, inter) * 0.02).to(dtype)
    if args.pin:
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    rows_out: list[dict] = []
    print(f"# {args.shape}: H={H} I={inter}, {args.experts} experts of {per_expert / 2**20:.1f} MiB, {args.dtype}; "
          f"torch threads {torch.get_num_threads()}, banks {'pinned' if args.pin else 'pageable'}")
    if args.scaling:
        rows_out += bench_scaling(args, gate_up, down, per_expert)
    for n in args.rows:
        rows_out += bench_rows(n, args, gate_up, down, per_expert)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
