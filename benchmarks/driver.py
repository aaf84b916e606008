"""The driver the per-shape benchmarks share (``context_cache``, ``constrained_decode``): arguments, device,
one ``bench_shape`` per shape whose failure keeps the others' figures, JSON after each shape, the table."""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import traceback
from pathlib import Path

from benchmarks import bench


def shape_benchmark_main(tool: str, argv, *, parse_args, validate, bench_shape, markdown) -> int:
    """The ``main`` a per-shape benchmark shares (``context_cache``, ``constrained_decode``): parse its
    arguments, check the ones every such benchmark has (``--batches``, ``--prefill-chunk``) and then its own
    (``validate``; a message: exit 2), then ``drive_shapes`` with the plugins importable."""
    def run(argv) -> int:
        args = parse_args(argv)
        if (err := _shared_problem(args) or validate(args)) is not None:
            print(f"{tool}: {err}", file=sys.stderr)
            return 2
        return drive_shapes(tool, args, bench_shape, markdown)

    return bench.run_with_plugins(run, argv)


def _shared_problem(args) -> str | None:
    if not all(1 <= b <= 8 for b in args.batches):
        return "--batches values must be in 1..8 (the engine's max_concurrency range)"
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        return "--prefill-chunk must be >= 1"
    return None


def drive_shapes(tool: str, args, bench_shape, markdown) -> int:
    """Resolve the device and the prefill chunk, run ``bench_shape(shape, args, device, res)`` for each shape
    (one shape's failure keeps the others' figures), write the JSON after each, then print ``markdown(result)``."""
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
    t0 = bench.clock()
    result: dict = {"device": bench.device_info(device), "args": dict(vars(args)), "shapes": {}}
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
    result["wall_s"] = bench.clock() - t0
    result["markdown"] = markdown(result)
    print(result["markdown"])
    print(f"\n# wall time {result['wall_s']:.1f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 1 if failed else 0
