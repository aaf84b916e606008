"""``moe --full-depth``: Qwen3.5 MoE all-device decode at full depth against its bytes floor, with no checkpoint.

``benchmarks/moe.py`` writes and converts a checkpoint, so the disk limits it to a few layers and it scales its
figures to full depth. The device holds the whole 35B-A3B (69 GB of bf16), so this benchmark makes the random
weights directly on the device (``programs.random_parameters``), starts the Qwen3.5 Program over them and times
decode at full depth: nothing is extrapolated. What it does not cover (host experts, prefill, transformers) stays
with ``benchmarks/moe.py``.

A step is timed as ``benchmarks/programs.py`` times it (``reserve_units``, ``decode`` as a CUDA graph replay,
``commit``, the device synchronised around it), and with ``--engine`` also through ``ninfer.Engine`` (pipelined
decode: the mean inter-token gap of the steady part). ``--pdl`` starts one Program per choice over the same
weights; ``--rounds`` repeats them in order (A, B, A, B): the Program step varies by several % between starts,
the engine's figure by about 0.1 %.

    scripts/gpu moe --full-depth                                                   # on the GPU machine
    python -m benchmarks.moe_full_depth --shape tiny --device cpu --steps 2 --context 8          # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import moe_weights as mw
from benchmarks.harness import device_info, run_with_plugins, target_lines
from benchmarks.moe import B1_FLOOR_TARGET, copy_bandwidth
from benchmarks.programs import auto_pdl, build_program, measure, measure_engine, random_parameters

clock = time.perf_counter
PDL = ("auto", "on", "off")


def time_variant(params, cfg: dict, args, device: str, pdl_choice: str) -> dict:
    """Start a Program over ``params`` with PDL as chosen and time decode at every B (and the engine's)."""
    import torch

    pdl = auto_pdl(params, device) if pdl_choice == "auto" else pdl_choice == "on"
    t = clock()
    config, program = build_program(cfg, device, max_batch=max(args.batches), context=args.context,
                                    steps=args.steps + 8, graphs=device.startswith("cuda"),
                                    dtype=params[1].embed.dtype, params=params, pdl=pdl)
    res: dict = {"pdl": pdl, "start_s": clock() - t, "graphs": program.graphs is not None, "rows": []}
    try:
        for B in args.batches:
            row = measure(program, config, device, B, context=args.context, steps=args.steps)
            if args.engine:
                row.update(measure_engine(program, config, device, B, context=args.context, steps=args.steps))
            res["rows"].append(row)
    finally:
        program.release_graphs()
        del program
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return res


def summarize(res: dict, cfg: dict, args, bw: float, distinct: dict[int, float]) -> dict:
    """Per variant and B: the median over rounds of ms per step, tok/s and the fraction of the bytes floor."""
    out: dict = {}
    for spec in args.variants:
        runs = [r for r in res["runs"] if r["variant"] == spec]
        for B in args.batches:
            ms = [row["ms_median"] for r in runs for row in r["rows"] if row["batch"] == B]
            eng = [row["engine_ms_per_step"] for r in runs for row in r["rows"]
                   if row["batch"] == B and "engine_ms_per_step" in row]
            graph = [row["graph_ms"] for r in runs for row in r["rows"] if row["batch"] == B and row.get("graph_ms")]
            floor_ms = mw.step_bytes(cfg, B, args.context, distinct[B]) / (bw * 1e12) * 1e3
            m = statistics.median(ms)
            e = statistics.median(eng) if eng else None
            out.setdefault(spec, {})[B] = {
                "ms_per_step": m, "ms_rounds": ms, "tokens_per_s": B / m * 1e3, "floor_ms": floor_ms,
                "of_floor": floor_ms / m, "distinct_experts": distinct[B], "engine_ms_per_step": e,
                "engine_rounds": eng, "engine_of_floor": floor_ms / e if e else None,
                "graph_ms": statistics.median(graph) if graph else None}
    return out


def markdown(res: dict) -> str:
    d = res["device"]
    lines = [f"# Qwen3.5 MoE {res['shape']} at full depth ({res['layers']} layers, random weights made on the "
             f"device) on {d.get('name', d['device'])}, torch {d['torch']}; copy {res['copy_tb_s']:.2f} TB/s",
             f"context {res['args']['context']}, {res['args']['steps']} steps per run, {res['args']['rounds']} "
             "round(s) per run (medians over rounds; every round's figure in the JSON)", "",
             "| run | B | ms/step | tok/s | floor ms | of floor | engine ms/step | engine of floor | graph ms | rounds (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for spec, rows in res["summary"].items():
        for B, r in rows.items():
            rounds = ", ".join(f"{x:.3f}" for x in r["ms_rounds"])
            eng = "-" if r["engine_ms_per_step"] is None else f"{r['engine_ms_per_step']:.3f}"
            eof = "-" if r["engine_of_floor"] is None else f"{r['engine_of_floor']:.2f}"
            graph = "-" if r.get("graph_ms") is None else f"{r['graph_ms']:.3f}"
            lines.append(f"| {spec} | {B} | {r['ms_per_step']:.3f} | {r['tokens_per_s']:.1f} | {r['floor_ms']:.3f} "
                         f"| {r['of_floor']:.2f} | {eng} | {eof} | {graph} | {rounds} |")
    lines += target_lines(res.get("targets", {}))
    return "\n".join(lines)


def _sample_copy(samples: list[float], device: str) -> None:
    """One more copy-rate sample, unless the device has no room left for the copy's two buffers."""
    import torch

    try:
        samples.append(copy_bandwidth(device))
    except torch.OutOfMemoryError:
        print("# copy rate: no room for another sample", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="35b-a3b", choices=("35b-a3b", "tiny"))  # Qwen3.5 MoE only
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per row before the decode steps")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--pdl", nargs="+", default=["auto"], choices=PDL,
                   help="programmatic dependent launch per run: the model's choice (auto) or forced; the first is "
                        "the reported one")
    p.add_argument("--rounds", type=int, default=1, help="times the --pdl list runs, in order")
    p.add_argument("--engine", action="store_true", help="also time each B through ninfer.Engine (pipelined)")
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    return run_with_plugins(_run, argv)


def _run(argv) -> int:
    args = parse_args(argv)
    if not all(1 <= b <= 8 for b in args.batches) or min(args.context, args.steps, args.rounds) < 1:
        print("moe_full_depth: --batches in 1..8; --context, --steps and --rounds positive", file=sys.stderr)
        return 2
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("moe_full_depth: no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    args.variants = [f"pdl={p}" for p in dict.fromkeys(args.pdl)]
    cfg = mw.moe_config(args.shape)
    t0 = clock()
    res: dict = {"shape": args.shape, "layers": cfg["num_hidden_layers"], "config": cfg, "args": vars(args),
                 "device": device_info(device), "weights": mw.weight_bytes(cfg), "runs": []}
    # The copy rate sets the floor: sampled at the start (a cold device may read low), after the weights are made
    # and after the runs; the median is the floor's rate, every sample is kept.
    samples = [copy_bandwidth(device)]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t = clock()
    params = random_parameters(cfg, device, dtype)
    res["weights_s"] = clock() - t
    print(f"# {args.shape}: {res['weights']['total'] / 1e9:.1f} GB of random weights on {device} in "
          f"{res['weights_s']:.1f} s", flush=True)
    _sample_copy(samples, device)
    k = cfg["num_experts_per_tok"]  # uniform routing: random weights and router
    distinct = {B: float(k) if B == 1 else mw.expected_distinct(cfg["num_experts"], k, B) for B in args.batches}
    res["distinct_experts"] = distinct
    for i in range(args.rounds):
        for spec in args.variants:
            run = time_variant(params, cfg, args, device, spec.split("=")[1])
            res["runs"].append({"round": i, "variant": spec, **run})
            print(f"# round {i} {spec} (pdl {run['pdl']}): " + ", ".join(
                f"B={r['batch']} {r['ms_median']:.3f} ms" + (f" (engine {r['engine_ms_per_step']:.3f})"
                                                             if "engine_ms_per_step" in r else "")
                for r in run["rows"]), flush=True)
    _sample_copy(samples, device)
    res["copy_tb_s_samples"] = samples
    res["copy_tb_s"] = sorted(samples)[len(samples) // 2]
    res["summary"] = summarize(res, cfg, args, res["copy_tb_s"], distinct)
    b1 = res["summary"][args.variants[0]].get(1)
    measured = b1["of_floor"] if b1 else None
    res["targets"] = {"decode_b1_of_floor_full_depth": {"target": B1_FLOOR_TARGET, "measured": measured,
                                                        "met": None if measured is None else measured >= B1_FLOOR_TARGET}}
    res["wall_s"] = clock() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
