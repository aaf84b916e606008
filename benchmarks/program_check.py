"""Program smoke check on the GPU: decode through CUDA graphs (one per exact B) equals eager decode.

Two Qwen35Programs share one random-weight model: one eager, one with graphs. For every B the
same prompts are prefilled in both, then both decode greedily in lockstep; the check passes when
graph capture succeeded and every row's tokens are identical. It also reports the largest
difference of the chosen tokens' logprobs and the time of one decode step (reserve + decode +
commit) on each path. On CPU (no graphs) it runs eager against eager, as a smoke test.

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


def _programs(shape: str, device: str, dtype: torch.dtype, *, max_batch: int, max_len: int):
    from benchmarks.decode_step import random_parameters
    from ninfer_qwen35.execution.model import Qwen35Model
    from ninfer_qwen35.program import Qwen35Program
    from ninfer_qwen35.state import kv_pools, state_layout

    config, params = random_parameters(shape, device, dtype)
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    model = Qwen35Model(params)
    pool = kv_pools(config, 16, name)[0]
    pages = max_batch * -(-max_len // pool.page_size)

    def make(graphs: bool) -> Qwen35Program:
        return Qwen35Program(model, state_layout=state_layout(config, name), kv_pool=pool, device=device,
                             max_concurrency=max_batch, num_pages=pages, vocab_size=config.vocab_size,
                             max_model_len=max_len, cuda_graphs=graphs)

    return config, make(False), make(True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_batch(eager, graph, config, B: int, *, context: int, steps: int, device: str) -> dict:
    from ninfer.contract.batch import RowDecision
    from ninfer.contract.prompt import PreparedPrompt
    from ninfer.contract.request import SamplingParams

    gen = torch.Generator().manual_seed(100 + B)
    prompts = [torch.randint(0, config.vocab_size, (context + b,), generator=gen).tolist() for b in range(B)]
    sampling = SamplingParams(temperature=0.0, logprobs=True)
    rows: dict[str, list[int]] = {}
    tokens: dict[str, list[list[int]]] = {}
    logprobs: dict[str, list[list[float]]] = {}
    times: dict[str, list[float]] = {}
    for label, prog in (("eager", eager), ("graph", graph)):
        ids = [prog.open_sequence(PreparedPrompt(token_ids=p), sampling) for p in prompts]
        toks, lps = [[] for _ in ids], [[] for _ in ids]
        for i, sid in enumerate(ids):
            assert prog.reserve_units(sid, len(prompts[i]))
            batch = prog.prefill(sid, len(prompts[i]))
            prog.commit(batch, [RowDecision(accepted=1)])
            toks[i].append(batch.rows[0].tokens[0])
        rows[label], tokens[label], logprobs[label], times[label] = ids, toks, lps, []
    for _ in range(steps):
        for label, prog in (("eager", eager), ("graph", graph)):
            ids = rows[label]
            _sync(device)
            t0 = time.perf_counter()
            for sid in ids:
                assert prog.reserve_units(sid, 1)
            batch = prog.decode(ids)
            prog.commit(batch, [RowDecision(accepted=1)] * B)
            _sync(device)
            times[label].append((time.perf_counter() - t0) * 1e3)
            for i, row in enumerate(batch.rows):
                tokens[label][i].append(row.tokens[0])
                logprobs[label][i].append(row.logprobs[0])
    for label, prog in (("eager", eager), ("graph", graph)):
        for sid in rows[label]:
            prog.release(sid)
        if not prog.usage().all_free:
            raise AssertionError(f"{label} Program holds resources after release: {prog.usage()}")
    first_diff = None
    for i in range(B):
        for j, (a, b) in enumerate(zip(tokens["eager"][i], tokens["graph"][i], strict=True)):
            if a != b:
                first_diff = j if first_diff is None else min(first_diff, j)
                break
    # compare logprobs only up to the first divergence (afterwards the inputs differ)
    upto = first_diff if first_diff is not None else steps
    lp_diff = max((abs(a - b) for i in range(B) for a, b in
                   zip(logprobs["eager"][i][:upto], logprobs["graph"][i][:upto], strict=True)), default=0.0)
    return {"B": B, "tokens_equal": first_diff is None, "first_divergence_step": first_diff,
            "max_logprob_diff": lp_diff, "eager_ms": statistics.median(times["eager"][1:] or times["eager"]),
            "graph_ms": statistics.median(times["graph"][1:] or times["graph"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.8b", help="a shape from benchmarks/shapes.py (9b, 0.8b, 27b, tiny)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--context", type=int, default=48, help="prompt tokens per row (row b gets context + b)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    max_batch = max(args.batch)
    config, eager, graph = _programs(args.shape, args.device, dtype, max_batch=max_batch,
                                     max_len=args.context + max_batch + args.steps + 16)
    graphs_on = graph.graphs is not None
    state = f"captured for B=1..{max_batch}" if graphs_on else f"off ({graph.graph_error})"
    print(f"program_check shape={args.shape} device={args.device} dtype={args.dtype} graphs={state}")
    results = []
    with torch.inference_mode():
        for B in args.batch:
            r = check_batch(eager, graph, config, B, context=args.context, steps=args.steps, device=args.device)
            results.append(r)
            same = "equal" if r["tokens_equal"] else f"DIFFER from step {r['first_divergence_step']}"
            print(f"  B={B}: tokens {same}, max |dlogprob| {r['max_logprob_diff']:.2e}, step eager {r['eager_ms']:.2f} ms, "
                  f"graph {r['graph_ms']:.2f} ms")
    expect_graphs = args.device.startswith("cuda")
    ok = all(r["tokens_equal"] for r in results) and (graphs_on or not expect_graphs)
    summary = {"check": "program_graphs", "ok": ok, "shape": args.shape, "device": args.device, "dtype": args.dtype,
               "graphs": graphs_on, "graph_error": graph.graph_error, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
