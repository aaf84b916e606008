"""The harness every benchmark shares: device set-up, random checkpoints in published naming and their artifacts,
requests through the public ``ninfer.Engine`` timed as their consumers receive each token, and the per-shape driver that
writes the table and the JSON. The device ceilings (copy rate, matmul rate, the kernel chain) are
``benchmarks/ceilings.py``; Program-level runs on random weights ``benchmarks/programs.py``.

A benchmark module keeps only what it measures; ``benchmarks.gpu`` runs them as suites.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
FP32 = ("A_log", "linear_attn.norm.weight")  # kept fp32 in published checkpoints

# Every figure is timed with this monotonic clock (seconds); the CPU smoke tests substitute a deterministic one.
clock = time.perf_counter


# -- small helpers ------------------------------------------------------------------------------------

def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def quantile(values: list[float], q: float) -> float | None:
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



def fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def target_lines(targets: dict) -> list[str]:
    """One line per target: what was measured and whether it met the target."""
    return [f"- target {k} >= {t['target']}: measured {fmt(t['measured'], '.2f')} -> "
            f"{'met' if t['met'] else 'NOT met' if t['met'] is not None else 'not measured'}"
            for k, t in targets.items()]



# -- packages and plugins -----------------------------------------------------------------------------


def import_paths() -> None:
    """Make the repository's packages importable where they are not installed (the GPU machine)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # `python benchmarks/X.py` as well as `-m`
    for pkg, mod in (("ninfer-core", "ninfer"), ("ninfer-qwen35", "ninfer_qwen35"),
                     ("ninfer-qwen4exp", "ninfer_qwen4exp"), ("ninfer-convert", "ninfer_convert")):
        try:
            __import__(mod)
        except ImportError:
            sys.path.insert(0, str(ROOT / pkg / "src"))


def plugin_host():
    from ninfer.plugins import UnknownArchitecture, make_plugin_host

    host = make_plugin_host()
    for arch, module, name in (("Qwen3_5ForCausalLM", "ninfer_qwen35.plugin", "qwen35"),
                               ("Qwen4ExpForCausalLM", "ninfer_qwen4exp.plugin", "qwen4exp")):
        try:
            host.architecture(arch)
        except UnknownArchitecture:  # no package metadata: register the plugin module directly
            import importlib

            host.register_module(importlib.import_module(module), name)
    return host


def _terminated(signum, frame):
    # A timeout's SIGTERM unwinds like an exception: each shape's ``finally`` removes its multi-GB workdir,
    # which the next run would otherwise find filling the disk.
    raise SystemExit(128 + signum)


def run_with_plugins(run, argv) -> int:
    """``run(argv)`` with SIGTERM unwinding and the Qwen3.5 plugin importable where no package metadata
    exists (the GPU machine); an in-process run (a smoke test) leaves the environment as it found it."""
    signal.signal(signal.SIGTERM, _terminated)
    import_paths()
    before = os.environ.get("NINFER_EXTRA_PLUGINS")
    extra = [m for m in (before or "").split(",") if m]
    missing = [m for m in ("ninfer_qwen35.plugin", "ninfer_qwen4exp.plugin") if m not in extra]
    if missing:
        os.environ["NINFER_EXTRA_PLUGINS"] = ",".join([*extra, *missing])
    try:
        return run(argv)
    finally:
        if before is None:
            os.environ.pop("NINFER_EXTRA_PLUGINS", None)
        else:
            os.environ["NINFER_EXTRA_PLUGINS"] = before



# -- random checkpoints ---------------------------------------------------------------------------------


def write_shards(directory: Path, tensors: Iterable[tuple[str, object]], *, shard_bytes: int = 2 * GIB) -> int:
    """Save ``(name, tensor)`` pairs (CPU tensors, made one at a time by the caller) into shards of about
    ``shard_bytes`` under the published names (``model-0000i-of-0000n.safetensors``) with their
    ``model.safetensors.index.json``; host memory holds one shard at most. Returns the tensor bytes written."""
    from safetensors.torch import save_file

    shard: dict = {}
    files: list[list[str]] = []  # the names each shard holds, in order
    size = total = 0

    def flush() -> None:
        save_file(shard, str(directory / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
        files.append(list(shard))
        shard.clear()

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, names in enumerate(files):  # the published shard names, now that their count is known
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (directory / f"part-{i:05d}.safetensors").rename(directory / final)
        weight_map.update(dict.fromkeys(names, final))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total



def write_source_files(directory: Path, config: dict) -> None:
    """A new checkpoint directory's files beside the weights: config.json, the small test tokenizer, its chat
    template and generation config."""
    from ninfer_qwen35.testing.checkpoints import CHAT_TEMPLATE, make_tokenizer_json

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tok, special = make_tokenizer_json()
    (directory / "tokenizer.json").write_text(tok)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [special["<|im_end|>"]]}))



