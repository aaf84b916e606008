"""Decode step time at B = 1..8 through the real Qwen3.5 Program (random weights, no checkpoint needed).

Each step is what the engine runs per cycle for B decode-ready rows: ``reserve_units`` per row, one
``Program.decode`` of exactly B rows (CUDA graph replay on GPU unless --eager), and ``Program.commit``
of every row's token. Sequences first prefill ``--context`` random prompt tokens.

    python -m benchmarks.decode_step --shape 9b --device cuda --batch 1 2 3 4 5 6 7 8 [--eager] [--engine] [--json out.json]
    python -m benchmarks.decode_step --shape tiny --device cpu --steps 3       # smoke run (the test uses it)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time

import torch

from benchmarks import chain_profile
from benchmarks.shapes import SHAPES


def random_parameters(shape: str | dict, device: str, dtype: torch.dtype, seed: int = 0):
    """Qwen35Parameters with random weights of a published shape (a ``SHAPES`` name or a config.json dict), made
    directly on ``device``: no checkpoint, so a model too large for the disk still fits the device."""
    from ninfer.models.common.weights import WeightSet
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.execution.parameters import Qwen35Parameters
    from ninfer_qwen35.source_mapping import expected_parameters, fused_parents

    config = parse_config(dict(SHAPES[shape] if isinstance(shape, str) else shape))
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, (_, dims) in expected_parameters(config, ("text",)).items():
        if name.endswith("A_log"):
            t = torch.empty(dims, device=device, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("dt_bias"):
            t = torch.zeros(dims, device=device, dtype=torch.float32)
        elif len(dims) == 1:
            t = torch.ones(dims, device=device, dtype=dtype)  # norm scales: timing only needs finite values
        else:
            t = torch.randn(dims, device=device, dtype=dtype, generator=gen) * (1.0 / math.sqrt(dims[-1]))
        tensors[name] = t
    weights = WeightSet.from_tensors(tensors, fused_parents(config))
    del tensors
    return config, Qwen35Parameters.from_weights(config, weights, dtype)


def auto_pdl(params, device: str) -> bool:
    """What a start chooses for these weights: ``device_plan`` asks ``prefers_pdl`` with the all-device
    placement's decode reads per layer, here from the Qwen3.5 startup's own placements of ``params``."""
    if not device.startswith("cuda"):
        return False
    from ninfer.core.device_plan import resident_bytes
    from ninfer.ops.launch import prefers_pdl
    from ninfer_qwen35.startup import _placements

    config, weights = params
    banks = weights.expert_banks()
    top_k = config.moe.num_experts_per_tok if config.moe is not None else 0
    everything = _placements(resident_bytes(weights.tensors()), resident_bytes(banks), banks, top_k)[0]
    return prefers_pdl(everything.step_read_bytes / config.num_hidden_layers)


def build_program(shape: str | dict, device: str, *, max_batch: int, context: int, steps: int, graphs: bool,
                  dtype: torch.dtype, static_decode: bool = False, params=None, pdl: bool = False):
    """A Qwen3.5 Program over random weights of ``shape``, or over ``params`` (config, Qwen35Parameters) made
    before, so several Programs can share one set of weights."""
    from ninfer_qwen35.execution.model import Qwen35Model
    from ninfer_qwen35.program.program import Qwen35Program
    from ninfer_qwen35.state import kv_pools, state_layout

    config, params = params or random_parameters(shape, device, dtype)
    pool = kv_pools(config, 16, "bfloat16" if dtype == torch.bfloat16 else "float32")[0]
    pages_per_seq = -(-(context + steps + 8) // pool.page_size)
    return config, Qwen35Program(
        Qwen35Model(params), state_layout=state_layout(config, "bfloat16" if dtype == torch.bfloat16 else "float32"),
        kv_pool=pool, device=device, max_concurrency=max_batch, num_pages=max_batch * pages_per_seq,
        vocab_size=config.vocab_size, max_model_len=context + steps + 8, cuda_graphs=graphs,
        static_decode=static_decode, pdl=pdl)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prefilled_sequences(program, config, B: int, context: int) -> list[int]:
    """B greedy sequences opened on ``program``, each with ``context`` random prompt tokens prefilled."""
    from ninfer.contract.batch import RowDecision
    from ninfer.contract.prompt import PreparedPrompt
    from ninfer.contract.request import SamplingParams

    gen = torch.Generator().manual_seed(B)
    seqs = []
    for _ in range(B):
        prompt = PreparedPrompt(token_ids=torch.randint(0, config.vocab_size, (context,), generator=gen).tolist())
        sid = program.open_sequence(prompt, SamplingParams(temperature=0.0))
        while program.input_remaining(sid):
            n = min(512, program.input_remaining(sid))
            assert program.reserve_units(sid, n)
            batch = program.prefill(sid, n)
            if batch is not None:
                program.commit(batch, [RowDecision(accepted=1)])
        seqs.append(sid)
    return seqs


def measure(program, config, device: str, B: int, *, context: int, steps: int, warmup: int = 3) -> dict:
    """Median and mean ms per decode step (reserve + decode + commit) for B rows at ~``context`` tokens."""
    from ninfer.contract.batch import RowDecision

    seqs = prefilled_sequences(program, config, B, context)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        for sid in seqs:
            if not program.reserve_units(sid, 1):
                raise RuntimeError("KV pool too small for the benchmark")
        batch = program.decode(seqs)
        program.commit(batch, [RowDecision(accepted=1)] * B)
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    graph_ms = replay_ms(program, B, steps) if program.graphs is not None and device.startswith("cuda") else None
    for sid in seqs:
        program.release(sid)
    times.sort()
    med = times[len(times) // 2]
    return {"batch": B, "ms_median": med, "ms_mean": sum(times) / len(times), "tokens_per_s": B / med * 1e3,
            "graphs": program.graphs is not None, "graph_ms": graph_ms}


def replay_ms(program, B: int, replays: int) -> float:
    """Device ms per replay of the B graph alone, back to back over the last step's inputs (no staging, no
    sampling, no readback): what a step costs without anything around the graph. The replays rewrite the rows'
    last KV position and advance their recurrent state; the caller releases the rows after."""
    program.graphs.replay(B)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        program.graphs.replay(B)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def measure_engine(program, config, device: str, B: int, *, context: int, steps: int, chain: bool = False) -> dict:
    """The same B rows through ``ninfer.Engine`` (scheduler, PendingBatch commit, Frontend, events): the mean
    inter-token gap per request, i.e. the engine's cycle time with B decode rows. The B requests are admitted
    together, so the first rows' early gaps include the other prompts' prefill chunks: the figure is taken over
    the steady part only (every row has its first token, none has finished), and over the whole run when that
    part is empty (``engine_steady`` says which). ``chain``: the steady part runs under a device trace and the
    result also has ``chain``, its per-kernel chain advances per step (``benchmarks.chain_profile``)."""

    from ninfer.contract.events import OutputDelta
    from ninfer.contract.model import ModelInstance
    from ninfer.contract.prompt import TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams
    from ninfer.contract.resources import FrontendResources
    from ninfer.engine.engine import Engine
    from ninfer.models.common.qwen.frontend import QwenFrontend
    from ninfer_qwen35.testing.checkpoints import make_tokenizer_json

    frontend = QwenFrontend.from_resources(FrontendResources(tokenizer_json=make_tokenizer_json()[0],
                                                             embedding_vocab=config.vocab_size))
    inst = ModelInstance(architecture="qwen35", config=config, model=program.model, parameters=None,
                         frontend=frontend, program=program)
    gen = torch.Generator().manual_seed(100 + B)
    with Engine.from_instance(inst, max_concurrency=program.max_concurrency, device=device,
                              prefill_chunk=512) as engine:
        handles = [engine.submit(GenerationRequest(
            input=TextInput(token_ids=tuple(torch.randint(0, config.vocab_size, (context,), generator=gen).tolist())),
            sampling=SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))) for _ in range(B)]
        waiting = set(range(B))
        while waiting:  # until every row has its first token (or has ended)
            for i in list(waiting):
                try:
                    event = handles[i].next_event(timeout=0.001)
                except TimeoutError:
                    continue
                if event is None or isinstance(event, OutputDelta) and event.token_ids:
                    waiting.discard(i)
        before = engine.metrics().inter_token
        with chain_profile.trace() if chain else contextlib.nullcontext([]) as events:
            while not any(h.done for h in handles):
                time.sleep(0.0005)
            after = engine.metrics().inter_token
        for h in handles:
            h.result()
        whole = engine.metrics().inter_token
    count, total = after.count - before.count, after.total - before.total
    steady = count > 0
    gap = (total / count if steady else whole.total / whole.count) * 1e3
    res = {"batch": B, "engine_ms_per_step": gap, "engine_tokens_per_s": B / gap * 1e3, "engine_steady": steady,
           "engine_ms_whole_run": whole.total / whole.count * 1e3}
    if chain and steady:
        res["chain"] = chain_profile.table(chain_profile.advances(events), max(1, count // B))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--context", type=int, default=512, help="prompt tokens prefilled per row before timing")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="weights/activations (default bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--engine", action="store_true",
                    help="also run the B rows through ninfer.Engine (mean inter-token gap per request)")
    ap.add_argument("--pdl", default="auto", choices=["auto", "on", "off"],
                    help="programmatic dependent launch: the model's own choice (auto) or forced")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if not all(1 <= b <= 8 for b in args.batch):
        print("decode_step: --batch values must be in 1..8", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    t0 = time.perf_counter()
    params = random_parameters(args.shape, args.device, dtype)
    pdl = auto_pdl(params, args.device) if args.pdl == "auto" else args.pdl == "on"
    config, program = build_program(args.shape, args.device, max_batch=max(args.batch), context=args.context,
                                    steps=args.steps + 3, graphs=not args.eager, dtype=dtype, params=params,
                                    pdl=pdl)
    print(f"# {args.shape} on {args.device} ({dtype}), context {args.context}, {args.steps} steps, PDL {pdl}; "
          f"built in {time.perf_counter() - t0:.1f} s; graphs: {program.graphs is not None}"
          + (f" ({program.graph_error})" if getattr(program, "graph_error", None) else ""), flush=True)
    print(f"{'B':>2} {'ms/step':>9} {'mean':>9} {'tok/s':>9}" + (f" {'engine ms':>10} {'engine tok/s':>12}"
                                                                  if args.engine else ""))
    rows = []
    for B in args.batch:
        r = measure(program, config, args.device, B, context=args.context, steps=args.steps)
        line = f"{B:>2} {r['ms_median']:>9.3f} {r['ms_mean']:>9.3f} {r['tokens_per_s']:>9.1f}"
        if args.engine:
            r.update(measure_engine(program, config, args.device, B, context=args.context, steps=args.steps))
            line += f" {r['engine_ms_per_step']:>10.3f} {r['engine_tokens_per_s']:>12.1f}"
        rows.append(r)
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "device": args.device, "dtype": str(dtype), "context": args.context,
                       "pdl": pdl, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
