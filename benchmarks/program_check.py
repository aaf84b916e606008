"""Program smoke check on the GPU: decode through CUDA graphs (one per exact B) equals decode without them.

Three Qwen35Programs share one random-weight model: ``graph`` captures a decode graph per B;
``static`` runs the very same static input buffers and kernels without capture; ``eager`` builds
each decode batch afresh (its kernels see the batch's own max_seq_len). For every B the same
prompts are prefilled in all three, then all decode greedily in lockstep. The check passes when
graph capture succeeded and ``graph`` gives exactly the tokens of ``static`` (the same work, so any
difference is a capture bug). ``eager`` is reported alongside (tokens and the largest difference of
the chosen tokens' logprobs; with random weights a near tie may flip a token). Step times are for
reserve + decode + commit. On CPU (no graphs) it runs as a smoke test.

    python -m benchmarks.program_check --shape 9b --batch 1 2 3 4 5 6 7 8        # on the GPU machine
    python -m benchmarks.program_check --shape tiny --device cpu --steps 2 --batch 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.harness import sync

PATHS = ("eager", "static", "graph")


def _programs(shape: str, device: str, dtype: torch.dtype, *, max_batch: int, max_len: int):
    from benchmarks.programs import random_parameters
    from ninfer.contract.memory import ProgramCapacity
    from ninfer_qwen35.execution.model import Qwen35Model
    from ninfer_qwen35.program import Qwen35Program
    from ninfer_qwen35.state import kv_pools, state_layout

    config, params = random_parameters(shape, device, dtype)
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    model = Qwen35Model(params)
    pool = kv_pools(config, 16, name)[0]
    pages = max_batch * -(-max_len // pool.page_size)

    def make(path: str) -> Qwen35Program:
        return Qwen35Program(model, state_layout=state_layout(config, name), kv_pool=pool, device=device,
                             max_concurrency=max_batch, vocab_size=config.vocab_size,
                             capacity=ProgramCapacity(kv_pages=pages, max_model_len=max_len),
                             cuda_graphs=path == "graph", static_decode=path == "static")

    return config, {path: make(path) for path in PATHS}


def _compare(a: list[list[int]], b: list[list[int]], lp_a: list[list[float]], lp_b: list[list[float]]):
    """(first step where any row's tokens differ or None, max |logprob diff| before that step)."""
    first = None
    for ra, rb in zip(a, b, strict=True):
        for j, (x, y) in enumerate(zip(ra, rb, strict=True)):
            if x != y:
                first = j if first is None else min(first, j)
                break
    upto = first if first is not None else len(a[0])
    diff = max((abs(x - y) for ra, rb in zip(lp_a, lp_b, strict=True)
                for x, y in zip(ra[:upto], rb[:upto], strict=True)), default=0.0)
    return first, diff


def check_batch(programs: dict, config, B: int, *, context: int, steps: int, device: str) -> dict:
    from ninfer.contract.batch import RowDecision
    from ninfer.contract.prompt import PreparedPrompt
    from ninfer.contract.request import SamplingParams

    gen = torch.Generator().manual_seed(100 + B)
    prompts = [torch.randint(0, config.vocab_size, (context + b,), generator=gen).tolist() for b in range(B)]
    sampling = SamplingParams(temperature=0.0, logprobs=True)
    ids, tokens, logprobs, times = {}, {}, {}, {}
    for path, prog in programs.items():
        ids[path] = [prog.open_sequence(PreparedPrompt(token_ids=p), sampling) for p in prompts]
        tokens[path], logprobs[path], times[path] = [[] for _ in range(B)], [[] for _ in range(B)], []
        for i, sid in enumerate(ids[path]):
            assert prog.reserve_units(sid, len(prompts[i]))
            batch = prog.prefill(sid, len(prompts[i]))
            prog.commit(batch, [RowDecision(accepted=1)])
            tokens[path][i].append(batch.rows[0].tokens[0])
            logprobs[path][i].append(batch.rows[0].logprobs[0])
    for _ in range(steps):
        for path, prog in programs.items():
            sync(device)
            t0 = time.perf_counter()
            for sid in ids[path]:
                assert prog.reserve_units(sid, 1)
            batch = prog.decode(ids[path])
            prog.commit(batch, [RowDecision(accepted=1)] * B)
            sync(device)
            times[path].append((time.perf_counter() - t0) * 1e3)
            for i, row in enumerate(batch.rows):
                tokens[path][i].append(row.tokens[0])
                logprobs[path][i].append(row.logprobs[0])
    for path, prog in programs.items():
        for sid in ids[path]:
            prog.release(sid)
        if not prog.usage().all_free:
            raise AssertionError(f"{path} Program holds resources after release: {prog.usage()}")
    graph_vs_static = _compare(tokens["graph"], tokens["static"], logprobs["graph"], logprobs["static"])
    graph_vs_eager = _compare(tokens["graph"], tokens["eager"], logprobs["graph"], logprobs["eager"])
    out = {"B": B, "tokens_equal": graph_vs_static[0] is None, "first_divergence_step": graph_vs_static[0],
           "max_logprob_diff": graph_vs_static[1], "eager_tokens_equal": graph_vs_eager[0] is None,
           "eager_first_divergence_step": graph_vs_eager[0], "eager_max_logprob_diff": graph_vs_eager[1],
           "tokens": tokens["graph"], "logprobs": logprobs["graph"]}
    for path in PATHS:
        out[f"{path}_ms"] = statistics.median(times[path][1:] or times[path])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.8b", help="a shape from benchmarks/shapes.py (9b, 0.8b, 27b, tiny)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--context", type=int, default=48, help="prompt tokens per row (row b gets context + b)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    ap.add_argument("--same-as", default=None, metavar="JSON",
                    help="an earlier run's --json: the graph path's tokens and logprobs must equal it bit for bit "
                         "(e.g. the same kernels launched another way, NINFER_PDL=1 against off)")
    args = ap.parse_args(argv)
    reference = None
    if args.same_as:
        with open(args.same_as) as f:
            reference = {r["B"]: r for r in json.load(f)["results"]}
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    max_batch = max(args.batch)
    config, programs = _programs(args.shape, args.device, dtype, max_batch=max_batch,
                                 max_len=args.context + max_batch + args.steps + 16)
    graph = programs["graph"]
    graphs_on = graph.graphs is not None
    state = f"captured for B=1..{max_batch}" if graphs_on else f"off ({graph.graph_error})"
    print(f"program_check shape={args.shape} device={args.device} dtype={args.dtype} graphs={state}")
    results = []
    with torch.inference_mode():
        for B in args.batch:
            r = check_batch(programs, config, B, context=args.context, steps=args.steps, device=args.device)
            if reference is not None and B in reference:
                ref = reference[B]
                r["same_as_reference"] = r["tokens"] == ref["tokens"] and r["logprobs"] == ref["logprobs"]
                print(f"  B={B}: graph tokens and logprobs {'bitwise equal to' if r['same_as_reference'] else 'DIFFER from'}"
                      f" {args.same_as}")
            results.append(r)
            same = "equal" if r["tokens_equal"] else f"DIFFER from step {r['first_divergence_step']}"
            eager = "equal" if r["eager_tokens_equal"] else f"differ from step {r['eager_first_divergence_step']}"
            print(f"  B={B}: graph vs static tokens {same} (max |dlogprob| {r['max_logprob_diff']:.2e}); "
                  f"vs eager {eager} (max |dlogprob| {r['eager_max_logprob_diff']:.2e}); step ms eager "
                  f"{r['eager_ms']:.2f}, static {r['static_ms']:.2f}, graph {r['graph_ms']:.2f}")
    expect_graphs = args.device.startswith("cuda")
    ok = all(r["tokens_equal"] and r.get("same_as_reference", True) for r in results) \
        and (graphs_on or not expect_graphs) and (reference is None or any("same_as_reference" in r for r in results))
    summary = {"check": "program_graphs", "ok": ok, "shape": args.shape, "device": args.device, "dtype": args.dtype,
               "graphs": graphs_on, "graph_error": graph.graph_error, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