def write_source(directory: Path, config: dict, device: str, shard_bytes: int = 4 * GIB) -> int:
    """A random checkpoint in published naming (flat text-only, std 0.02; A_log and the GDN norm in fp32, as
    published), seeded: the same shape always gets the same weights. The tensors are the architecture plugin's
    (``benchmarks.architectures.source_tensors``: Qwen3.5 or Qwen4Exp by the config's ``architectures``).
    Returns the tensor bytes written."""
    import torch

    from benchmarks.architectures import source_tensors

    # tensors are made on the device one at a time and a shard is written once full: host memory holds one shard
    write_source_files(directory, config)
    gen_device = "cuda" if device.startswith("cuda") else "cpu"
    g = torch.Generator(device=gen_device).manual_seed(0)
    params = source_tensors(config, ("text",))

    def tensors():
        for name, (shape, size) in params.items():
            dtype = torch.float32 if size == 4 else torch.bfloat16
            yield name, torch.randn(shape, generator=g, device=gen_device, dtype=torch.float32).mul_(0.02).to(dtype).cpu()

    return write_shards(directory, tensors(), shard_bytes=shard_bytes)


def artifact(shape: str, cfg: dict, device: str, workdir: Path, cache_dir: str | None, res: dict,
             keep_source: bool = False, quantize: str | None = None) -> Path:
    """The shape's artifact, converted from ``write_source``'s seeded checkpoint (in ``workdir/hf``, kept only with
    ``keep_source``), or reused from ``cache_dir`` and left there as SHAPE.ninfer for later runs. ``quantize``:
    ``ninfer convert --quantize``'s format (``fp8``, ``nvfp4``), the artifact then SHAPE-FORMAT.ninfer."""
    import shutil

    from ninfer_convert.convert import convert_checkpoint

    stem = f"{shape}-{quantize}" if quantize else shape
    cached = Path(cache_dir) / f"{stem}.ninfer" if cache_dir else None
    if cached is not None and cached.exists():  # the seeded random weights of an earlier run: the same model
        res["artifact_reused"] = str(cached)
        return cached
    src, out = workdir / "hf", workdir / f"{stem}.ninfer"
    t = clock()
    res["checkpoint_bytes"] = write_source(src, cfg, device)
    res["write_s"] = clock() - t
    res["convert_s"] = convert_checkpoint(src, out, host=plugin_host(), quantize=quantize).seconds
    if not keep_source:
        shutil.rmtree(src)
    if cached is None:
        return out
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(shutil.move(out, cached.with_suffix(".partial")))
    return partial.rename(cached)  # complete or absent: a killed run leaves no half artifact to reuse


# -- requests through the public Engine ------------------------------------------------------------------


