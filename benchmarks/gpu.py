"""The device suites, one subcommand each: ``scripts/gpu SUITE [OPTIONS]`` on the GPU machine (``scripts/gpu`` installs
the carried wheels and runs ``python3 -m benchmarks.gpu``). Each suite runs its benchmark modules in fresh processes,
prints their tables and writes logs and JSON to ``$OUT`` (the device tool's folder) or ``.gpu-out/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ninfer-core/src", "ninfer-qwen35/src", "ninfer-qwen4exp/src", "ninfer-convert/src", "ninfer-serve/src",
            "examples/ninfer-qwen3/src")  # scripts/gpu puts the same folders on PYTHONPATH
FLA_SITE = "/tmp/fla"  # scripts/gpu installs fla-core here, on its own path (the training run leaves it out)


def out_dir() -> Path:
    out = Path(os.environ.get("OUT") or ROOT / ".gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def tree_env(tree: Path, drop: tuple[str, ...] = ()) -> dict:
    """The environment with ``tree``'s packages first on PYTHONPATH, instead of this checkout's."""
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not p.startswith(str(ROOT)) and p not in drop]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*(str(tree / p) for p in PACKAGES), str(tree), *keep])}


_RUNNING: list[subprocess.Popen] = []  # the steps under way: a SIGTERM to this process stops them first
GRACE_S = 30.0  # how long a stopped step may unwind (a benchmark removes its multi-GB workdir) before SIGKILL


def run(args, name: str, cmd: list[str], *, cwd: Path = ROOT, env: dict | None = None, timeout: float | None = None
        ) -> int:
    """Run one step, its output to the console and to OUT/NAME.log; with ``--dry-run``, only print it. The step is
    a process group of its own: past ``timeout`` seconds (or when this process is terminated) the whole group is
    stopped, pytest's workers and a benchmark's children too, so nothing of it runs on into the next step."""
    print(f"$ {' '.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    with open(out_dir() / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        _RUNNING.append(proc)
        expired = threading.Event()
        timer = threading.Timer(timeout, lambda: (expired.set(), stop(proc))) if timeout is not None else None
        try:
            if timer is not None:
                timer.daemon = True
                timer.start()
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            _RUNNING.remove(proc)
            _signal_group(proc, signal.SIGKILL)  # what the step left behind
    if expired.is_set():
        print(f"# {name}: stopped after {timeout:g} s", flush=True)
        return 124
    return rc


def stop(proc: subprocess.Popen, grace: float = GRACE_S) -> None:
    """SIGTERM to the step's process group, so each process unwinds; SIGKILL to whatever is left after ``grace``."""
    _signal_group(proc, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _terminated(signum, frame):
    for proc in list(_RUNNING):
        stop(proc)
    raise SystemExit(128 + signum)


def module(name: str, *argv) -> list[str]:
    return [sys.executable, "-m", f"benchmarks.{name}", *map(str, argv)]


# -- the suites ----------------------------------------------------------------------------------------------------

def tests(args) -> int:
    # tests/clients drives third-party client libraries against a CPU server: none of it is marked gpu, and the
    # device carries only the OpenAI client (scripts/device-wheels)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", f"--timeout={args.timeout:g}",
           "--durations=15", "--ignore=tests/clients"]
    return run(args, "tests", [*cmd, *args.extra])  # no paths: every test folder (pyproject's testpaths)


def bench_argv(args, json_path: Path, tree: Path) -> list[str]:
    """The bench command for ``tree``: its own suite when it has one, else its ``benchmarks.bench --quick``."""
    if (tree / "benchmarks" / "gpu.py").exists():
        argv = ["bench", "--shapes", ",".join(args.shapes), "--batches", ",".join(map(str, args.batches)),
                "--json", str(json_path)]
        for flag, values in (("--contexts", args.contexts), ("--prefill", args.prefill)):
            argv += [flag, *map(str, values)] if values else []
        return [sys.executable, "-m", "benchmarks.gpu", *argv, *([] if args.hf else ["--no-hf"])]
    return bench_module_argv(args, json_path, tree)


