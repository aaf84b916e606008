"""The ``speculative`` suite: MTP speculative decoding: what a verify unit costs, and what it buys on a model with a trained MTP head.

Part 1, a published shape with random weights (acceptance means nothing there): time per decode unit through
the real Program at B = 1 and 8, plain (one graphed decode step) against the speculative unit for k = 1..3
(graphed verify forward of k + 1 positions, acceptance, the accepted state's commit and the MTP drafts), and the
verify forward stage alone; then the speedup those costs imply at published per-position acceptance rates.

Part 2, the embedded model (its MTP head is trained): through ``ninfer.Engine``, greedy, real prompts, B = 1
and 8 concurrent requests: tokens/s plain and with k = 1..3, the mean acceptance length (tokens per verify row)
and the acceptance per draft position.

    scripts/gpu speculative                                                             # on the GPU machine
    python -m benchmarks.speculative --shape tiny --device cpu --steps 3 --tokens 16     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.harness import sync
from benchmarks.programs import prefilled_sequences, random_weights
from benchmarks.shapes import SHAPES

# Per-position conditional acceptance published for Qwen3.5 MTP (shared/reference/speculative.md §3.4, Inco,
# Qwen3.5-4B, T=1), and a lower setting near vLLM's reported n=1..3 acceptance lengths (1.9 / 2.4 / 2.8).
PUBLISHED = {"inco_qwen35_4b": (0.846, 0.802, 0.79), "vllm_27b_awq": (0.90, 0.55, 0.45)}
PROMPTS = ["To be, or not to be, that is the question:", "Friends, Romans, countrymen, lend me your ears;",
           "Now is the winter of our discontent", "O Romeo, Romeo! wherefore art thou Romeo?",
           "All the world's a stage,", "If music be the food of love, play on;", "Once more unto the breach,",
           "Double, double toil and trouble;"]


def build_programs(shape: str, device: str, dtype: torch.dtype, *, max_batch: int, context: int, steps: int,
                   graphs: bool, ks: list[int]):
    """(config, plain Program, {k: speculative Program}) over one set of random weights (MTP block included)."""
    from ninfer.contract.memory import ProgramCapacity
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.execution.model import Qwen35Model
    from ninfer_qwen35.execution.mtp import Qwen35MTP
    from ninfer_qwen35.execution.parameters import MTPParams, Qwen35Parameters
    from ninfer_qwen35.program.mtp_program import Qwen35MTPProgram, verify_steps
    from ninfer_qwen35.program.program import Qwen35Program
    from ninfer_qwen35.state import kv_pools, state_layout

    config = parse_config({**SHAPES[shape], "mtp_num_hidden_layers": 1})
    weights = random_weights(config, device, dtype, ("text", "mtp"))
    model = Qwen35Model(Qwen35Parameters.from_weights(config, weights, dtype))
    mtp = Qwen35MTP(MTPParams.from_weights(config, weights, dtype, device), model)
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    max_len = context + 4 * steps + 16
    pages = max_batch * -(-max_len // 16)
    common = dict(state_layout=state_layout(config, name), device=device, max_concurrency=max_batch,
                  capacity=ProgramCapacity(kv_pages=pages, max_model_len=max_len), vocab_size=config.vocab_size,
                  cuda_graphs=graphs)
    plain = Qwen35Program(model, kv_pool=kv_pools(config, 16, name)[0], **common)
    spec = {k: Qwen35MTPProgram(model, mtp=mtp, draft_tokens=k, kv_pool=kv_pools(config, 16, name, mtp_layers=1)[0],
                                steps=verify_steps(config, rows=max_batch, draft_tokens=k, dtype=dtype,
                                                   device=torch.device(device)), **common)
            for k in ks}
    return config, plain, spec


def time_units(program, config, device: str, B: int, *, context: int, steps: int, warmup: int = 3) -> dict:
    """Median ms per decode unit (reserve + decode + commit of every row's tokens) for B rows at ``context``;
    with a verify unit, also the median ms of its forward stage alone (graph replay)."""
    from ninfer.contract.batch import RowDecision

    seqs = prefilled_sequences(program, config, B, context)
    unit, forward, tokens = [], [], 0
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        for sid in seqs:
            if not program.reserve_units(sid, program.decode_span):
                raise RuntimeError("KV pool too small for the benchmark")
        batch = program.decode(seqs)
        program.commit(batch, [RowDecision(accepted=r.produced) for r in batch.rows])
        sync(device)
        if i >= warmup:
            unit.append((time.perf_counter() - t0) * 1e3)
            tokens += sum(r.produced for r in batch.rows)
        graphs = program.graphs  # a verify unit's VerifyGraphs (None without CUDA graphs)
        if i >= warmup and program.decode_span > 1 and graphs is not None and B in graphs.graphs:
            sync(device)
            t0 = time.perf_counter()
            graphs.forward(B)
            sync(device)
            forward.append((time.perf_counter() - t0) * 1e3)
    commit = []
    graphs = program.graphs
    if program.decode_span > 1 and graphs is not None:  # the accepted state's scatter alone (last step kept)
        for _ in range(10):
            sync(device)
            t0 = time.perf_counter()
            program.verify_commit(graphs.batch(B), graphs.accepted[:B])
            sync(device)
            commit.append((time.perf_counter() - t0) * 1e3)
    for sid in seqs:
        program.release(sid)
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    return {"batch": B, "ms_unit": med(unit), "ms_forward_stage": med(forward), "ms_state_commit": med(commit),
            "tokens_per_unit": tokens / steps / B}


def implied_speedup(ratio: float, k: int, rates: tuple[float, ...]) -> float:
    """Tokens per unit at per-position conditional acceptance ``rates`` over the unit's cost in plain steps."""
    expected, run = 1.0, 1.0
    for a in rates[:k]:
        run *= a
        expected += run
    return expected / ratio


def part1(args, dtype) -> list[dict]:
    config, plain, spec = build_programs(args.shape, args.device, dtype, max_batch=max(args.batch),
                                         context=args.context, steps=args.steps, graphs=not args.eager, ks=args.k)
    print(f"# part 1: {args.shape} random weights on {args.device}, context {args.context}, {args.steps} units; "
          f"graphs: plain {plain.graphs is not None}, speculative "
          f"{all(p.graphs is not None for p in spec.values())} {[p.graph_error for p in spec.values()]}")
    print(f"{'B':>2} {'k':>2} {'ms/unit':>9} {'x plain':>8} {'fwd ms':>8} {'x plain':>8} {'commit ms':>9} " +
          " ".join(f"{n:>16}" for n in PUBLISHED))
    rows = []
    for B in args.batch:
        base = time_units(plain, config, args.device, B, context=args.context, steps=args.steps)
        rows.append({"k": 0, **base})
        print(f"{B:>2} {0:>2} {base['ms_unit']:>9.3f}", flush=True)
        for k, prog in spec.items():
            r = time_units(prog, config, args.device, B, context=args.context, steps=args.steps)
            r["k"] = k
            r["unit_over_plain"] = r["ms_unit"] / base["ms_unit"]
            r["forward_over_plain"] = r["ms_forward_stage"] / base["ms_unit"] if r["ms_forward_stage"] else None
            r["implied_speedup"] = {n: implied_speedup(r["unit_over_plain"], k, rates) for n, rates in PUBLISHED.items()}
            rows.append(r)
            fwd = f"{r['ms_forward_stage']:>8.3f} {r['forward_over_plain']:>8.3f}" if r["ms_forward_stage"] else \
                f"{'-':>8} {'-':>8}"
            fwd += f" {r['ms_state_commit']:>9.3f}" if r["ms_state_commit"] else f" {'-':>9}"
            print(f"{B:>2} {k:>2} {r['ms_unit']:>9.3f} {r['unit_over_plain']:>8.3f} {fwd} " +
                  " ".join(f"{r['implied_speedup'][n]:>15.2f}x" for n in PUBLISHED), flush=True)
    return rows


def part2(args, dtype_name: str) -> list[dict]:
    from ninfer import default_model_path
    from ninfer.contract.config import EngineConfig, StartupFeatures
    from ninfer.contract.prompt import TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams
    from ninfer.engine.engine import Engine
    from ninfer.testing.scheduling import submit_together

    print(f"# part 2: the embedded model on {args.device} ({dtype_name}), {args.tokens} tokens per request, greedy")
    print(f"{'B':>2} {'k':>2} {'tok/s':>9} {'speedup':>8} {'accept len':>10}  per position")
    rows = []
    for B in args.batch:
        base = None
        for k in [0, *args.k]:
            features = StartupFeatures(speculative="mtp", num_draft_tokens=k) if k else StartupFeatures()
            config = EngineConfig(device=args.device, dtype=dtype_name, features=features, max_concurrency=B,
                                  context_cache=False)
            with Engine(default_model_path(), config) as eng:
                work = [GenerationRequest(input=TextInput(text=PROMPTS[i % len(PROMPTS)]),
                                          sampling=SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                                                  ignore_eos=True)) for i in range(B)]
                eng.generate(work[0])  # warm (graphs captured at startup; first-use allocations)
                tps = 0.0
                for _ in range(2):  # the better of two runs, all B requests admitted together; counts of the last
                    before = eng.metrics().speculative
                    t0 = time.perf_counter()
                    results = [h.result() for h in submit_together(eng, work)]
                    tps = max(tps, sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0))
                    after = eng.metrics().speculative
            base = base or tps
            units = after.drafts - before.drafts  # verify rows; each produced its accepted drafts + 1 token
            per_position = [a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position,
                                                  strict=True)]
            row = {"batch": B, "k": k, "tokens_per_s": tps, "speedup": tps / base,
                   "acceptance_length": 1 + (after.accepted_tokens - before.accepted_tokens) / units if units else None,
                   "acceptance_per_position": [c / units for c in per_position[:k]] if units else []}
            rows.append(row)
            acc = f"{row['acceptance_length']:>10.3f}" if units else f"{'-':>10}"
            print(f"{B:>2} {k:>2} {tps:>9.1f} {row['speedup']:>8.3f} {acc}  "
                  + " ".join(f"{a:.3f}" for a in row["acceptance_per_position"]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30, help="timed units per (B, k) in part 1")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request in part 2")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--skip", choices=["part1", "part2"], help="run only the other part")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not all(1 <= b <= 8 for b in args.batch) or not all(1 <= k <= 3 for k in args.k):
        print("speculative: --batch values must be in 1..8 and --k values in 1..3", file=sys.stderr)
        return 2
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    out = {"shape": args.shape, "device": args.device, "context": args.context}
    if args.skip != "part1":
        out["part1"] = part1(args, dtype)
    if args.skip != "part2":
        out["part2"] = part2(args, "bfloat16" if cuda else "float32")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