def run_streams(engine, prompts: list[list[int]], max_tokens: int, on_steady=None, on_end=None,
                timeout: float = 600.0, session_key: str | None = None, constraint=None) -> list[dict]:
    """Submit every prompt at once (greedy, ignore_eos) and record when each token reaches its consumer.
    Returns per stream: submit time, token times, the final result.

    The prompts are submitted together (``ninfer.testing.scheduling.submit_together``: between two of the
    worker's cycles, so the scheduler sees all of them at once) and streamed to asyncio consumers as a server
    streams them; each token is timed by its consumer as its event arrives. What is measured is therefore the
    engine's schedule as a client of the public API sees it: a consumer that falls behind on a busy host would see
    tokens in bursts, which the steady window's per-stream rates average out (callers record the engine's own
    inter-token metric beside it as a check).

    ``on_steady()`` runs once every stream has its first token (all rows decode from then on), ``on_end()``
    once the first stream ends (the profiler's window); both on the consumers' thread. ``session_key``: every
    request's (a conversation's OpenAI ``prompt_cache_key``); ``constraint``: every request's
    (``ninfer.contract.constraint``)."""
    from ninfer.contract.events import FinishReason, GenerationResult, OutputDelta
    from ninfer.contract.prompt import TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams
    from ninfer.testing.scheduling import submit_together

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    hooks = {"steady": on_steady, "end": on_end}
    streams = [{"submitted": None, "times": []} for _ in prompts]
    started = [0]

    def fire(name: str) -> None:
        fn = hooks.pop(name, None)
        if fn is not None:
            fn()

    async def consume(handle, stream: dict) -> GenerationResult | None:  # the worker wakes it per event
        final = None
        async for event in handle:
            if isinstance(event, OutputDelta) and event.token_ids:
                if not stream["times"]:
                    started[0] += 1
                    if started[0] == len(prompts):
                        fire("steady")
                stream["times"].extend([clock()] * len(event.token_ids))
            elif isinstance(event, GenerationResult):
                final = event
                fire("end")
        return final

    async def consume_all(handles: list) -> list:
        try:  # a hang guard in real time, whatever ``clock`` is
            return await asyncio.wait_for(asyncio.gather(*(consume(h, s) for h, s in zip(handles, streams, strict=True))),
                                          timeout)
        except TimeoutError:
            raise TimeoutError(f"benchmark requests did not finish within {timeout} s") from None

    requests = [GenerationRequest(input=TextInput(token_ids=tuple(p)), sampling=sampling, session_key=session_key,
                                  constraint=constraint) for p in prompts]
    submitted = clock()
    for stream in streams:
        stream["submitted"] = submitted
    finals = asyncio.run(consume_all(submit_together(engine, requests)))
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
            "ttft_ms_median": quantile(ttft, 0.5) * 1e3, "ttft_ms_p90": quantile(ttft, 0.9) * 1e3,
            "itl_ms_median": quantile(gaps, 0.5) * 1e3, "itl_ms_p90": quantile(gaps, 0.9) * 1e3}


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def decode_tokens(steps: int, B: int, ctx: int, chunk: int) -> int:
    """max_tokens per request of a decode run: the timed steps plus one token per prefill chunk of the
    B prompts (the first rows decode while later rows prefill) plus the first token."""
    return steps + B * -(-ctx // chunk) + 2


def close_engine(engine) -> None:
    """Close the engine and its artifact; the caller drops its last reference, then reads ``device_left``."""
    engine.close()
    if engine.artifact is not None:
        engine.artifact.close()


def device_left(device: str) -> int | None:
    """Give freed device memory back and return the bytes still allocated on CUDA (None on the CPU)."""
    import torch

    gc.collect()  # the Program's tensors go with the engine's last references
    if not device.startswith("cuda"):
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


# -- the per-shape driver ------------------------------------------------------------------------------


def shape_benchmark_main(tool: str, argv, *, parse_args, validate, bench_shape, markdown, prepare=None) -> int:
    """The ``main`` a per-shape benchmark shares (``bench``, ``context_cache``): parse its arguments, check the
    ones every such benchmark has (``--batches``, ``--prefill-chunk``) and then its own (``validate``; a message:
    exit 2), then ``drive_shapes`` with the plugins importable."""
    def run(argv) -> int:
        args = parse_args(argv)
        if (err := _shared_problem(args) or validate(args)) is not None:
            print(f"{tool}: {err}", file=sys.stderr)
            return 2
        return drive_shapes(tool, args, bench_shape, markdown, prepare)

    return run_with_plugins(run, argv)


def _shared_problem(args) -> str | None:
    if not all(1 <= b <= 8 for b in args.batches):
        return "--batches values must be in 1..8 (the engine's max_concurrency range)"
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        return "--prefill-chunk must be >= 1"
    return None


def drive_shapes(tool: str, args, bench_shape, markdown, prepare=None) -> int:
    """Resolve the device and the prefill chunk, add ``prepare(args, device)`` (a dict: figures every shape shares)
    to the result, run ``bench_shape(shape, args, device, res)`` for each shape (one shape's failure keeps the
    others' figures), write the JSON after each, then print ``markdown(result)``."""
    import torch

    from ninfer.contract.config import default_prefill_chunk

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{tool}: no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    args.prefill_chunk = args.prefill_chunk or default_prefill_chunk(device)
    base = Path(args.workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    args.workdir = str(base)
    t0 = clock()
    result: dict = {"device": device_info(device), "args": dict(vars(args))}
    result.update(prepare(args, device) if prepare else {})
    result["shapes"] = {}
    failed = []
    for s in args.shape:
        print(f"# shape {s}", flush=True)
        res = result["shapes"][s] = {"shape": s}
        try:
            bench_shape(s, args, device, res)
        except Exception as exc:  # one shape's failure must not lose the others' figures
            traceback.print_exc()
            res["error"] = f"{type(exc).__name__}: {exc}"
            failed.append(s)
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        finally:  # keep what is measured even if a later shape fails or a timeout stops the run
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    result["wall_s"] = clock() - t0
    result["markdown"] = markdown(result)
    print(result["markdown"])
    print(f"\n# wall time {result['wall_s']:.1f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 1 if failed else 0

