"""The single performance harness: ceilings, the public ``ninfer.Engine`` and HF transformers, same run.

Per shape: random weights in published naming are written once as a Hugging Face checkpoint
(safetensors) and converted with the real converter; ``ninfer.Engine`` then runs on that artifact:

- decode tokens/s at B = 1, 2, 4, 8 concurrent requests for each context (random token-id prompts,
  greedy, ``ignore_eos``, all submitted between two engine cycles), timed as the engine publishes each
  token, only while all B rows decode (prefill excluded);
- prefill tokens/s and model-FLOP utilisation (model FLOPs over the measured bf16 matmul rate) for
  single prompts;
- TTFT and inter-token latency (median, p90) for the B concurrent streams of every decode run;
- peak device memory (``torch.cuda.max_memory_allocated``).

Ceilings from ``benchmarks/ceilings.py`` in the same run (copy bandwidth, bf16 matmul, the cuBLAS
matrix-vector chain over the shape's decode weights) and transformers ``generate`` on the written
checkpoint (``benchmarks/hf_baseline.py``) make every figure also a ratio.

    python -m benchmarks.bench --shape 0.8b 9b --quick --json out.json           # on the GPU machine
    python -m benchmarks.bench --shape tiny --device cpu --contexts 8 24 ...      # CPU smoke run (tested)

``--quick`` runs long contexts only at B=1 and the largest B, two prefill repetitions, and no 16k
prefill unless ``--prefill`` names it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.load_throughput import _host, _import_paths, write_source
from benchmarks.shapes import SHAPES, decode_weight_shapes

HF_MODEL_TYPE = "qwen3_5_text"  # lets transformers' AutoModel read the written config.json

# Every figure is timed with this monotonic clock (seconds); the CPU smoke test substitutes a deterministic one.
clock = time.perf_counter

# Issue 9 targets (9B shape, bf16, one H200; 0.8B decode B=1): checked and printed, never enforced.
TARGETS = {
    "9b": {"decode_b1_tokens_per_s": 185.0, "decode_b1_over_chain": 0.90, "decode_b8_tokens_per_s": 1450.0,
           "decode_b1_over_hf": 20.0, "prefill_4096_mfu": 0.50},
    "0.8b": {"decode_b1_tokens_per_s": 1000.0},
}


# -- small helpers ------------------------------------------------------------------------------------

def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (q in [0, 1]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def device_info(device: str) -> dict:
    import torch

    info = {"device": device, "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda"):
        info["name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["name"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


# -- model arithmetic ---------------------------------------------------------------------------------

def model_figures(cfg: dict) -> dict:
    """Parameters, decode bytes and the per-token / per-position FLOP terms of a config.json dict."""
    shapes = decode_weight_shapes(cfg)
    head = shapes[-1]
    layer_params = sum(o * i for o, i in shapes[:-1])
    n = cfg["num_hidden_layers"]
    n_full = sum(1 for i in range(n) if (i + 1) % cfg["full_attention_interval"] == 0)
    return {
        "layer_matmul_params": layer_params,
        "lm_head_params": head[0] * head[1],
        "embedding_params": cfg["vocab_size"] * cfg["hidden_size"],
        "decode_weight_bytes": 2 * (layer_params + head[0] * head[1]),
        "full_attention_layers": n_full,
        "gdn_layers": n - n_full,
    }


def prefill_flops(cfg: dict, tokens: int) -> float:
    """Model FLOPs of one prompt of ``tokens`` from position 0: 2 x matmul params x tokens for the layers,
    the lm_head once (only the last position is sampled), causal attention (QK^T and PV over the
    prefix) and the GDN recurrence (about 6 Dk*Dv per token and value head: read-out, delta, update)."""
    f = model_figures(cfg)
    attn = 2 * 2 * cfg["num_attention_heads"] * cfg["head_dim"] * tokens * (tokens + 1) / 2 * f["full_attention_layers"]
    gdn = 6 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * tokens \
        * f["gdn_layers"]
    return 2 * f["layer_matmul_params"] * tokens + 2 * f["lm_head_params"] + attn + gdn


def decode_bytes(cfg: dict, batch: int, context: int, dtype: str = "bfloat16") -> int:
    """Bytes one decode step must move: every decode weight once, each row's StateImage slot read and
    written, each row's KV prefix read."""
    from ninfer.core.kv_pool import PagedKVPool
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.state import kv_pools, state_layout

    config = parse_config(dict(cfg))
    state = state_layout(config, dtype).nbytes_per_slot
    pools = kv_pools(config, 16, dtype)
    kv_per_token = sum(PagedKVPool.page_bytes(p) for p in pools) // 16
    return model_figures(cfg)["decode_weight_bytes"] + batch * (2 * state + context * kv_per_token)


