"""Host time per decode step, broken down, through the static-buffer decode path (CPU-measurable).

The decode graphs replay a captured forward; everything around the replay is host work that the GPU
waits for. ``static_decode=True`` runs the graphs' exact input path (``DecodeGraphs.load`` into the
static buffers, then the forward over them, uncaptured), so on CPU every part but the model call is
the host work of a GPU step. Two views, per B:

- Program: ``reserve_units`` per row + ``Program.decode`` + ``Program.commit``, as the engine calls
  them; parts: reserve, load (stage inputs), model (the forward + logits; replaced by one graph
  replay on the GPU), sample (sampling and the one device->host sync of the tokens), decode_other
  (validation and reservation checks inside ``decode``), commit.
- Engine: the same B rows through ``ninfer.Engine``; per steady decode cycle (B rows, no prefill
  chunk): decode (as above), frontend (OutputSession preview + commit), program commit, publish
  (events to the handles), cycle_other (scheduler, permits, accounting) and loop (the worker loop
  between cycles: inbox, calls, KV usage read). Each handle's consumer blocks in ``result()`` and
  wakes on every event, as a streaming consumer does; ``--poll`` takes that thread off the GIL.

Every timed part goes through a wrapper (about 0.2 us per call), included in the figures.

``host`` = step total minus the model call. On CPU the forward evicts the caches the host code then
runs from, which inflates every part; ``--no-forward`` measures the same host path with warm caches,
as on the GPU where the forward is one graph launch: after one real forward per B, the replay
returns that forward's logits (a captured graph's output buffer) instead of recomputing them. Medians over the timed steps (the VM is shared: medians
are stable, means are not). ``load_ops`` counts the torch ops ``DecodeGraphs.load`` issues per step
(each one a launch or a copy on the GPU).

    python -m benchmarks.host_overhead --batch 1 8 --steps 300 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.decode_step import build_program


class Parts:
    """Accumulates perf_counter time per named part; ``wrap`` times one bound method under a name."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        acc = self.acc
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += clock() - t0

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()
        return out


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _median_us(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows) * 1e6


def _prefilled(program, config, B: int, context: int, seed: int) -> list[int]:
    from ninfer.contract.batch import RowDecision
    from ninfer.contract.prompt import PreparedPrompt
    from ninfer.contract.request import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(B):
        prompt = PreparedPrompt(token_ids=torch.randint(0, config.vocab_size, (context,), generator=gen).tolist())
        sid = program.open_sequence(prompt, SamplingParams(temperature=0.0))
        while program.input_remaining(sid):
            n = program.input_remaining(sid)
            assert program.reserve_units(sid, n)
            batch = program.prefill(sid, n)
            if batch is not None:
                program.commit(batch, [RowDecision(accepted=1)])
        seqs.append(sid)
    return seqs


def _instrument_program(program, parts: Parts, no_forward: bool = False) -> None:
    if no_forward:
        replay, out = program.graphs.replay, {}

        def replay_once(B: int):
            if B not in out:
                out[B] = replay(B).clone()
            return out[B]

        program.graphs.replay = replay_once
    parts.wrap(program.graphs, "load", "load")
    parts.wrap(program.graphs, "replay", "model")
    parts.wrap(program.sampler, "launch", "sample")
    parts.wrap(program.sampler, "wait", "sample")
    parts.wrap(program, "commit", "commit")
    parts.wrap(program, "reserve_units", "reserve")


_WRAPPED = ("decode", "launch_decode", "collect", "commit", "reserve_units")


def _unwrap_program(program) -> None:
    for attr in ("load", "replay"):
        vars(program.graphs).pop(attr, None)
    for attr in ("launch", "wait"):
        vars(program.sampler).pop(attr, None)
    for attr in _WRAPPED:
        vars(program).pop(attr, None)


