"""How much a kernel boundary costs under PDL, and whether a device-counter handoff costs less (issue 21).

The one-launch MoE block of one token (``ninfer/ops/triton/moe_one_token.py``) replaced a PDL boundary by a
counter: its down programs spin until their slot's gate_up programs have published, instead of waiting at
``griddepcontrol.wait`` for the end of a gate_up launch. That saved ~0.7 us per MoE layer, but with two other
gains mixed in (per-slot release, and no expert read after the wait). This benchmark times the handoff alone, in
a chain of pairs captured in one CUDA graph under PDL:

- producer: a bandwidth-bound projection y = W x (W [N, K] in bf16, one program per BLOCK_N rows, the shape of a
  35B-A3B out projection by default), as every large kernel of a decode step is;
- consumer: a small kernel reading y (z = 2 y), as a norm or a gate after a projection is, in one of two modes:
  ``wait``: ``griddepcontrol.wait`` first (every kernel of ``ninfer`` does this);
  ``counter``: each producer program raises a counter after its stores (release); the consumer lets its own
  successor be scheduled, spins on the counter (acquire) until every producer program has published, does its
  work, and waits on the grid only at its end, so that its completion still implies its producer's.

Per pair, the table gives the chain's time, and the consumer's share: the pair minus a chain of producers alone.

    python -m benchmarks.handoff --json out.json                   # the H200
    python -m benchmarks.handoff --device cpu --pairs 2 --rows 64 --cols 128   # smoke run (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import _pdl
from ninfer.ops.triton._arrivals import arrival_counters
from ninfer.ops.triton._pdl import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_launch_dependents, pdl_prologue

MODES = ("wait", "counter")


@triton.jit
def _producer(w_ptr, x_ptr, y_ptr, arrive_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PUBLISH: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + (k0 + kk)[None, :]).to(tl.float32)
        acc += tl.sum(w * tl.load(x_ptr + k0 + kk).to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc)
    if PUBLISH:
        tl.debug_barrier()  # every thread's rows are stored before the arrival is published
        tl.atomic_add(arrive_ptr, 1, sem="release")


@triton.jit
def _consumer(y_ptr, z_ptr, arrive_ptr, PRODUCERS, BLOCK: tl.constexpr, SPIN: tl.constexpr,
              USE_PDL: tl.constexpr = False):
    cc = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if SPIN:
        pdl_launch_dependents(USE_PDL)
        seen = tl.atomic_add(arrive_ptr, 0, sem="acquire")
        while seen < PRODUCERS:
            seen = tl.atomic_add(arrive_ptr, 0, sem="acquire")
        tl.debug_barrier()  # no thread reads y before the acquire above
        tl.store(z_ptr + cc, 2.0 * tl.load(y_ptr + cc, cache_modifier=".cg"))
        if tl.atomic_add(arrive_ptr + 1, 1, sem="relaxed") == tl.num_programs(0) - 1:
            tl.store(arrive_ptr, 0)  # the last reader: zero for the next pair
            tl.store(arrive_ptr + 1, 0)
        pdl_prologue(USE_PDL, False)  # the grid's end waits for the producer: completion stays transitive
    else:
        pdl_prologue(USE_PDL)
        tl.store(z_ptr + cc, 2.0 * tl.load(y_ptr + cc))


def chain(w, x, ys, zs, mode: str | None, block_n: int, block_k: int, block: int) -> None:
    """len(ys) pairs (producer, consumer in ``mode``), or producers alone with ``mode`` None."""
    N, K = w.shape
    arrive = arrival_counters(w.device, 2)
    producers = N // block_n
    for y, z in zip(ys, zs, strict=True):
        _producer[(producers,)](w, x, y, arrive, K, BLOCK_N=block_n, BLOCK_K=block_k, PUBLISH=mode == "counter",
                                num_warps=4, **pdl_args(w.device))
        if mode is not None:
            _consumer[(N // block,)](y, z, arrive, producers, BLOCK=block, SPIN=mode == "counter", num_warps=4,
                                     **pdl_args(w.device))


def _check(zs, want, mode: str | None, when: str) -> None:
    """Every consumer output of a chain in ``mode`` is 2 W x (producers alone leave nothing to check)."""
    if mode is None:
        return
    err = max(float((z - want).abs().max()) for z in zs)
    if err > 1e-2 * float(want.abs().max()):
        raise AssertionError(f"handoff {mode}: consumer output off by {err:.3e}{when}")


def graph_us(launches, pdl: bool, replays: int, check=None) -> float:
    """us per replay of ``launches()`` captured in one CUDA graph (PDL per ``pdl``): run once to compile, capture,
    replay three times, call ``check`` (if any) on the results, then time ``replays`` replays."""
    with _pdl.scope(pdl):
        launches()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launches()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    if check is not None:
        check()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def run(args) -> dict:
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(args.rows, args.cols, generator=gen, device=dev).to(torch.bfloat16)
    x = torch.randn(args.cols, generator=gen, device=dev).to(torch.bfloat16)
    ys = [torch.empty(args.rows, device=dev) for _ in range(args.pairs)]
    zs = [torch.empty(args.rows, device=dev) for _ in range(args.pairs)]
    want = 2.0 * (w.float() @ x.float())
    shape = (args.block_n, args.block_k, args.block)
    out: dict = {"args": vars(args), "rows": []}
    for mode in (None, *MODES):
        for z in zs:
            z.fill_(float("nan"))
        if dev.type != "cuda":  # the smoke run: eager, checked, not timed
            chain(w, x, ys, zs, mode, *shape)
            _check(zs, want, mode, "")
            out["rows"].append({"mode": mode or "producers", "checked": mode is not None})
            continue
        us = graph_us(lambda mode=mode: chain(w, x, ys, zs, mode, *shape), args.pdl, args.replays,
                      lambda mode=mode: _check(zs, want, mode, " after replays")) / args.pairs
        out["rows"].append({"mode": mode or "producers", "us_per_pair": us})
    if dev.type == "cuda":
        alone = out["rows"][0]["us_per_pair"]
        for row in out["rows"][1:]:
            row["consumer_us"] = row["us_per_pair"] - alone
        out["producer_bytes"] = w.numel() * w.element_size()
    return out


def chain_parser(doc: str | None, pdl_off_help: str = "plain launches") -> argparse.ArgumentParser:
    """The options every chain micro-benchmark takes: --device, --replays, --no-pdl, --json."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--no-pdl", dest="pdl", action="store_false", help=pdl_off_help)
    p.add_argument("--json", type=str, default=None)
    return p