# -- ceilings -----------------------------------------------------------------------------------------

def _host_time_ms(fn, iters: int) -> float:
    for _ in range(2):  # first calls pay one-time library setup
        fn()
    times = []
    for _ in range(iters):
        t = clock()
        fn()
        times.append((clock() - t) * 1e3)
    return statistics.median(times)


def measure_ceilings(shapes: list[str], batches: list[int], device: str) -> dict:
    """Copy bandwidth, bf16 matmul rate and the matvec chain per shape (CUDA: ``benchmarks.ceilings``;
    CPU: the same quantities at small sizes, timed on the host, for the smoke run)."""
    import torch

    if device.startswith("cuda"):
        from benchmarks import ceilings

        res = {"copy_tb_s": ceilings.copy_bandwidth(), "matmul_tflops": ceilings.matmul_rate(),
               "matmul_dtype": "bfloat16", "chain_ms": {}}
        for s in shapes:
            res["chain_ms"][s] = {str(b): ms for b, ms in ceilings.matvec_chain(s, batches).items()}
        return res
    src = torch.empty(1 << 26, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    copy_ms = _host_time_ms(lambda: dst.copy_(src), 5)
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm_ms = _host_time_ms(lambda: a @ b, 5)
    res = {"copy_tb_s": 2 * src.numel() / (copy_ms * 1e-3) / 1e12, "matmul_tflops": 2 * n**3 / (mm_ms * 1e-3) / 1e12,
           "matmul_dtype": "float32", "chain_ms": {}}
    for s in shapes:
        weights = [torch.randn(o, i) * 0.02 for o, i in decode_weight_shapes(SHAPES[s])]
        res["chain_ms"][s] = {}
        for B in batches:
            xs = {w.shape[1]: torch.randn(B, w.shape[1]) for w in weights}
            res["chain_ms"][s][str(B)] = _host_time_ms(
                lambda xs=xs, ws=weights: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws], 3)
    return res


# -- running requests through the public Engine ---------------------------------------------------------