def measure_program(program, config, B: int, *, context: int, steps: int, warmup: int = 20,
                    no_forward: bool = False) -> dict:
    from ninfer.contract.batch import RowDecision

    seqs = _prefilled(program, config, B, context, seed=B)
    parts = Parts()
    _instrument_program(program, parts, no_forward)
    parts.wrap(program, "decode", "decode")
    decisions = [RowDecision(accepted=1)] * B
    rows = []
    clock = time.perf_counter
    for i in range(warmup + steps):
        parts.take()
        t0 = clock()
        for sid in seqs:
            if not program.reserve_units(sid, 1):
                raise RuntimeError("KV pool too small for the benchmark")
        batch = program.decode(seqs)
        program.commit(batch, decisions)
        total = clock() - t0
        p = parts.take()
        if i >= warmup:
            p["total"] = total
            rows.append(p)
    # One more step under an op counter: what load issues (each op a launch or copy on the GPU).
    counter = _OpCounter()
    load = program.graphs.load
    for sid in seqs:
        program.reserve_units(sid, 1)

    def counted_load(*args, **kwargs):
        with counter:
            return load(*args, **kwargs)

    program.graphs.load = counted_load
    program.commit(program.decode(seqs), decisions)
    _unwrap_program(program)
    for sid in seqs:
        program.release(sid)
    out = {"batch": B, "steps": steps}
    for key in ("total", "reserve", "load", "model", "sample", "commit"):
        out[f"{key}_us"] = _median_us(rows, key)
    out["decode_other_us"] = statistics.median(
        r["decode"] - r["load"] - r["model"] - r["sample"] for r in rows) * 1e6
    out["host_us"] = statistics.median(r["total"] - r["model"] for r in rows) * 1e6
    out["load_ops"] = len(counter.ops)
    out["load_op_names"] = sorted(set(counter.ops))
    return out


def measure_engine(program, config, B: int, *, context: int, steps: int, warmup: int = 20,
                   no_forward: bool = False, poll: bool = False) -> dict:
    from ninfer.contract.model import ModelInstance
    from ninfer.contract.prompt import TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams
    from ninfer.contract.resources import FrontendResources
    from ninfer.engine.engine import Engine
    from ninfer.engine.request import RequestRecord
    from ninfer.models.common.qwen.frontend import QwenFrontend
    from ninfer.models.common.qwen.output_session import QwenOutputSession
    from ninfer_qwen35.testing.checkpoints import make_tokenizer_json

    frontend = QwenFrontend.from_resources(FrontendResources(tokenizer_json=make_tokenizer_json()[0],
                                                             embedding_vocab=config.vocab_size))
    inst = ModelInstance(architecture="qwen35", config=config, model=program.model, parameters=None,
                         frontend=frontend, program=program)
    parts = Parts()
    _instrument_program(program, parts, no_forward)
    saved = {a: QwenOutputSession.__dict__[a] for a in ("preview", "commit")}
    for a in saved:  # class-level: every request's session
        parts.wrap(QwenOutputSession, a, "frontend")
    publish = RequestRecord.__dict__["publish_output"]
    parts.wrap(RequestRecord, "publish_output", "publish")  # class-level: every request's publication
    cycles: list[dict[str, float]] = []
    gen = torch.Generator().manual_seed(100 + B)
    try:
        with Engine.from_instance(inst, max_concurrency=program.max_concurrency, device="cpu",
                                  prefill_chunk=context) as engine:
            core = engine._core
            requests = [GenerationRequest(
                input=TextInput(token_ids=tuple(torch.randint(0, config.vocab_size, (context,),
                                                              generator=gen).tolist())),
                sampling=SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True))
                for _ in range(B)]

            def instrument_and_submit() -> list:
                # On the worker between cycles (it owns the core), and every request submitted before the
                # next cycle: the B rows start together, so the steady B-row cycles do not depend on how
                # promptly this thread ran.
                _instrument_core(core, parts, cycles, B)
                return [engine.submit(r) for r in requests]

            handles = core.on_worker(instrument_and_submit)
            while poll and not all(h.done for h in handles):
                time.sleep(0.05)
            for h in handles:
                h.result()
    finally:
        for a, fn in saved.items():
            setattr(QwenOutputSession, a, fn)
        _unwrap_program(program)
        RequestRecord.publish_output = publish
    steady = cycles[warmup:warmup + steps]
    if not steady:
        raise RuntimeError("no steady decode cycles were recorded")
    out = {"batch": B, "steps": len(steady)}
    for key in ("step", "cycle", "decode", "load", "model", "sample", "frontend", "commit", "publish", "loop"):
        out[f"engine_{key}_us"] = _median_us(steady, key)
    out["engine_cycle_other_us"] = statistics.median(
        r["cycle"] - r["decode"] - r.get("frontend", 0.0) - r["commit"] - r.get("publish", 0.0) for r in steady) * 1e6
    out["engine_host_us"] = statistics.median(r["step"] - r["model"] for r in steady) * 1e6
    return out