def bench_module_argv(args, json_path: Path, tree: Path) -> list[str]:
    argv = ["--shape", *args.shapes, "--quick", "--batches", *map(str, args.batches), "--json", str(json_path),
            "--workdir", "/tmp/bench"]
    for flag, values in (("--contexts", args.contexts), ("--prefill", args.prefill)):
        argv += [flag, *map(str, values)] if values else []
    if not args.hf:  # the artifacts are kept per tree: each converts with its own converter
        argv += ["--no-hf", "--artifact-cache", "/tmp/bench-artifacts/" + str(tree).strip("/").replace("/", "_")]
    return [sys.executable, "-m", "benchmarks.bench", *argv]


def quantized_bench(args, out: Path) -> int:
    """bf16, then ``--quantize FORMAT``, of this tree in one call: one comparison table, quantized over bf16."""
    results: dict[str, list] = {"bf16": [], args.quantize: []}
    failed = 0
    profile = ["--profile", str(out)] if args.profile else []  # the quantized run's decode kernels, per step
    for label, extra in (("bf16", []), (args.quantize, ["--quantize", args.quantize, *profile])):
        path = out / f"bench_{label}.json"
        failed |= run(args, f"bench_{label}", [*bench_module_argv(args, path, ROOT), *extra], timeout=args.timeout)
        if path.exists():
            results[label].append(json.loads(path.read_text()))
    if args.dry_run:
        return 0
    rows = compare(results["bf16"], results[args.quantize])
    print(comparison_table(rows, before="bf16", after=args.quantize))
    (out / "bench_compare.json").write_text(json.dumps(rows, indent=2))
    return 1 if failed else 0


def bench(args) -> int:
    out = out_dir()
    if args.quantize is not None:
        if args.baseline is not None:
            raise SystemExit("scripts/gpu bench: --quantize compares with this tree's bf16 run; leave out --baseline")
        return quantized_bench(args, out)
    if args.baseline is None:
        json_path = Path(args.json) if args.json else out / "bench.json"
        profile = ["--profile", str(out)] if args.profile else []
        return run(args, "bench", [*bench_module_argv(args, json_path, ROOT), *profile], timeout=args.timeout)
    base = Path(args.baseline).resolve()
    results: dict[str, list] = {"before": [], "after": []}
    failed = 0
    for i, (label, tree) in enumerate((("before", base), ("after", ROOT), ("before", base))):
        path = out / f"bench_{label}{i}.json"
        rc = run(args, f"bench_{label}{i}", bench_argv(args, path, tree), cwd=tree, env=tree_env(tree),
                 timeout=args.timeout)
        failed |= rc
        if path.exists():
            results[label].append(json.loads(path.read_text()))
    if args.dry_run:
        return 0
    rows = compare(results["before"], results["after"])
    print(comparison_table(rows))
    (out / "bench_compare.json").write_text(json.dumps(rows, indent=2))
    return 1 if failed else 0


def figures(result: dict) -> dict[tuple, float]:
    """(shape, batch, phase) -> tokens/s of one bench JSON: decode at each context, prefill at each length."""
    out = {}
    for shape, r in result.get("shapes", {}).items():
        eng = r.get("engine", {})
        for d in eng.get("decode", []):
            out[(shape, d["batch"], f"decode {d['context']}")] = d["tokens_per_s"]
        for p in eng.get("prefill", []):
            out[(shape, 1, f"prefill {p['tokens']}")] = p["tokens_per_s"]
    return out


def compare(before: list[dict], after: list[dict]) -> list[dict]:
    """One row per figure both sides measured: the mean of the before runs, the mean of the after runs, the ratio."""
    def means(runs: list[dict]) -> dict[tuple, float]:
        seen: dict[tuple, list[float]] = {}
        for r in runs:
            for k, v in figures(r).items():
                seen.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in seen.items()}

    b, a = means(before), means(after)
    return [{"shape": k[0], "batch": k[1], "phase": k[2], "before": b[k], "after": a[k], "after_over_before": a[k] / b[k]}
            for k in sorted(b.keys() & a.keys(), key=lambda k: (k[0], k[2].split()[0], k[1], int(k[2].split()[1])))]