def run_streams(engine, prompts: list[list[int]], max_tokens: int, on_steady=None, on_end=None,
                timeout: float = 600.0, session_key: str | None = None, constraint=None) -> list[dict]:
    """Submit every prompt at once (greedy, ignore_eos) and record when the engine publishes each token.
    Returns per stream: submit time, token times, the final result.

    The prompts are submitted on the engine's worker between two of its cycles, so the scheduler sees
    all of them together, and each token is timed on the worker as it is published to its stream: the
    figures describe the engine's schedule, not how promptly this process's consumer thread ran (a
    consumer that falls behind on a busy host would see tokens in bursts and blur every window).

    ``on_steady()`` runs on the worker once every stream has its first token (all rows decode from then
    on), ``on_end()`` once the first stream ends (the profiler's window). ``session_key``: every request's
    (a conversation's OpenAI ``prompt_cache_key``); ``constraint``: every request's (``ninfer.contract.constraint``)."""
    from ninfer.contract.events import FinishReason, GenerationResult, OutputDelta
    from ninfer.contract.prompt import TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    hooks = {"steady": on_steady, "end": on_end}
    streams = [{"submitted": None, "times": []} for _ in prompts]
    started = [0]

    def fire(name: str) -> None:
        fn = hooks.pop(name, None)
        if fn is not None:
            fn()

    def timed(stream: dict, publish):
        def publish_timed(event) -> None:
            if isinstance(event, OutputDelta) and event.token_ids:
                if not stream["times"]:
                    started[0] += 1
                    if started[0] == len(prompts):
                        fire("steady")
                stream["times"].extend([clock()] * len(event.token_ids))
            elif isinstance(event, GenerationResult):
                fire("end")
            publish(event)
        return publish_timed

    def submit_all() -> list:  # on the worker: nothing is scheduled until every request is in
        handles = []
        for p, stream in zip(prompts, streams, strict=True):
            stream["submitted"] = clock()
            h = engine.submit(GenerationRequest(input=TextInput(token_ids=tuple(p)), sampling=sampling,
                                                session_key=session_key, constraint=constraint))
            channel = h._channel  # the worker publishes through it; timed before the worker's next cycle
            channel.publish = timed(stream, channel.publish)
            handles.append(h)
        return handles

    async def consume(handle) -> GenerationResult | None:  # streams as a server does: the worker wakes it
        final = None
        async for event in handle:
            if isinstance(event, GenerationResult):
                final = event
        return final

    async def consume_all(handles: list) -> list:
        try:  # a hang guard in real time, whatever ``clock`` is
            return await asyncio.wait_for(asyncio.gather(*(consume(h) for h in handles)), timeout)
        except TimeoutError:
            raise TimeoutError(f"benchmark requests did not finish within {timeout} s") from None

    finals = asyncio.run(consume_all(engine._core.on_worker(submit_all)))
    for stream, final in zip(streams, finals, strict=True):
        times = stream["times"]
        if final is None or final.finish_reason is not FinishReason.LENGTH or len(times) != max_tokens:
            reason = final.error if final is not None and final.error else (final and final.finish_reason)
            raise RuntimeError(f"benchmark request ended early: {reason} after {len(times)} of {max_tokens} tokens")
        stream["result"] = final
    return streams


def steady_decode(streams: list[dict]) -> dict:
    """Decode rate while every stream decodes: the window from the last stream's first token to the
    first stream's last token; per stream, tokens in the window over the time they span."""
    t0 = max(s["times"][0] for s in streams)
    t1 = min(s["times"][-1] for s in streams)
    rates, steps = [], []
    for s in streams:
        inside = [t for t in s["times"] if t0 <= t <= t1]
        if len(inside) < 3 or inside[-1] <= inside[0]:
            raise RuntimeError(f"too few tokens while all {len(streams)} rows decode ({len(inside)}); "
                               f"raise --steps")
        step = (inside[-1] - inside[0]) / (len(inside) - 1)
        steps.append(step)
        rates.append(1.0 / step)
    ttft = [s["times"][0] - s["submitted"] for s in streams]
    gaps = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:], strict=False)]
    return {"tokens_per_s": sum(rates), "ms_per_step": statistics.mean(steps) * 1e3,
            "window_s": t1 - t0, "window_steps": min(len([t for t in s["times"] if t0 <= t <= t1]) for s in streams),
            "ttft_ms_median": _quantile(ttft, 0.5) * 1e3, "ttft_ms_p90": _quantile(ttft, 0.9) * 1e3,
            "itl_ms_median": _quantile(gaps, 0.5) * 1e3, "itl_ms_p90": _quantile(gaps, 0.9) * 1e3}


