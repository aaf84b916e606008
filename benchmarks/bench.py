"""The ``bench`` suite: decode and prefill of the public ``ninfer.Engine`` beside the device ceilings and HF
transformers, same run.

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

    scripts/gpu bench                                                              # on the GPU machine
    python -m benchmarks.bench --shape tiny --device cpu --contexts 8 24 ...      # CPU smoke run (tested)

``--quick`` runs long contexts only at B=1 and the largest B, two prefill repetitions, and no 16k
prefill unless ``--prefill`` names it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks import ceilings as device_ceilings
from benchmarks import harness
from benchmarks.harness import (
    close_engine,
    decode_tokens,
    fmt,
    prompts,
    run_streams,
    steady_decode,
    sync,
    target_lines,
)
from benchmarks.profiling import kernel_profile
from benchmarks.shapes import SHAPES, decode_bytes, decode_weight_bytes, model_figures, prefill_flops

HF_MODEL_TYPE = "qwen3_5_text"  # lets transformers' AutoModel read the written config.json

# Targets (9B shape, bf16, one H200; 0.8B decode B=1): checked and printed, never enforced.
TARGETS = {
    "9b": {"decode_b1_tokens_per_s": 185.0, "decode_b1_over_chain": 0.90, "decode_b8_tokens_per_s": 1450.0,
           "decode_b1_over_hf": 20.0, "prefill_4096_mfu": 0.50},
    "0.8b": {"decode_b1_tokens_per_s": 1000.0},
}


# -- the Engine's figures ---------------------------------------------------------

def profile_decode(engine, vocab: int, B: int, ctx: int, steps: int, chunk: int, device: str,
                   path: Path | None) -> dict:
    """torch.profiler over the steady decode window of B rows: device-kernel time per step (CUDA) or
    host op time (CPU), the top entries, and the full table written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    # run_streams calls both hooks as the consumers see the window open and close; the device's kernels are
    # recorded whichever thread launched them.
    streams = run_streams(engine, prompts(vocab, B, ctx, 900 + B), decode_tokens(steps, B, ctx, chunk),
                          on_steady=prof.start, on_end=lambda: (sync(device), prof.stop()))
    d = steady_decode(streams)
    # Per forward: the profiler's window (from the last first token to the first final result) and the
    # token window differ by a step or two, so divide by the decode graph launches it recorded when there
    # are any.
    launches = sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")
    n = launches or d["window_steps"]
    title = (f"decode B={B} context={ctx}: {d['window_steps']} token steps in the token window, {launches} graph "
             f"launches in the profiler's, {d['ms_per_step']:.3f} ms/step under the profiler")
    return {"batch": B, "context": ctx, "window_steps": d["window_steps"], "ms_per_step_profiled": d["ms_per_step"],
            **kernel_profile(prof, n, cuda, path, title)}


def decode_plan(batches: list[int], contexts: list[int], quick: bool) -> list[tuple[int, int]]:
    """(B, context) pairs; --quick keeps longer contexts only at B=1 and the largest B."""
    pairs = []
    for i, ctx in enumerate(contexts):
        for B in batches:
            if quick and i > 0 and B not in (min(batches), max(batches)):
                continue
            pairs.append((B, ctx))
    return pairs