def parse_args(argv=None):
    p = chain_parser(__doc__, "plain launches (the counter then never waits)")
    p.add_argument("--rows", type=int, default=2048, help="N of the producer's W [N, K]")
    p.add_argument("--cols", type=int, default=4096, help="K of the producer's W [N, K]")
    p.add_argument("--block-n", type=int, default=8, help="producer rows per program")
    p.add_argument("--block-k", type=int, default=256)
    p.add_argument("--block", type=int, default=1024, help="consumer elements per program")
    p.add_argument("--pairs", type=int, default=64, help="pairs per captured chain")
    args = p.parse_args(argv)
    if args.rows % args.block_n or args.rows % min(args.block, args.rows) or args.cols % args.block_k:
        p.error("--rows must be a multiple of --block-n and --block, --cols of --block-k")
    args.block = min(args.block, args.rows)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.device.startswith("cuda"):
        print(f"| mode | us per pair | consumer's share (us) |  W {res['producer_bytes'] / 1e6:.1f} MB, "
              f"{args.pairs} pairs, PDL {'on' if args.pdl else 'off'}")
        print("|---|---|---|")
        for row in res["rows"]:
            print(f"| {row['mode']} | {row['us_per_pair']:.2f} | {row.get('consumer_us', 0.0):.2f} |")
    else:
        print("handoff smoke run: " + ", ".join(r["mode"] for r in res["rows"]) + " checked")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