def comparison_table(rows: list[dict], before: str = "before", after: str = "after") -> str:
    lines = [f"| shape | batch | phase | {before} tok/s | {after} tok/s | {after}/{before} |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['batch']} | {r['phase']} | {r['before']:.1f} | {r['after']:.1f} "
              f"| {r['after_over_before']:.3f} |" for r in rows]
    return "\n".join(lines)


def numerics(args) -> int:
    out, rc = out_dir(), 0
    for s in args.shapes:
        quantize = ("--quantize", args.quantize) if args.quantize else ()
        rc |= run(args, f"model_check_{s}", module("model_check", "--shape", s, "--tokens", 512, *quantize,
                                                   "--json", out / f"model_check_{s}.json"), timeout=args.timeout)
        rc |= run(args, f"program_check_{s}", module("program_check", "--shape", s, "--batch", 1, 8, "--context", 1000, "--steps", 16,
                                                     "--json", out / f"program_check_{s}.json"), timeout=args.timeout)
    return rc


def cache(args) -> int:
    return run(args, "cache", module("context_cache", "--shape", *args.shapes, "--workdir", "/tmp/bench",
                                     "--json", out_dir() / "cache.json"), timeout=args.timeout)


def speculative(args) -> int:
    return run(args, "speculative", module("speculative", "--shape", args.shape, "--json",
                                           out_dir() / "speculative.json"), timeout=args.timeout)


def moe(args) -> int:
    if args.full_depth and args.shape != "35b-a3b":
        raise SystemExit("scripts/gpu moe: --full-depth runs Qwen3.5 35B-A3B only")
    if args.full_depth:
        return run(args, "moe_full_depth", module("moe_full_depth", "--engine", "--json",
                                                  out_dir() / "moe_full_depth.json"), timeout=args.timeout)
    shape = ["--shape", args.shape] + (["--layers", args.layers] if args.layers else []) \
        + (["--budget-gib", f"{args.budget_gib:g}"] if args.budget_gib else []) \
        + (["--quantize", args.quantize] if args.quantize else []) \
        + (["--profile", out_dir()] if args.profile else [])
    return run(args, "moe", module("moe", *shape, "--workdir", "/tmp/moe", "--json", out_dir() / "moe.json",
                                   *([] if args.hf else ["--no-hf"])), timeout=args.timeout)


def vision(args) -> int:
    return run(args, "vision", module("vision", "--workdir", "/tmp/vision", "--json", out_dir() / "vision.json",
                                      *([] if args.hf else ["--no-hf"])), timeout=args.timeout)


def start(args) -> int:
    # one start may take what the sparse artifact and the plan leave of the step (two: the module's default each)
    each = ["--timeout", f"{max(60, args.timeout - 120):g}"] if len(args.runs) == 1 else []
    return run(args, "start", module("start", "--model", args.model, "--runs", ",".join(args.runs), *each,
                                     "--json", out_dir() / "start.json"), timeout=args.timeout)


def tune(args) -> int:
    return run(args, "tune", [sys.executable, "-m", "ninfer.ops.triton.tune", *args.extra], timeout=args.timeout)


def train(args) -> int:
    env = tree_env(ROOT, drop=(FLA_SITE,))  # the embedded model was trained on transformers' torch GDN path
    return run(args, "train", ["bash", "tools/train_tiny/run_gpu.sh", str(out_dir() / "train"), "--evaluate",
                               *args.extra], env=env, timeout=args.timeout)


# -- the command line ----------------------------------------------------------------------------------------------

