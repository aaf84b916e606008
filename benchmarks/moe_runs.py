"""Timed units on a started MoE Program (Qwen3.5 MoE or Qwen4Exp), for benchmarks/moe.py: decode steps of B rows,
a prompt's prefill, the head a unit runs once whatever the depth, and the host experts' counters over a window.

Program-level, as benchmarks/programs.py times a step: ``reserve_units``, ``decode`` (or ``prefill``) and
``commit``, with the device synchronised around each timed unit.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from benchmarks.harness import sync
from benchmarks.profiling import profile_steps
from benchmarks.programs import prefill, timed_steps, warm_decode

clock = time.perf_counter


def _median_ms(fn, device: str, iters: int = 10) -> float:
    fn()
    times = []
    for _ in range(iters):
        sync(device)
        t = clock()
        fn()
        sync(device)
        times.append((clock() - t) * 1e3)
    return statistics.median(times)


# -- the Program, started as the engine starts it ---------------------------------------------------------

def on_instance(path: Path, options, fn):
    """``fn(instance)`` on the artifact's instance, built as the engine builds it (its architecture's Startup,
    ``ninfer.engine.startup.start``); the instance is dropped, then the artifact closed (its weights may borrow
    the artifact's mapping) and the device memory given back, before this returns ``fn``'s result."""
    import torch

    from benchmarks.harness import plugin_host
    from ninfer.artifact import open_artifact
    from ninfer.engine.startup import native_startup, start

    artifact = open_artifact(path, verify=False)
    try:
        instance = start(native_startup(artifact, plugin_host()), artifact, options)
        try:
            return fn(instance)
        finally:
            del instance
            gc.collect()  # Programs hold reference cycles (bound methods)
    finally:
        artifact.close()
        if options.device.startswith("cuda"):
            torch.cuda.empty_cache()


def head_ms(program, device: str, rows: int, tokens: int) -> float:
    """The part of a unit that does not grow with depth: embedding ``tokens`` ids, lm_head and argmax of ``rows``."""
    import torch
    import torch.nn.functional as F

    p = program.model.params
    ids = torch.randint(0, p.embed.shape[0], (tokens,), device=p.embed.device)
    hidden = torch.randn(rows, p.embed.shape[1], dtype=p.embed.dtype, device=p.embed.device)
    with torch.inference_mode():
        return _median_ms(lambda: (F.embedding(ids, p.embed), program.model.logits(hidden).argmax(-1)), device)


def once_ms(program, device: str, rows: int) -> float:
    """Median ms of what a ``rows``-row decode step runs once per forward, not per layer
    (``architectures.once_per_forward``; 0 where there is none), as the step runs it: replayed from a CUDA graph
    where the Program decodes through graphs, else eagerly (host experts or host tables)."""
    import torch

    from benchmarks.architectures import once_per_forward

    run = once_per_forward(program, rows)
    if run is None:
        return 0.0
    with torch.inference_mode():
        if program.graphs is None:
            return _median_ms(run, device)
        side = torch.cuda.Stream()  # warm up (Triton compiles) off the capture, as graph capture asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    return _median_ms(graph.replay, device)


def decode_run(program, config, device: str, B: int, context: int, steps: int, stats=None,
               profile: Path | None = None) -> dict:
    """Median ms of a B-row decode step (reserve + decode + commit) after ``context`` prompt tokens per row;
    ``stats()`` (the host experts' counters) is read around the timed steps. With ``profile``, as many steps
    again under torch.profiler after them (``profiling.profile_steps``; its table goes to that path)."""
    with warm_decode(program, config, B, context) as step:
        before = stats() if stats else None
        times = timed_steps(step, device, steps)
        after = stats() if stats else None
        profiled = profile_steps(step, device, steps, profile) if profile is not None else None
    ms = statistics.median(times)
    row = {"batch": B, "context": context, "steps": steps, "ms_per_step": ms, "ms_mean": statistics.mean(times),
           "tokens_per_s": B / ms * 1e3}
    if stats:
        row["experts"] = stats_delta(before, after)
    if profiled is not None:
        row["profile"] = profiled
    return row


def prefill_run(program, config, device: str, tokens: int, chunk: int, reps: int = 2) -> dict:
    """Seconds from a ``tokens``-token prompt to its first sampled token, in chunks of ``chunk``; best of ``reps``."""
    import torch

    from ninfer.contract.prompt import PreparedPrompt
    from ninfer.contract.request import SamplingParams

    g = torch.Generator().manual_seed(tokens)
    seconds = []
    for _ in range(reps):
        prompt = PreparedPrompt(token_ids=torch.randint(0, config.vocab_size, (tokens,), generator=g).tolist())
        sid = program.open_sequence(prompt, SamplingParams(temperature=0.0))
        try:
            sync(device)
            t = clock()
            prefill(program, sid, chunk)
            sync(device)
            seconds.append(clock() - t)
        finally:
            program.release(sid)
    best = min(seconds)
    return {"tokens": tokens, "chunk": chunk, "seconds": best, "seconds_all": seconds, "tokens_per_s": tokens / best}


def stats_delta(before, after) -> dict:
    """The host experts' counters over a window (ExpertStats is cumulative) and its cache hit rate."""
    import attrs

    a, b = attrs.asdict(before), attrs.asdict(after)
    d = {k: b[k] - a[k] for k in b}
    pairs = d["cache_hits"] + d["cache_misses"]
    return {**d, "hit_rate": d["cache_hits"] / pairs if pairs else None}




def host_read_bandwidth(device: str) -> float:
    """GB/s the host reads in a copy between two host buffers (1 GiB on a CUDA machine, 64 MiB on a CPU smoke run),
    all threads, best of 5: the rate at which the CPU team can read missed experts."""
    import torch

    n = (1 << 30 if device.startswith("cuda") else 64 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = clock()
        dst.copy_(src)
        best = min(best, clock() - t)
    return src.numel() * 4 / best / 1e9