def _instrument_core(core, parts: Parts, cycles: list, B: int) -> None:
    """Time every worker cycle; keep the ones that ran exactly one decode of B rows and no prefill chunk."""
    parts.wrap(core, "_run_prefill", "prefill")
    launch = core.program.launch_decode

    def counted_launch(ids, **kwargs):
        parts.acc["rows"] = len(ids)
        return launch(ids, **kwargs)

    core.program.launch_decode = counted_launch
    parts.wrap(core.program, "launch_decode", "decode")  # launch (maybe chained) + collect of the step before
    parts.wrap(core.program, "collect", "decode")
    cycle = core._cycle
    clock = time.perf_counter
    prev_end: list[float | None] = [None]

    def timed_cycle():
        parts.acc.clear()
        t0 = clock()
        out = cycle()
        t1 = clock()
        p = dict(parts.acc)
        if prev_end[0] is not None and "prefill" not in p and p.get("rows") == B:
            p.update(cycle=t1 - t0, loop=t0 - prev_end[0], step=t1 - prev_end[0])
            cycles.append(p)
        prev_end[0] = t1
        return out

    core._cycle = timed_cycle


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--context", type=int, default=32, help="prompt tokens per row before timing")
    ap.add_argument("--no-engine", action="store_true", help="only the Program view")
    ap.add_argument("--no-forward", action="store_true",
                    help="after one real forward per B, replay returns its logits (warm-cache host timing)")
    ap.add_argument("--poll", action="store_true",
                    help="engine consumers poll for the result instead of waking on every event (the worker's "
                         "own work without a woken consumer thread taking the GIL)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if not all(1 <= b <= 8 for b in args.batch) or args.steps < 1:
        print("host_overhead: --batch values must be in 1..8 and --steps >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    config, program = build_program("tiny", "cpu", max_batch=max(args.batch), context=args.context,
                                    steps=args.steps + 64, graphs=False, dtype=torch.float32, static_decode=True)
    rows = []
    print("# tiny shape on CPU through the static decode buffers; medians in us per step"
          + ("; forward run once per B (--no-forward)" if args.no_forward else "")
          + ("; consumers poll (--poll)" if args.poll else ""))
    hdr = f"{'B':>2} {'host':>7} {'reserve':>8} {'load':>7} {'decode_o':>9} {'sample':>7} {'commit':>7} " \
          f"{'model':>8} {'ops':>4}"
    if not args.no_engine:
        hdr += f" | {'e.host':>7} {'decode':>7} {'front':>6} {'commit':>7} {'publish':>8} {'cycle_o':>8} {'loop':>6}"
    print(hdr)
    for B in args.batch:
        r = measure_program(program, config, B, context=args.context, steps=args.steps,
                            no_forward=args.no_forward)
        line = (f"{B:>2} {r['host_us']:>7.1f} {r['reserve_us']:>8.1f} {r['load_us']:>7.1f} "
                f"{r['decode_other_us']:>9.1f} {r['sample_us']:>7.1f} {r['commit_us']:>7.1f} {r['model_us']:>8.1f} "
                f"{r['load_ops']:>4}")
        if not args.no_engine:
            e = measure_engine(program, config, B, context=args.context, steps=args.steps,
                               no_forward=args.no_forward, poll=args.poll)
            r.update(e)
            line += (f" | {e['engine_host_us']:>7.1f} {e['engine_decode_us'] - e['engine_model_us']:>7.1f} "
                     f"{e['engine_frontend_us']:>6.1f} {e['engine_commit_us']:>7.1f} {e['engine_publish_us']:>8.1f} "
                     f"{e['engine_cycle_other_us']:>8.1f} {e['engine_loop_us']:>6.1f}")
        rows.append(r)
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": "tiny", "device": "cpu", "context": args.context, "no_forward": args.no_forward,
                       "poll": args.poll, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
