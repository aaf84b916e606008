"""The ``start`` suite: how long ``ninfer serve`` takes from its command to the first ``/health`` answer, with a
fresh Triton cache (every kernel compiled) and then a warm one (the same folder again), each in a fresh process.

The model is a published shape converted with its weights left as a hole (``benchmarks/sparse.py``: nothing to
write, the start reads zeros), or ``default``, the embedded model. Before a start of a sparse shape, ``ninfer plan``
on the same artifact and device prints what goes where (a start the plan refuses says so, with the plan's numbers).

    scripts/gpu start                                                         # 9B on the GPU machine
    scripts/gpu start --model qwen4exp-published --runs cold                  # Qwen4Exp: 320 GiB of host weights
    python -m benchmarks.start --model default --device cpu                   # CPU smoke run (tested)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = ("cold", "warm")  # a fresh TRITON_CACHE_DIR, then the same one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


def time_start(model: str, device: str, triton_cache: Path, timeout: float, extra: list[str]) -> dict:
    """Seconds from the command to the first 200 from /health (the server is stopped after)."""
    port = free_port()
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache)}
    cmd = [sys.executable, "-m", "ninfer", "serve", model, "--port", str(port), "--device", device, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not healthy(port):
            if proc.poll() is not None:
                return {"error": f"exited with {proc.returncode}: {proc.stdout.read()[-2000:]}"}
            if time.perf_counter() - t0 > timeout:
                return {"error": f"no /health answer within {timeout} s"}
            time.sleep(0.05)
        return {"seconds": time.perf_counter() - t0}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def plan(model: str, device: str, max_concurrency: int) -> dict:
    """``ninfer plan --json`` of the artifact as the start will plan it (this machine's device and host memory);
    its human table is printed too."""
    base = [sys.executable, "-m", "ninfer", "plan", model, "--device", device, "--max-concurrency",
            str(max_concurrency)]
    text = subprocess.run(base, capture_output=True, text=True)
    print(text.stdout + text.stderr, flush=True)
    out = subprocess.run([*base, "--json"], capture_output=True, text=True)
    try:
        return json.loads(out.stdout)
    except json.JSONDecodeError:
        return {"error": f"ninfer plan exited with {out.returncode}: {(out.stdout + out.stderr)[-2000:]}"}


def markdown(res: dict) -> str:
    lines = [f"# ninfer serve start: {res['model']} on {res['device']}", "",
             "| Triton cache | start s |", "|---|---|"]
    for run in res["runs"]:
        r = res["runs"][run]
        lines.append(f"| {run} | {r['error'] if 'error' in r else format(r['seconds'], '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from benchmarks.sparse import sparse_shapes

    shapes = sparse_shapes()
    p.add_argument("--model", default="9b", help=f"a shape ({', '.join(sorted(shapes))}), a .ninfer path, or "
                                                 "'default' (the embedded model)")
    p.add_argument("--runs", default=",".join(RUNS), help="which starts, in order: cold, warm or cold,warm")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--timeout", type=float, default=280.0, help="seconds each start may take")
    p.add_argument("--workdir", default=None, help="folder for the sparse artifact (default: temp dir)")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    if not runs or set(runs) - set(RUNS):
        p.error(f"--runs takes cold and/or warm, got {args.runs!r}")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ninfer-start-", dir=args.workdir))
    try:
        model = args.model
        res: dict = {"model": args.model, "device": args.device, "max_concurrency": args.max_concurrency,
                     "runs": {}}
        if model in shapes:
            from benchmarks.sparse import write_sparse_artifact

            model = str(write_sparse_artifact(args.model, work))
            res["plan"] = plan(model, args.device, args.max_concurrency)
        extra = ["--max-concurrency", str(args.max_concurrency), "--no-verify"]
        cache = work / "triton-cache"
        for run in runs:  # the warm run reuses the folder the cold run filled
            res["runs"][run] = time_start(model, args.device, cache, args.timeout, extra)
            print(f"# {run}: {res['runs'][run]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 1 if any("error" in r for r in res["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