def bench_engine(artifact: Path, shape: str, cfg: dict, args, device: str, chain_ms: dict[str, float] | None,
                 weight_bytes: int) -> dict:
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
    t = harness.clock()
    engine = ninfer.Engine(artifact, ninfer.EngineConfig(
        max_concurrency=B_max, device=device, max_model_len=max_len, prefill_chunk=args.prefill_chunk,
        page_size=page_size, num_pages=num_pages))
    sync(device)
    res: dict = {"start_s": harness.clock() - t, "max_model_len": max_len, "prefill_chunk": args.prefill_chunk,
                 "graphs": engine.instance.program.graphs is not None}
    import attrs

    res["memory"] = attrs.asdict(engine.memory)
    vocab = cfg["vocab_size"]
    try:
        t = harness.clock()
        # Warm-up: Triton compilation for the chunk and decode shapes used below.
        run_streams(engine, prompts(vocab, B_max, warmup_len, 1), 4)
        run_streams(engine, prompts(vocab, 1, 7, 2), 4)
        res["warmup_s"] = harness.clock() - t
        res["decode"] = []
        for i, (B, ctx) in enumerate(pairs):
            before = engine.metrics().inter_token
            streams = run_streams(engine, prompts(vocab, B, ctx, 100 + i), budgets[(B, ctx)])
            after = engine.metrics().inter_token
            row = {"batch": B, "context": ctx, **steady_decode(streams),
                   "bytes_per_step": decode_bytes(cfg, B, ctx, weight_bytes=weight_bytes),
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
                (s,) = run_streams(engine, prompts(vocab, 1, P, 500 + 10 * i + r), 1)
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
                print(f"#   profiled B={B}: device busy {fmt(busy, '.3f')} ms/step -> {path}", flush=True)
        m = engine.metrics()
        res["engine_metrics"] = {"preemptions": m.preemptions, "generated_tokens": m.generated_tokens,
                                 "prompt_tokens": m.prompt_tokens, "requests_finished": m.requests_finished}
        if device.startswith("cuda"):
            res["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    finally:
        close_engine(engine)
        del engine
        left = harness.device_left(device)
        if left is not None:
            res["left_allocated_bytes"] = left
    return res


# -- one shape end to end -------------------------------------------------------------------------------

def bench_shape(shape: str, args, device: str, ceilings: dict | None) -> dict:
    import torch

    from benchmarks import hf_baseline

    cfg = dict(SHAPES[shape], dtype="bfloat16", mtp_num_hidden_layers=0, model_type=HF_MODEL_TYPE)
    res: dict = {"shape": shape, "config": cfg, **model_figures(cfg)}
    workdir = Path(tempfile.mkdtemp(prefix=f"ninfer-bench-{shape}-", dir=args.workdir))
    cache_dir = None if args.hf else args.artifact_cache  # the baseline reads the checkpoint: convert it afresh
    try:
        out = harness.artifact(shape, cfg, device, workdir, cache_dir, res, keep_source=args.hf,
                               quantize=args.quantize)
        if args.quantize:  # the bytes floor of what the quantized artifact stores
            res["quantize"] = args.quantize
            res["decode_weight_bytes"] = decode_weight_bytes(out, cfg.get("tie_word_embeddings", False))
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        chain = ceilings["chain_ms"].get(shape) if ceilings else None
        res["engine"] = bench_engine(out, shape, cfg, args, device, chain, res["decode_weight_bytes"])
        if cache_dir is None:
            out.unlink()
        if args.hf:
            try:
                res["hf"] = hf_baseline.run(workdir / "hf", device=device, prompt=args.hf_prompt, new_tokens=args.hf_new_tokens,
                                            batches=tuple(args.hf_batches), clock=harness.clock)
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
                f"| {d['batch']} | {d['context']} | {d['ms_per_step']:.3f} | {d['tokens_per_s']:.1f} | {fmt(floor, '.3f')} "
                f"| {fmt(d.get('chain_ms'), '.3f')} | {fmt(d.get('over_chain'), '.2f')} "
                f"| {fmt(h and h['decode_tokens_per_s'])} | {fmt(h and d['tokens_per_s'] / h['decode_tokens_per_s'])} "
                f"| {d['ttft_ms_median']:.1f} / {d['ttft_ms_p90']:.1f} | {d['itl_ms_median']:.2f} / {d['itl_ms_p90']:.2f} |")
        lines += ["", "| prompt | prefill s | tokens/s | model TFLOP/s | MFU % | HF tokens/s (B=1) | ours/HF |",
                  "|---|---|---|---|---|---|---|"]
        for p in eng["prefill"]:
            mfu = p["model_tflops"] / ce["matmul_tflops"] * 100 if ce else None
            h = hf_rows.get(1) if hf.get("prompt") == p["tokens"] else None
            lines.append(f"| {p['tokens']} | {p['seconds']:.4f} | {p['tokens_per_s']:.0f} | {p['model_tflops']:.2f} "
                         f"| {fmt(mfu)} | {fmt(h and h['prefill_tokens_per_s'], '.0f')} "
                         f"| {fmt(h and p['tokens_per_s'] / h['prefill_tokens_per_s'])} |")
        for pr in eng.get("profile", []):
            if "error" in pr:
                lines.append(f"\nProfile B={pr['batch']} failed: {pr['error']}")
                continue
            same = [d for d in eng["decode"] if (d["batch"], d["context"]) == (pr["batch"], pr["context"])]
            busy = pr["device_busy_ms_per_step"]
            gap = same[0]["ms_per_step"] - busy if same and busy is not None else None
            lines.append(f"\nProfile B={pr['batch']} context {pr['context']}: device busy {fmt(busy, '.3f')} ms/step, "
                         f"idle (host) {fmt(gap, '.3f')} ms/step; top: " + ", ".join(
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
    p.add_argument("--quantize", choices=("fp8", "nvfp4"), default=None,
                   help="convert the random checkpoint with ninfer convert --quantize (the bytes floor follows)")
    args = p.parse_args(argv)
    args.steps = args.steps or (48 if args.quick else 128)
    args.prefill = args.prefill or ([512, 4096] if args.quick else [512, 4096, 16384])
    args.prefill_reps = args.prefill_reps or (2 if args.quick else 3)
    return args


def _validate(args) -> str | None:
    """This benchmark's own arguments (the harness checks --batches and --prefill-chunk), and room on the disk."""
    for name in ("contexts", "prefill", "hf_batches"):
        if min(getattr(args, name)) < 1:
            return f"--{name.replace('_', '-')} values must be >= 1"
    if args.steps < 3 or args.prefill_reps < 1 or args.hf_prompt < 1:
        return "--steps must be >= 3; --prefill-reps and --hf-prompt >= 1"
    if args.hf_new_tokens < 2:
        return "--hf-new-tokens must be >= 2"
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    base = Path(args.workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    for s in args.shape:  # source + artifact coexist until the engine ran
        if args.artifact_cache and not args.hf and (Path(args.artifact_cache) / f"{s}.ninfer").exists():
            continue
        need = 2.05 * 2 * sum(model_figures(SHAPES[s])[k] for k in ("layer_matmul_params", "lm_head_params",
                                                                      "embedding_params"))
        if shutil.disk_usage(base).free < need:
            return f"{base} has {shutil.disk_usage(base).free / 1e9:.1f} GB free, shape {s} needs about " \
                   f"{need / 1e9:.1f} GB; pass --workdir"
    return None


def main(argv=None) -> int:
    ceilings: dict = {}

    def measure_ceilings(args, device: str) -> dict:
        if not args.ceilings:
            return {}
        print("# ceilings", flush=True)
        ceilings.update(device_ceilings.measure(args.shape, sorted(set(args.batches)), device))
        return {"ceilings": ceilings}

    def one_shape(shape: str, args, device: str, res: dict) -> None:
        res.update(bench_shape(shape, args, device, ceilings or None))

    return harness.shape_benchmark_main("bench", argv, parse_args=parse_args, validate=_validate,
                                        bench_shape=one_shape, markdown=markdown, prepare=measure_ceilings)


if __name__ == "__main__":
    sys.exit(main())
