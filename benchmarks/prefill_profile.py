"""Where a short prefill unit after a long context spends its time (torch.profiler, CUDA): a diagnosis aid.

    python -m benchmarks.prefill_profile --shape 9b --context 8192 --chunk 32 512 2048
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import ninfer
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="9b")
    ap.add_argument("--artifact-cache", default="/tmp/artifacts")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, nargs="+", default=[32, 512, 2048])
    args = ap.parse_args()
    from benchmarks.context_cache import artifact

    path = artifact(args.shape, args, "cuda", Path(tempfile.mkdtemp()), {})
    eng = ninfer.Engine(path, max_concurrency=1, max_model_len=args.context + 4096, context_cache=False,
                        num_pages=(args.context + 4096) // 16 + 8, prefill_chunk=2048)
    prog = eng.instance.program
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 200000, (args.context + 2048,), generator=g).tolist()

    def prefill(sid, n):
        assert prog.reserve_units(sid, n)
        return prog.prefill(sid, n)

    def run():
        sid = eng._core.on_worker(lambda: prog.open_sequence(PreparedPrompt(token_ids=ids), SamplingParams(max_tokens=1)), 600)
        for _ in range(args.context // 2048):
            eng._core.on_worker(lambda: prefill(sid, 2048), 600)
        return sid

    def timed(sid, n):
        def body():
            torch.cuda.synchronize()
            t = time.perf_counter()
            prefill(sid, n)
            torch.cuda.synchronize()
            return time.perf_counter() - t
        return eng._core.on_worker(body, 600)

    for n in args.chunk:
        sid = run()
        timed(sid, n)  # warm
        eng._core.on_worker(lambda s=sid: prog.release(s), 600)
        sid = run()
        dt = timed(sid, n)
        print(f"prefill {n} tokens after {args.context}: {dt * 1e3:.2f} ms", flush=True)
        eng._core.on_worker(lambda s=sid: prog.release(s), 600)
    sid = run()
    from torch.profiler import ProfilerActivity, profile

    def prof_body():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            prefill(sid, args.chunk[0])
            torch.cuda.synchronize()
        return p
    p = eng._core.on_worker(prof_body, 600)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