def profile_decode(engine, vocab: int, B: int, ctx: int, steps: int, chunk: int, device: str,
                   path: Path | None) -> dict:
    """torch.profiler over the steady decode window of B rows: device-kernel time per step (CUDA) or
    host op time (CPU), the top entries, and the full table written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    # run_streams calls both hooks on the engine's worker (as it publishes): the profiler records the ops
    # of the thread that starts it, and the worker is the thread that runs the steps.
    streams = run_streams(engine, _prompts(vocab, B, ctx, 900 + B), decode_tokens(steps, B, ctx, chunk),
                          on_steady=prof.start, on_end=lambda: (_sync(device), prof.stop()))
    d = steady_decode(streams)
    events = prof.key_averages()
    # Per forward: the profiler's window (from the last first token to the first final result) and the
    # token window differ by a step or two, so divide by the decode graph launches it recorded when there
    # are any.
    launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    n = launches or d["window_steps"]
    if cuda:  # device-side entries only (kernels, copies): a CPU op's device time repeats its kernels'
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        key = "self_device_time_total"
    else:
        kernels = list(events)
        key = "self_cpu_time_total"
    kernels.sort(key=lambda e: getattr(e, key), reverse=True)
    busy_us = sum(getattr(e, key) for e in kernels) if cuda and kernels else None  # None: no kernel seen
    if path is not None:
        path.write_text(f"# decode B={B} context={ctx}: {d['window_steps']} token steps in the token window, "
                        f"{launches} graph launches in the profiler's, {d['ms_per_step']:.3f} ms/step "
                        f"under the profiler; per-step figures divide by {n}\n"
                        + events.table(sort_by=key, row_limit=60))
    return {"batch": B, "context": ctx, "window_steps": d["window_steps"], "forwards": n,
            "ms_per_step_profiled": d["ms_per_step"],
            "device_busy_ms_per_step": None if busy_us is None else busy_us / n / 1e3,
            "top": [{"name": e.key[:120], "ms_per_step": getattr(e, key) / n / 1e3, "calls_per_step": e.count / n}
                    for e in kernels[:20]]}


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def decode_tokens(steps: int, B: int, ctx: int, chunk: int) -> int:
    """max_tokens per request of a decode run: the timed steps plus one token per prefill chunk of the
    B prompts (the first rows decode while later rows prefill) plus the first token."""
    return steps + B * -(-ctx // chunk) + 2


def decode_plan(batches: list[int], contexts: list[int], quick: bool) -> list[tuple[int, int]]:
    """(B, context) pairs; --quick keeps longer contexts only at B=1 and the largest B."""
    pairs = []
    for i, ctx in enumerate(contexts):
        for B in batches:
            if quick and i > 0 and B not in (min(batches), max(batches)):
                continue
            pairs.append((B, ctx))
    return pairs


def bench_engine(artifact: Path, shape: str, cfg: dict, args, device: str, chain_ms: dict[str, float] | None) -> dict:
    import torch

    import ninfer

    B_max = max(args.batches)
    pairs = decode_plan(args.batches, args.contexts, args.quick)
    budgets = {(B, ctx): decode_tokens(args.steps, B, ctx, args.prefill_chunk) for B, ctx in pairs}
    warmup_len = args.prefill_chunk + 5  # one prompt just past a chunk: both prefill kernels compiled
    max_len = max([ctx + n for (_, ctx), n in budgets.items()] + [p + 1 for p in args.prefill]
                  + [warmup_len + 4]) + 1
    page_size = 16
    num_pages = B_max * -(-max_len // page_size) + 1
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    t = clock()
    engine = ninfer.Engine(artifact, max_concurrency=B_max, device=device, max_model_len=max_len,
                           prefill_chunk=args.prefill_chunk, page_size=page_size, num_pages=num_pages)
    _sync(device)
    res: dict = {"start_s": clock() - t, "max_model_len": max_len, "prefill_chunk": args.prefill_chunk,
                 "graphs": getattr(engine.instance.program, "graphs", None) is not None}
    import attrs

    res["memory"] = attrs.asdict(engine.memory)
    vocab = cfg["vocab_size"]
    try:
        t = clock()
        # Warm-up: Triton compilation for the chunk and decode shapes used below.
        run_streams(engine, _prompts(vocab, B_max, warmup_len, 1), 4)
        run_streams(engine, _prompts(vocab, 1, 7, 2), 4)
        res["warmup_s"] = clock() - t
        res["decode"] = []
        for i, (B, ctx) in enumerate(pairs):
            before = engine.metrics().inter_token
            streams = run_streams(engine, _prompts(vocab, B, ctx, 100 + i), budgets[(B, ctx)])
            after = engine.metrics().inter_token
            row = {"batch": B, "context": ctx, **steady_decode(streams),
                   "bytes_per_step": decode_bytes(cfg, B, ctx),
                   # the worker's own view (gaps between commits, prefill interleaving included): a check
                   # that the publish timestamps do not hide or add time
                   "engine_itl_ms_mean": (after.total - before.total) / max(after.count - before.count, 1) * 1e3}
            if chain_ms and str(B) in chain_ms:
                row["chain_ms"] = chain_ms[str(B)]
                row["over_chain"] = row["tokens_per_s"] / (B * 1e3 / chain_ms[str(B)])
            res["decode"].append(row)
            print(f"#   decode B={B} ctx={ctx}: {row['ms_per_step']:.3f} ms/step, {row['tokens_per_s']:.1f} tok/s",
                  flush=True)
        res["prefill"] = []
        for i, P in enumerate(args.prefill):
            ttfts = []
            for r in range(args.prefill_reps):
                (s,) = run_streams(engine, _prompts(vocab, 1, P, 500 + 10 * i + r), 1)
                ttfts.append(s["times"][0] - s["submitted"])
            best = min(ttfts)
            row = {"tokens": P, "seconds": best, "seconds_all": ttfts, "tokens_per_s": P / best,
                   "model_tflops": prefill_flops(cfg, P) / best / 1e12}
            res["prefill"].append(row)
            print(f"#   prefill {P}: {best:.4f} s, {row['tokens_per_s']:.0f} tok/s, {row['model_tflops']:.1f} TFLOP/s",
                  flush=True)
        if args.profile:  # last, and never fatal: the figures above stand without it
            res["profile"] = []
            for B in sorted({min(args.batches), B_max}):
                path = Path(args.profile) / f"profile-{shape}-b{B}.txt"
                try:
                    res["profile"].append(profile_decode(engine, vocab, B, args.contexts[0], args.steps,
                                                         args.prefill_chunk, device, path))
                except Exception as exc:
                    res["profile"].append({"batch": B, "context": args.contexts[0],
                                           "error": f"{type(exc).__name__}: {exc}"})
                    print(f"#   profile B={B} failed: {exc}", file=sys.stderr, flush=True)
                    break
                busy = res["profile"][-1]["device_busy_ms_per_step"]
                print(f"#   profiled B={B}: device busy {_f(busy, '.3f')} ms/step -> {path}", flush=True)
        m = engine.metrics()
        res["engine_metrics"] = {"preemptions": m.preemptions, "generated_tokens": m.generated_tokens,
                                 "prompt_tokens": m.prompt_tokens, "requests_finished": m.requests_finished}
        if device.startswith("cuda"):
            res["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    finally:
        left = close_engine(engine, device)
        del engine
        if left is not None:
            res["left_allocated_bytes"] = left
    return res


def close_engine(engine, device: str) -> int | None:
    """Close the engine and its artifact and give the device memory back; the bytes still allocated on CUDA."""
    import torch

    engine.close()
    if engine.artifact is not None:
        engine.artifact.close()
    engine.instance = engine._core = None  # the Program's tensors go with the last references
    gc.collect()
    if not device.startswith("cuda"):
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


# -- one shape end to end -------------------------------------------------------------------------------

def bench_shape(shape: str, args, device: str, ceilings: dict | None) -> dict:
    import torch

    from benchmarks import hf_baseline
    from ninfer_convert.convert import convert_checkpoint

    cfg = dict(SHAPES[shape], dtype="bfloat16", mtp_num_hidden_layers=0, model_type=HF_MODEL_TYPE)
    res: dict = {"shape": shape, "config": cfg, **model_figures(cfg)}
    workdir = Path(tempfile.mkdtemp(prefix=f"ninfer-bench-{shape}-", dir=args.workdir))
    src, out = workdir / "hf", workdir / f"{shape}.ninfer"
    cached = Path(args.artifact_cache) / f"{shape}.ninfer" if args.artifact_cache and not args.hf else None
    try:
        if cached is not None and cached.exists():  # the seeded random weights of an earlier run: the same model
            out = cached
            res["artifact_reused"] = str(cached)
        else:
            t = clock()
            res["checkpoint_bytes"] = write_source(src, cfg, device)
            res["write_s"] = clock() - t
            summary = convert_checkpoint(src, out, host=_host())
            res["convert_s"] = summary.seconds
            if not args.hf:  # only the baseline reads the checkpoint
                shutil.rmtree(src)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                out = Path(shutil.move(out, cached.with_suffix(".partial")))
                out = out.rename(cached)  # complete or absent: a killed run leaves no half artifact to reuse
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        chain = ceilings["chain_ms"].get(shape) if ceilings else None
        res["engine"] = bench_engine(out, shape, cfg, args, device, chain)
        if cached is None:
            out.unlink()
        if args.hf:
            try:
                res["hf"] = hf_baseline.run(src, device=device, prompt=args.hf_prompt, new_tokens=args.hf_new_tokens,
                                            batches=tuple(args.hf_batches), clock=clock)
            except Exception as exc:  # the baseline is a comparison, not the measurement: keep ours
                res["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"# {shape}: transformers baseline failed: {res['hf']['error']}", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["ratios"] = ratios(res, ceilings)
    if shape in TARGETS:
        res["targets"] = check_targets(TARGETS[shape], res["ratios"])
    return res


def ratios(res: dict, ceilings: dict | None) -> dict:
    """Ours over the ceilings and over transformers (the figures the targets name)."""
    out: dict = {}
    eng = res["engine"]
    first_ctx = eng["decode"][0]["context"] if eng["decode"] else None
    hf_rows = {r["batch"]: r for r in res.get("hf", {}).get("rows", [])}
    for row in eng["decode"]:
        if row["context"] != first_ctx:
            continue
        B = row["batch"]
        out[f"decode_b{B}_tokens_per_s"] = row["tokens_per_s"]
        if "over_chain" in row:
            out[f"decode_b{B}_over_chain"] = row["over_chain"]
        if B in hf_rows:
            out[f"decode_b{B}_over_hf"] = row["tokens_per_s"] / hf_rows[B]["decode_tokens_per_s"]
    if ceilings:
        for row in eng["prefill"]:
            out[f"prefill_{row['tokens']}_mfu"] = row["model_tflops"] / ceilings["matmul_tflops"]
    if 1 in hf_rows:
        for row in eng["prefill"]:
            if row["tokens"] == res["hf"]["prompt"]:
                out[f"prefill_{row['tokens']}_over_hf"] = row["tokens_per_s"] / hf_rows[1]["prefill_tokens_per_s"]
    return out


def check_targets(targets: dict, got: dict) -> dict:
    return {k: {"target": v, "measured": got.get(k), "met": None if got.get(k) is None else got[k] >= v}
            for k, v in targets.items()}


# -- report ---------------------------------------------------------------------------------------------

def _f(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def markdown(result: dict) -> str:
    ce = result.get("ceilings")
    lines = [f"# ninfer bench on {result['device']['name']} ({result['device']['device']}), "
             f"torch {result['device']['torch']}, triton {result['device']['triton']}"]
    if ce:
        lines.append(f"Ceilings: copy {ce['copy_tb_s']:.2f} TB/s, matmul ({ce['matmul_dtype']}) "
                     f"{ce['matmul_tflops']:.1f} TFLOP/s")
    for shape, r in result["shapes"].items():
        if "error" in r:
            lines += ["", f"## {shape}: FAILED: {r['error']}"]
            continue
        eng, hf = r["engine"], r.get("hf", {})
        hf_rows = {x["batch"]: x for x in hf.get("rows", [])}
        lines += ["", f"## {shape}: {(r['layer_matmul_params'] + r['lm_head_params']) / 1e9:.2f} B matmul parameters, "
                  f"decode reads {r['decode_weight_bytes'] / 1e9:.2f} GB of weights; engine start {eng['start_s']:.1f} s, "
                  f"CUDA graphs {eng['graphs']}", "",
                  "| B | context | ms/step | tokens/s | bytes floor ms | chain ms | ours/chain | HF tokens/s | ours/HF |"
                  " TTFT med / p90 ms | ITL med / p90 ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in eng["decode"]:
            floor = d["bytes_per_step"] / (ce["copy_tb_s"] * 1e12) * 1e3 if ce else None
            h = hf_rows.get(d["batch"])
            lines.append(
                f"| {d['batch']} | {d['context']} | {d['ms_per_step']:.3f} | {d['tokens_per_s']:.1f} | {_f(floor, '.3f')} "
                f"| {_f(d.get('chain_ms'), '.3f')} | {_f(d.get('over_chain'), '.2f')} "
                f"| {_f(h and h['decode_tokens_per_s'])} | {_f(h and d['tokens_per_s'] / h['decode_tokens_per_s'])} "
                f"| {d['ttft_ms_median']:.1f} / {d['ttft_ms_p90']:.1f} | {d['itl_ms_median']:.2f} / {d['itl_ms_p90']:.2f} |")
        lines += ["", "| prompt | prefill s | tokens/s | model TFLOP/s | MFU % | HF tokens/s (B=1) | ours/HF |",
                  "|---|---|---|---|---|---|---|"]
        for p in eng["prefill"]:
            mfu = p["model_tflops"] / ce["matmul_tflops"] * 100 if ce else None
            h = hf_rows.get(1) if hf.get("prompt") == p["tokens"] else None
            lines.append(f"| {p['tokens']} | {p['seconds']:.4f} | {p['tokens_per_s']:.0f} | {p['model_tflops']:.2f} "
                         f"| {_f(mfu)} | {_f(h and h['prefill_tokens_per_s'], '.0f')} "
                         f"| {_f(h and p['tokens_per_s'] / h['prefill_tokens_per_s'])} |")
        for pr in eng.get("profile", []):
            if "error" in pr:
                lines.append(f"\nProfile B={pr['batch']} failed: {pr['error']}")
                continue
            same = [d for d in eng["decode"] if (d["batch"], d["context"]) == (pr["batch"], pr["context"])]
            busy = pr["device_busy_ms_per_step"]
            gap = same[0]["ms_per_step"] - busy if same and busy is not None else None
            lines.append(f"\nProfile B={pr['batch']} context {pr['context']}: device busy {_f(busy, '.3f')} ms/step, "
                         f"idle (host) {_f(gap, '.3f')} ms/step; top: " + ", ".join(
                             f"{t['name'][:48]} {t['ms_per_step']:.3f}" for t in pr["top"][:6]))
        if "peak_memory_bytes" in eng:
            lines.append(f"\nPeak device memory {eng['peak_memory_bytes'] / 2**30:.2f} GiB "
                         f"(KV pool sized for the runs: {eng.get('plan', {}).get('kv_pages', '?')} pages)")
        if "error" in hf:
            lines.append(f"\ntransformers baseline failed: {hf['error']}")
        elif hf:
            lines.append(f"\ntransformers {hf['transformers']} (fla {hf['fla']}), {hf['prompt']}-token prompt, "
                         f"{hf['new_tokens']} new tokens: " + ", ".join(
                             f"B={x['batch']} {x['decode_ms_per_step']:.1f} ms/step" for x in hf["rows"]))
        lines += target_lines(r.get("targets", {}))
    return "\n".join(lines)


def target_lines(targets: dict) -> list[str]:
    """One line per target: what was measured and whether it met the target."""
    return [f"- target {k} >= {t['target']}: measured {_f(t['measured'], '.2f')} -> "
            f"{'met' if t['met'] else 'NOT met' if t['met'] is not None else 'not measured'}"
            for k, t in targets.items()]


# -- entry point ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["9b"], choices=sorted(SHAPES))
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and long contexts at B=1 and max B only")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192], help="decode context lengths")
    p.add_argument("--steps", type=int, default=None, help="decode steps timed per run (default 128, quick 48)")
    p.add_argument("--prefill", type=int, nargs="+", default=None,
                   help="prefill prompt lengths (default 512 4096 16384, quick 512 4096)")
    p.add_argument("--prefill-reps", type=int, default=None, help="repetitions per prompt, best kept (3, quick 2)")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="the engine's prefill chunk (a 4k prompt in one)")
    p.add_argument("--hf-prompt", type=int, default=512)
    p.add_argument("--hf-new-tokens", type=int, default=64)
    p.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baseline")
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile the steady decode window at the smallest and largest B (torch.profiler); "
                        "tables go to DIR/profile-SHAPE-bB.txt")
    p.add_argument("--workdir", default=None, help="folder for the checkpoint and artifact (default: temp dir)")
    p.add_argument("--artifact-cache", default=None, metavar="DIR",
                   help="keep each shape's artifact in DIR and reuse it in later runs (not with the HF baseline, "
                        "which reads the checkpoint)")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    args.steps = args.steps or (48 if args.quick else 128)
    args.prefill = args.prefill or ([512, 4096] if args.quick else [512, 4096, 16384])
    args.prefill_reps = args.prefill_reps or (2 if args.quick else 3)
    return args


def _validate(args) -> str | None:
    if not all(1 <= b <= 8 for b in args.batches):
        return "--batches values must be in 1..8 (the engine's max_concurrency range)"
    for name in ("contexts", "prefill", "hf_batches"):
        if min(getattr(args, name)) < 1:
            return f"--{name.replace('_', '-')} values must be >= 1"
    if args.steps < 3 or args.prefill_reps < 1 or args.prefill_chunk < 1 or args.hf_prompt < 1:
        return "--steps must be >= 3; --prefill-reps, --prefill-chunk and --hf-prompt >= 1"
    if args.hf_new_tokens < 2:
        return "--hf-new-tokens must be >= 2"
    return None


def _terminated(signum, frame):
    # A timeout's SIGTERM unwinds like an exception: each shape's ``finally`` removes its multi-GB workdir,
    # which the next run would otherwise find filling the disk.
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    return run_with_plugins(_run, argv)


def run_with_plugins(run, argv) -> int:
    """``run(argv)`` with SIGTERM unwinding and the Qwen3.5 plugin importable where no package metadata
    exists (the GPU machine); an in-process run (a smoke test) leaves the environment as it found it."""
    signal.signal(signal.SIGTERM, _terminated)
    _import_paths()
    before = os.environ.get("NINFER_EXTRA_PLUGINS")
    extra = [m for m in (before or "").split(",") if m]
    if "ninfer_qwen35.plugin" not in extra:
        os.environ["NINFER_EXTRA_PLUGINS"] = ",".join([*extra, "ninfer_qwen35.plugin"])
    try:
        return run(argv)
    finally:
        if before is None:
            os.environ.pop("NINFER_EXTRA_PLUGINS", None)
        else:
            os.environ["NINFER_EXTRA_PLUGINS"] = before


def _run(argv) -> int:
    args = parse_args(argv)
    if (err := _validate(args)) is not None:
        print(f"bench: {err}", file=sys.stderr)
        return 2
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("bench: no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    base = Path(args.workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    args.workdir = str(base)
    for s in args.shape:  # source + artifact coexist until the engine ran
        if args.artifact_cache and not args.hf and (Path(args.artifact_cache) / f"{s}.ninfer").exists():
            continue
        need = 2.05 * 2 * sum(model_figures(SHAPES[s])[k] for k in ("layer_matmul_params", "lm_head_params",
                                                                      "embedding_params"))
        if shutil.disk_usage(base).free < need:
            print(f"bench: {base} has {shutil.disk_usage(base).free / 1e9:.1f} GB free, shape {s} needs about "
                  f"{need / 1e9:.1f} GB; pass --workdir", file=sys.stderr)
            return 2
    t0 = clock()
    result: dict = {"device": device_info(device), "args": {k: v for k, v in vars(args).items()}}
    if args.ceilings:
        print("# ceilings", flush=True)
        result["ceilings"] = measure_ceilings(args.shape, sorted(set(args.batches)), device)
    result["shapes"] = {}
    failed = []
    for s in args.shape:
        print(f"# shape {s}", flush=True)
        try:
            result["shapes"][s] = bench_shape(s, args, device, result.get("ceilings"))
        except Exception as exc:  # one shape's failure must not lose the others' figures
            traceback.print_exc()
            result["shapes"][s] = {"shape": s, "error": f"{type(exc).__name__}: {exc}"}
            failed.append(s)
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        if args.json:  # keep what is measured even if a later shape fails
            Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    result["wall_s"] = clock() - t0
    print(markdown(result))
    print(f"\n# wall time {result['wall_s']:.1f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
