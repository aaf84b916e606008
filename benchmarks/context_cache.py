"""The ``cache`` suite: the context cache through the public ``ninfer.Engine``, cache on against cache off, same run.

Per shape, random weights are written and converted once (``benchmarks/bench.py``'s checkpoint, the same
``--artifact-cache``), then one engine at a time is built, measured, checked and closed:

- ``on`` / ``off`` (default grid, ``max(--batches)`` rows):
  1. multi-turn TTFT: turn 1 is a ``--history``-token random prompt answered with ``--answer`` greedy tokens,
     turn 2 that prompt + the answer + ``--new`` tokens; turn 2's TTFT on (restored) and off (a full
     prefill), its ``cached_tokens``, and whether both turns' outputs match token for token (the off
     engine's turn 2 is built from the on engine's turn 1, so both see the same prompt);
  2. an identical prompt submitted twice: the second's TTFT (a hit) against the first's (a miss);
  3. the miss cost: the first submission's TTFT on against off (with the cache the prompt's last token
     runs as the first decode step, and checkpoints are saved at the grid points and the prompt's end);
  4. steady decode tokens/s at each B of ``--batches`` (``--context``-token prompts), on against off;
- ``grid-G`` for each ``--grids`` value (``none``: the prompt's end only), one row: a fresh prompt's TTFT,
  and a prompt sharing its first ``--share`` of the tokens (what the grid makes restorable);
- ``host`` (one checkpoint slot): turn 1, then another prompt whose save takes the slot (turn 1's
  checkpoints go to host replicas, where the CostModel finds them worth one), then turn 2 restored from
  the host against the cache-off full prefill; turn 2's own save evicts the other prompt's checkpoint
  first, as it would in service, and that is inside its TTFT.

Calibration for the ResourceManager's ``CostModel`` (``ninfer.engine.context_cache.retention``): prefill
seconds per token (cache-off miss TTFT over its tokens) and pinned host->device seconds per byte (a copy of
a ``--history``-token checkpoint's host replica size), printed next to its defaults; the StateImage bytes
per checkpoint slot and the time of one device copy of them (what a save copies).

Every engine warms up first (kernel compilation, one full-size conversation); after each measurement its
``usage().idle`` is checked, the cache cleared and ``usage().all_free`` checked: ``leak_free`` says all held.

    scripts/gpu cache                                                                             # GPU
    python -m benchmarks.context_cache --shape tiny --device cpu --history 96 --context 24 ...    # CPU smoke
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from benchmarks.bench import HF_MODEL_TYPE
from benchmarks.context_cache_report import markdown, summarize
from benchmarks.harness import (
    decode_tokens,
    prompts,
    run_streams,
    steady_decode,
    sync,
)
from benchmarks.shapes import SHAPES

PAGE = 16
# -- the engines -----------------------------------------------------------------------------------------

def _sizes(args, rows: int) -> tuple[int, int]:
    """(max_model_len, num_pages) for an engine of ``rows`` concurrent requests: room for the longest run's
    live sequence and its cached copy at once, with room to spare (the cache is cleared between runs):
    no run may reclaim the cache under pressure, which would time evictions."""
    conv = args.history + 2 * args.answer + args.new + 2
    decode = args.context + decode_tokens(args.steps, max(args.batches), args.context, args.prefill_chunk)
    warm = args.prefill_chunk + 16
    max_len = max(conv, decode, warm) + 1
    tokens = max(conv, rows * decode, rows * warm)
    return max_len, 3 * -(-tokens // PAGE) + 8 * rows


def with_engine(artifact: Path, device: str, args, body, *, cache: bool, rows: int, grid: int | None = None,
                slots: int | None = None) -> dict:
    """Build one engine, run ``body(engine) -> dict`` on it, record its plan, metrics and leak checks, and
    free it completely before returning (two large engines never coexist)."""
    import attrs

    import ninfer
    from ninfer.contract.config import EngineConfig

    max_len, pages = _sizes(args, rows)
    config = EngineConfig(max_concurrency=rows, device=device, max_model_len=max_len, prefill_chunk=args.prefill_chunk,
                          page_size=PAGE, num_pages=pages, context_cache=cache, checkpoint_grid=grid,
                          checkpoint_slots=slots if cache else None, dtype=args.dtype)
    t = harness.clock()
    engine = ninfer.Engine(artifact, config=config)
    sync(device)
    rec: dict = {"cache": cache, "rows": rows, "grid": grid, "start_s": harness.clock() - t, "checks": []}
    try:
        rec["memory"] = attrs.asdict(engine.instance.memory)
        rec["image_bytes"] = engine.instance.program.states.image_bytes
        rec["replica_bytes"] = engine.instance.program.checkpoints.host_bytes(args.history)
        t = harness.clock()
        warm_up(engine, args, rec["checks"])
        rec["warmup_s"] = harness.clock() - t
        rec.update(body(engine, rec["checks"]))
        m = engine.metrics()
        rec["metrics"] = {"prefix_cache_queries": m.prefix_cache_queries, "prefix_cache_hits": m.prefix_cache_hits,
                          "checkpoints": m.checkpoints, "checkpoint_device_bytes": m.checkpoint_device_bytes,
                          "checkpoint_host_bytes": m.checkpoint_host_bytes, "cache_evictions": m.cache_evictions,
                          "preemptions": m.preemptions}
        settle(engine, rec["checks"])
        rec["leak_free"] = all(c["idle"] and c["all_free"] for c in rec["checks"])
    finally:
        harness.close_engine(engine)
        del engine
        harness.device_left(device)
    return rec


def settle(engine, checks: list) -> None:
    """After a run: nothing but the cache holds anything; after clearing it, nothing at all."""
    idle = engine.usage().idle
    engine.clear_context_cache()
    checks.append({"idle": idle, "all_free": engine.usage().all_free})


def warm_up(engine, args, checks: list) -> None:
    """Kernel compilation for every shape the runs use, as bench.py does, then one untimed full-size
    conversation (a restore and the short prefill after it); the cache is cleared after."""
    vocab = engine.instance.program.vocab_size
    rows = engine.max_concurrency
    run_streams(engine, prompts(vocab, rows, args.prefill_chunk + 5, 1), 4)
    run_streams(engine, prompts(vocab, 1, 7, 2), 4)
    conversation(engine, args, 3)
    settle(engine, checks)


def ttft(stream: dict) -> float:
    return stream["times"][0] - stream["submitted"]


def conversation(engine, args, seed: int, turn2_prompt: list[int] | None = None) -> dict:
    """Turn 1 (``--history`` tokens, ``--answer`` generated), then turn 2 (``turn2_prompt``, else the
    history + the answer + ``--new`` tokens)."""
    vocab = engine.instance.program.vocab_size
    history = prompts(vocab, 1, args.history, seed)[0]
    (t1,) = run_streams(engine, [history], args.answer)
    turn1 = list(t1["result"].token_ids)
    if turn2_prompt is None:
        turn2_prompt = history + turn1 + prompts(vocab, 1, args.new, seed + 1)[0]
    (t2,) = run_streams(engine, [turn2_prompt], args.answer)
    return {"turn1_ttft_s": ttft(t1), "turn1_tokens": turn1, "turn2_ttft_s": ttft(t2),
            "turn2_cached_tokens": t2["result"].usage.cached_tokens, "turn2_tokens": list(t2["result"].token_ids),
            "_turn2_prompt": turn2_prompt}


# -- measurements --------------------------------------------------------------------------------------

def measure_main(engine, checks: list, args, turn2_prompts: list | None) -> dict:
    """Multi-turn TTFT, the repeated prompt (hit and miss), decode at each B; cleared after each run."""
    vocab = engine.instance.program.vocab_size
    out: dict = {"conversations": [], "repeats": [], "decode": []}
    for r in range(args.reps):
        c = conversation(engine, args, 1000 + 10 * r, turn2_prompts[r] if turn2_prompts else None)
        settle(engine, checks)
        out["conversations"].append(c)
    for r in range(args.reps):
        p = prompts(vocab, 1, args.history, 3000 + r)
        (first,) = run_streams(engine, p, 2)
        (second,) = run_streams(engine, p, 2)
        settle(engine, checks)
        out["repeats"].append({"first_ttft_s": ttft(first), "second_ttft_s": ttft(second),
                               "first_cached_tokens": first["result"].usage.cached_tokens,
                               "second_cached_tokens": second["result"].usage.cached_tokens})
    for B in args.batches:
        best = None
        for r in range(args.decode_reps):
            streams = run_streams(engine, prompts(vocab, B, args.context, 4000 + 10 * B + r),
                                  decode_tokens(args.steps, B, args.context, args.prefill_chunk))
            settle(engine, checks)
            d = steady_decode(streams)
            best = d if best is None or d["tokens_per_s"] > best["tokens_per_s"] else best
        out["decode"].append({"batch": B, "context": args.context, **best})
        print(f"#   decode B={B}: {best['tokens_per_s']:.1f} tok/s", flush=True)
    return out


def measure_grid(engine, checks: list, args) -> dict:
    """A fresh prompt's TTFT (checkpoints at the grid and its end), then a prompt sharing its first
    ``--share`` of the tokens: what the grid lets it restore."""
    vocab = engine.instance.program.vocab_size
    share = int(args.history * args.share)
    fresh, shared, cached = [], [], []
    for r in range(args.reps):
        p = prompts(vocab, 1, args.history, 5000 + r)[0]
        (s,) = run_streams(engine, [p], 2)
        fresh.append(ttft(s))
        (s,) = run_streams(engine, [p[:share] + prompts(vocab, 1, args.history - share, 6000 + r)[0]], 2)
        shared.append(ttft(s))
        cached.append(s["result"].usage.cached_tokens)
        settle(engine, checks)
    return {"ttft_s_all": fresh, "ttft_s": statistics.median(fresh), "share_tokens": share,
            "share_ttft_s": statistics.median(shared),
            "share_cached_tokens": cached[0], "share_cached_all": cached}


def measure_host(engine, checks: list, args) -> dict:
    """Turn 1, another prompt whose saves take the only device slot, then turn 2 from a host replica. The
    conversation has a session key (a chat client's prompt_cache_key): its continuation is worth a host copy."""
    vocab = engine.instance.program.vocab_size
    runs = []
    for r in range(args.reps):
        evicted = engine.metrics().cache_evictions.get("host", 0)
        history = prompts(vocab, 1, args.history, 1000 + 10 * r)[0]
        (t1,) = run_streams(engine, [history], args.answer, session_key=f"host-{r}")
        turn1 = list(t1["result"].token_ids)
        run_streams(engine, prompts(vocab, 1, min(64, args.history), 7000 + r), 2)
        prompt2 = history + turn1 + prompts(vocab, 1, args.new, 1000 + 10 * r + 1)[0]
        m = engine.metrics()
        (t2,) = run_streams(engine, [prompt2], args.answer, session_key=f"host-{r}")
        settle(engine, checks)
        demoted, cached = m.cache_evictions.get("host", 0) - evicted, t2["result"].usage.cached_tokens
        # turn 1's checkpoint was demoted to the host (the other prompt took the device slot) and turn 2 reused
        # it: the restore read the host replica
        source = None if not cached else "host" if demoted else "device"
        runs.append({"ttft_s": ttft(t2), "cached_tokens": cached, "restored_from": source,
                     "host_evictions": demoted, "checkpoint_host_bytes": m.checkpoint_host_bytes,
                     "turn1_tokens": turn1, "turn2_tokens": list(t2["result"].token_ids), "_turn2_prompt": prompt2})
    return {"runs": runs}


def copy_seconds(nbytes: int, device: str, *, from_host: bool, reps: int = 5) -> float:
    """Best time of one copy of ``nbytes`` into device memory: from pinned host memory, or device to device
    (CUDA events); on the CPU a host copy on the harness clock."""
    import torch

    cuda = device.startswith("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if cuda and from_host else \
        torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):  # the first copy pays one-time setup
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t = harness.clock()
            dst.copy_(src)
            times.append(harness.clock() - t)
    return min(times[1:])


# -- one shape end to end ---------------------------------------------------------------------------------

def run_engines(path: Path, args, device: str, engines: dict) -> None:
    """Each engine in turn; ``engines`` keeps what finished if a later one fails or the run is stopped."""
    rows = max(args.batches)
    print("#   engine on", flush=True)
    engines["on"] = with_engine(path, device, args, lambda e, c: measure_main(e, c, args, None), cache=True, rows=rows)
    prompts = [c.pop("_turn2_prompt") for c in engines["on"]["conversations"]]
    print("#   engine off", flush=True)
    engines["off"] = with_engine(path, device, args, lambda e, c: measure_main(e, c, args, prompts), cache=False,
                                 rows=rows)
    for c in engines["off"]["conversations"]:
        c.pop("_turn2_prompt")
    for g in args.grids:
        grid = args.history if g is None else g
        print(f"#   engine grid {g or 'none'}", flush=True)
        engines[f"grid-{g or 'none'}"] = with_engine(
            path, device, args, lambda e, c: measure_grid(e, c, args), cache=True, rows=1, grid=grid,
            slots=2 * (-(-args.history // grid) + 2) + 4)  # every grid point and the next prompt's: no eviction
    if args.host:
        print("#   engine host (one checkpoint slot)", flush=True)
        engines["host"] = with_engine(path, device, args, lambda e, c: measure_host(e, c, args), cache=True, rows=1,
                                      slots=1)
        for run, prompt in zip(engines["host"]["runs"], prompts, strict=False):
            run["same_prompt_as_off"] = run.pop("_turn2_prompt") == prompt


def bench_shape(shape: str, args, device: str, res: dict) -> None:
    """Fills ``res`` as it goes (a failure or a timeout keeps the engines measured so far)."""
    res.update(history=args.history, answer=args.answer, new=args.new, prefill_chunk=args.prefill_chunk, engines={})
    workdir = Path(tempfile.mkdtemp(prefix=f"ninfer-cache-{shape}-", dir=args.workdir))
    try:
        cfg = dict(SHAPES[shape], dtype="bfloat16", mtp_num_hidden_layers=0, model_type=HF_MODEL_TYPE)
        path = harness.artifact(shape, cfg, device, workdir, args.artifact_cache, res)  # bench's model
        run_engines(path, args, device, res["engines"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    on = res["engines"]["on"]
    res["calibration"] = calibrate(on["image_bytes"], on["replica_bytes"], res["engines"]["off"], args, device)
    res.update(summarize(res["engines"], args))


def calibrate(image_bytes: int, replica_bytes: int, off: dict, args, device: str) -> dict:
    """The CostModel's two rates as this device has them, beside its defaults (no engine alive)."""
    from ninfer.engine.context_cache.retention import CostModel

    h2d = copy_seconds(replica_bytes, device, from_host=True)
    miss = statistics.median(r["first_ttft_s"] for r in off["repeats"])
    defaults = CostModel()
    return {"image_bytes": image_bytes, "image_copy_s": copy_seconds(image_bytes, device, from_host=False),
            "replica_bytes": replica_bytes, "replica_h2d_s": h2d, "h2d_bytes_per_s": replica_bytes / h2d,
            "transfer_s_per_byte": h2d / replica_bytes, "recompute_s_per_token": miss / args.history,
            "pinned": device.startswith("cuda"),
            "cost_model_defaults": {"recompute_s_per_token": defaults.recompute_s_per_token,
                                    "transfer_s_per_byte": defaults.transfer_s_per_byte}}


# -- entry point ----------------------------------------------------------------------------------------

def _grid(text: str) -> int | None:
    if text == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a grid is a token count or 'none', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a grid must be >= 1 token, got {value}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["9b"], choices=sorted(SHAPES))
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--history", type=int, default=8192, help="turn 1's prompt tokens (and every fresh prompt's)")
    p.add_argument("--answer", type=int, default=64, help="tokens generated per turn")
    p.add_argument("--new", type=int, default=32, help="turn 2's tokens beyond turn 1 and its answer")
    p.add_argument("--reps", type=int, default=3, help="conversations / prompt pairs per measurement (medians)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode rows compared on / off")
    p.add_argument("--context", type=int, default=1024, help="decode prompt tokens")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per run")
    p.add_argument("--decode-reps", type=int, default=2, help="decode runs per B, best kept")
    p.add_argument("--grids", type=_grid, nargs="*", default=[512, 1024, 2048, None],
                   help="checkpoint grids measured ('none': the prompt's end only); none given: no grid engines")
    p.add_argument("--share", type=float, default=0.7, help="fraction of a prompt the grid run's second prompt shares")
    p.add_argument("--no-host", dest="host", action="store_false", help="skip the host-replica restore")
    p.add_argument("--prefill-chunk", type=int, default=None, help="the engine's prefill chunk (default: the device's)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: the artifact's, bfloat16)")
    p.add_argument("--workdir", default=None, help="folder for the checkpoint and artifact (default: temp dir)")
    p.add_argument("--artifact-cache", default=None, metavar="DIR",
                   help="keep each shape's artifact in DIR and reuse it (shared with bench.py)")
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def _validate(args) -> str | None:
    """What is wrong with this benchmark's own arguments (harness.shape_benchmark_main checks --batches and --prefill-chunk)."""
    if args.history < 2 or args.answer < 1 or args.new < 1 or args.context < 1:
        return "--history must be >= 2; --answer, --new and --context >= 1"
    if args.steps < 3 or args.reps < 1 or args.decode_reps < 1:
        return "--steps must be >= 3; --reps and --decode-reps >= 1"
    if not 0 < args.share < 1:
        return "--share must be between 0 and 1"
    return None


def main(argv=None) -> int:
    return harness.shape_benchmark_main("context_cache", argv, parse_args=parse_args, validate=_validate,
                                       bench_shape=bench_shape, markdown=markdown)


if __name__ == "__main__":
    sys.exit(main())
