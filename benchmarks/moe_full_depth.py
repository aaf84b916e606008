"""Qwen3.5 MoE all-device decode at FULL depth, against its bytes floor (issue 21), with no checkpoint.

``benchmarks/moe.py`` writes and converts a checkpoint, so the disk limits it to a few layers and it scales its
figures to full depth. The device holds the whole 35B-A3B (69 GB of bf16), so this benchmark makes the random
weights directly on the device (``decode_step.random_parameters``), starts the Qwen3.5 Program over them and times
decode at full depth: nothing is extrapolated. What it does not cover (host experts, prefill, transformers) stays
with ``benchmarks/moe.py``.

A step is timed as ``benchmarks/decode_step.py`` times it (``reserve_units``, ``decode`` as a CUDA graph replay,
``commit``, the device synchronised around it), and with ``--engine`` also through ``ninfer.Engine`` (pipelined
decode: the mean inter-token gap of the steady part). Variants start another Program over the same weights with
PDL forced, kernels left to their parts, or other tiles (``parse_variant``), so a tile sweep at full depth is one
call; ``--rounds`` repeats the list in order (A, B, A, B): the Program step varies by several % between starts,
the engine's figure by about 0.1 %.

    python -m benchmarks.moe_full_depth --variants auto pdl=on --rounds 2 --engine --json out.json   # the H200
    python -m benchmarks.moe_full_depth --variants auto "moe_tiles=1:16,32,128,4,4+gdn_block_v=32" --engine
    python -m benchmarks.moe_full_depth --shape tiny --device cpu --steps 2 --context 8              # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import moe_weights as mw
from benchmarks.bench import target_lines
from benchmarks.decode_step import auto_pdl
from benchmarks.moe import B1_FLOOR_TARGET, copy_bandwidth

clock = time.perf_counter


def parse_variant(spec: str) -> dict:
    """A variant: ``auto`` (the model's own PDL choice) or knobs joined by ``+``: ``pdl=on|off``, ``ops_off=OPS``
    (``NINFER_OPS_OFF``), ``prefetch_tiles=N`` (``_pdl.PREFETCH_TILES``), ``late_trigger=0|1``
    (``_pdl.LATE_TRIGGER``), ``moe_tiles=LIMIT:BM,BN,BK,WARPS,STAGES``
    (the MoE kernels' row for calls up to LIMIT tokens), ``linear_tiles=NxK:BN,BK,SPLIT`` (the few-row linear for
    an [N, K] weight), ``moe_down=PAIRS:BN,BK,WARPS,STAGES`` (the down kernel alone for calls up to PAIRS (token,
    slot) pairs), ``gdn_block_v=V``, ``attention=TILE_N,SPLITS`` (decode attention's keys per tile and most splits),
    ``one_token=UN,UK,DN,DK,WARPS,STAGES,PRELOAD[,SHARED_FIRST]`` (``moe_one_token``'s tiles; flags 0 or 1),
    ``norm_tile=D:BLOCK_D,ROWS,WARPS`` (every RMS norm kernel's tile for rows of D) -> {"pdl", "ops_off", "knobs", "tiles"}."""
    out: dict = {"pdl": None, "ops_off": None, "knobs": {}, "tiles": {}}
    if spec == "auto":
        return out
    for part in spec.split("+"):
        key, _, value = part.partition("=")
        try:
            _knob(out, key, value)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"variant {spec!r}: {part!r}: expected auto or +-joined pdl=on|off, ops_off=OPS, "
                             f"prefetch_tiles=N, late_trigger=0|1, moe_tiles=LIMIT:BM,BN,BK,WARPS,STAGES, linear_tiles=NxK:BN,BK,SPLIT "
                             f"moe_down=PAIRS:BN,BK,WARPS,STAGES, gdn_block_v=V, attention=TILE_N,SPLITS or "
                             f"one_token=UN,UK,DN,DK,WARPS,STAGES,PRELOAD[,SHARED_FIRST] or "
                             f"norm_tile=D:BLOCK_D,ROWS,WARPS ({exc})") from None
    return out


def _knob(out: dict, key: str, value: str) -> None:
    from ninfer.ops.triton.moe import MoeConfig

    def ints(text: str, n: int) -> tuple[int, ...]:
        vals = tuple(int(v) for v in text.split(","))
        if len(vals) != n or min(vals) < 1:
            raise ValueError(f"{n} positive whole numbers")
        return vals

    if key == "pdl" and value in ("on", "off"):
        out["pdl"] = value == "on"
    elif key == "ops_off" and value:
        out["ops_off"] = value
    elif key == "prefetch_tiles" and value.isdigit():
        out["knobs"]["PREFETCH_TILES"] = int(value)
    elif key == "late_trigger" and value in ("0", "1"):
        out["knobs"]["LATE_TRIGGER"] = value == "1"
    elif key == "moe_tiles":
        limit, cfg = value.split(":")
        out["tiles"].setdefault("moe", {})[int(limit)] = MoeConfig(*ints(cfg, 5))
    elif key == "linear_tiles":
        shape, cfg = value.split(":")
        n, k = (int(v) for v in shape.split("x"))
        out["tiles"].setdefault("linear", {})[(n, k)] = ints(cfg, 3)
    elif key == "moe_down":  # LIMIT:BN,BK,WARPS,STAGES; LIMIT counts (token, slot) pairs
        limit, cfg = value.split(":")
        out["tiles"].setdefault("moe_down", {})[int(limit)] = ints(cfg, 4)
    elif key == "gdn_block_v":
        out["tiles"]["gdn_block_v"] = ints(value, 1)[0]
    elif key == "attention":
        out["tiles"]["attention"] = ints(value, 2)
    elif key == "norm_tile":  # D:BLOCK_D,ROWS,WARPS for every RMS norm of rows of D
        d, cfg = value.split(":")
        out["tiles"].setdefault("norm", {})[int(d)] = ints(cfg, 3)
    elif key == "one_token":
        from ninfer.ops.triton.moe_one_token import OneTokenTiles

        vals = value.split(",")  # 6 sizes, PRELOAD, then SHARED_FIRST (default 1)
        if len(vals) not in (7, 8):
            raise ValueError("6 sizes, PRELOAD and SHARED_FIRST")
        flags = [bool(int(v)) for v in vals[6:]]
        out["tiles"]["one_token"] = OneTokenTiles(*ints(",".join(vals[:6]), 6), *flags)
    else:
        raise ValueError("unknown knob")


def time_variant(params, cfg: dict, args, device: str, variant: dict, profile: bool = False,
                 chain: bool = False) -> dict:
    """Start a Program over ``params`` as ``variant`` says and time decode at every B (and the engine's); with
    ``profile``, then also profile ``args.profile`` steps at B=1 (the full tables beside ``--json``); with
    ``chain``, trace the engine's steady steps at every B once more (``benchmarks/chain_profile.py``)."""
    import torch

    from benchmarks.decode_step import build_program, measure, measure_engine
    from benchmarks.moe_variants import ops_off, pdl_knobs, tiles

    pdl = auto_pdl(params, device) if variant["pdl"] is None else variant["pdl"]
    scope = ops_off(variant["ops_off"]) if variant["ops_off"] else contextlib.nullcontext()
    with scope, pdl_knobs(variant["knobs"]), tiles(**variant["tiles"]):
        t = clock()
        config, program = build_program(cfg, device, max_batch=max(args.batches), context=args.context,
                                        steps=args.steps + 8, graphs=device.startswith("cuda"),
                                        dtype=params[1].embed.dtype, params=params, pdl=pdl)
        res: dict = {"pdl": pdl, "ops_off": variant["ops_off"], "knobs": variant["knobs"],
                     "tiles": {k: str(v) for k, v in variant["tiles"].items()}, "start_s": clock() - t,
                     "graphs": program.graphs is not None, "rows": []}
        try:
            for B in args.batches:
                row = measure(program, config, device, B, context=args.context, steps=args.steps)
                if args.engine:
                    row.update(measure_engine(program, config, device, B, context=args.context, steps=args.steps))
                if chain:  # its own run: the trace slows what it watches
                    from benchmarks.chain_profile import print_table

                    traced = measure_engine(program, config, device, B, context=args.context, steps=args.steps,
                                            chain=True)
                    row["chain"] = traced.get("chain")
                    row["chain_engine_ms_per_step"] = traced["engine_ms_per_step"]
                    if row["chain"]:
                        print_table(f"B={B}, engine {traced['engine_ms_per_step']:.3f} ms/step traced", row["chain"])
                res["rows"].append(row)
            if profile:
                from benchmarks.moe_runs import print_profile, profile_run

                table = Path(args.json).with_name("profile_full_depth.txt") if args.json else None
                res["profile"] = profile_run(program, config, device, 1, args.context, args.profile, table)
                print_profile(f"full depth, pdl {pdl}", res["profile"])
        finally:
            program.release_graphs()
            del program
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return res


def routing_distinct(params, cfg: dict, device: str, batches: list[int]) -> dict[int, float]:
    """B -> distinct experts per layer the router picks for B tokens (``moe_runs.routing_spread`` on one
    Program over these weights; 1 -> k)."""
    from benchmarks.decode_step import build_program
    from benchmarks.moe_runs import ROUTING_PROBE_TOKENS, routing_spread

    k = cfg["num_experts_per_tok"]
    config, program = build_program(cfg, device, max_batch=1, context=ROUTING_PROBE_TOKENS, steps=8, graphs=False,
                                    dtype=params[1].embed.dtype, params=params)
    out = {1: float(k)}
    for B in batches:
        if B > 1:
            s = routing_spread(program, config, B)
            out[B] = s["distinct"] if s["source"] == "measured" else mw.expected_distinct(cfg["num_experts"], k, B)
    del program
    gc.collect()
    return out


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
             "round(s) per variant (medians over rounds; every round's figure in the JSON)", "",
             "| variant | B | ms/step | tok/s | floor ms | of floor | engine ms/step | engine of floor | graph ms | rounds (ms) |",
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="35b-a3b", choices=sorted(mw.BENCH_SHAPES))
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per row before the decode steps")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--variants", nargs="+", default=["auto"], metavar="VARIANT",
                   help="auto, or +-joined knobs: pdl=on|off, ops_off=OPS (NINFER_OPS_OFF), prefetch_tiles=N (the "
                        "few-row linear's L2 hints under PDL), moe_tiles=LIMIT:BM,BN,BK,WARPS,STAGES, "
                        "linear_tiles=NxK:BN,BK,SPLIT, moe_down=PAIRS:BN,BK,WARPS,STAGES, gdn_block_v=V; the first is "
                        "the reported one")
    p.add_argument("--rounds", type=int, default=1, help="times the variant list runs, in order")
    p.add_argument("--engine", action="store_true", help="also time each B through ninfer.Engine (pipelined)")
    p.add_argument("--chain-profile", action="store_true",
                   help="on the first round, trace each variant's engine steady steps at every B once more: "
                        "each kernel's advance of the chain's end (benchmarks/chain_profile.py)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="profile STEPS decode steps at B=1 on the first variant's first round (kernels per step)")
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from benchmarks.bench import run_with_plugins

    return run_with_plugins(_run, argv)


def _run(argv) -> int:
    args = parse_args(argv)
    try:
        variants = {spec: parse_variant(spec) for spec in args.variants}
    except ValueError as exc:
        print(f"moe_full_depth: {exc}", file=sys.stderr)
        return 2
    if not all(1 <= b <= 8 for b in args.batches) or min(args.context, args.steps, args.rounds) < 1:
        print("moe_full_depth: --batches in 1..8; --context, --steps and --rounds positive", file=sys.stderr)
        return 2
    import torch

    from benchmarks.bench import device_info
    from benchmarks.decode_step import random_parameters

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("moe_full_depth: no CUDA device; use --device cpu", file=sys.stderr)
        return 2
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
    distinct = routing_distinct(params, cfg, device, args.batches)
    res["distinct_experts"] = distinct
    for i in range(args.rounds):
        for spec, variant in variants.items():
            profile = bool(args.profile) and i == 0 and spec == args.variants[0]
            run = time_variant(params, cfg, args, device, variant, profile, args.chain_profile and i == 0)
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


def _sample_copy(samples: list[float], device: str) -> None:
    """One more copy-rate sample, unless the device has no room left for the copy's two buffers."""
    import torch

    try:
        samples.append(copy_bandwidth(device))
    except torch.OutOfMemoryError:
        print("# copy rate: no room for another sample", flush=True)


if __name__ == "__main__":
    sys.exit(main())