PASS_THROUGH = (tests, tune, train)  # their other arguments go to pytest, the tuner, train.py

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")

    def suite(fn, help: str, timeout: float = 570):
        s = sub.add_parser(fn.__name__, help=help, description=help)
        s.set_defaults(fn=fn)
        s.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
        s.add_argument("--timeout", type=float, default=timeout, help="seconds each step may run")
        return s

    suite(tests, "every -m gpu test of the repository, kernels included, each under --timeout (other arguments go "
                 "to pytest)", 300)
    s = suite(bench, "decode and prefill tokens/s of the Engine against the HBM floor, the kernel chain and transformers")
    s.add_argument("--shapes", type=csv(str), default=["0.8b", "9b"])
    s.add_argument("--batches", type=csv(int), default=[1, 2, 4, 8])
    s.add_argument("--contexts", type=int, nargs="+", default=None, help="decode contexts (default 1024 8192)")
    s.add_argument("--prefill", type=int, nargs="+", default=None, help="prompt lengths (default 512 4096)")
    s.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baseline")
    s.add_argument("--profile", action="store_true",
                   help="also profile the steady decode at the smallest and largest B (device busy against host idle)")
    s.add_argument("--baseline", default=None, metavar="DIR",
                   help="another checkout: its own bench, then this one, then its own again; one comparison table")
    s.add_argument("--json", default=None, help=argparse.SUPPRESS)  # where a newer tree's baseline call writes
    s.add_argument("--quantize", choices=("fp8", "nvfp4"), default=None,
                   help="also convert with ninfer convert --quantize FORMAT and compare it with bf16 in the same call")
    s = suite(numerics, "bf16 model against fp32 logits, and decode graphs against eager, per shape")
    s.add_argument("--shapes", type=csv(str), default=["0.8b", "9b"])
    s.add_argument("--quantize", choices=("fp8", "nvfp4"), default=None,
                   help="also the model quantized (ninfer convert --quantize's plan) against fp32 and bf16")
    s = suite(cache, "the context cache on against off: multi-turn TTFT, hits, misses, decode cost")
    s.add_argument("--shapes", type=csv(str), default=["9b"])
    s = suite(speculative, "MTP speculative decoding: verify unit costs and the trained head's acceptance")
    s.add_argument("--shape", default="9b")
    s = suite(moe, "a MoE model at a reduced depth (Qwen3.5 35B-A3B, or --shape qwen4exp): decode against its "
                   "bytes floor, host experts against a host-bandwidth floor, transformers")
    s.add_argument("--shape", default="35b-a3b", choices=("35b-a3b", "qwen4exp"))
    s.add_argument("--layers", type=int, default=None,
                   help="decoder layers written and run, a multiple of 4 (default 8; 4 for qwen4exp: 5 GB a layer)")
    s.add_argument("--budget-gib", type=float, default=None, help="device budget of the host-experts plan (default 24)")
    s.add_argument("--full-depth", action="store_true", help="Qwen3.5 35B-A3B: all 40 layers on the device, no "
                                                              "checkpoint")
    s.add_argument("--quantize", choices=("fp8", "nvfp4"), default=None,
                   help="also the same weights converted with ninfer convert --quantize FORMAT, all on the device, "
                        "beside bf16 in the same call")
    s.add_argument("--profile", action="store_true",
                   help="also profile each all-device decode B (kernels and launches per step; tables to $OUT)")
    s.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baseline")
    s = suite(vision, "the vision encoder: attention, images/s, TTFT of a chat with one image")
    s.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    s = suite(start, "ninfer serve start time with a cold, then a warm Triton cache")
    s.add_argument("--model", default="9b", help="a shape (sparse artifact: e.g. 9b, 35b-a3b, "
                                                  "qwen4exp-published), a .ninfer path or 'default'")
    s.add_argument("--runs", type=csv(str), default=["cold", "warm"], help="cold, warm or cold,warm (default)")
    suite(tune, "regenerate the kernel tuning tables on this device (python -m ninfer.ops.triton.tune ARGS)")
    suite(train, "the embedded model's training run and evaluation (carry .train_data; ARGS go to train.py)", 600)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra and args.fn not in PASS_THROUGH:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if threading.current_thread() is not threading.main_thread():  # no signal handler off the main thread
        return args.fn(args)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return args.fn(args)
    finally:  # an in-process call (a test) leaves the handler as it found it
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
