"""The kernel launches of one decode step, counted on the CPU: how many, and which model function makes them.

``python -m benchmarks.launches --arch qwen4exp`` makes a tiny checkpoint (``ninfer tiny-checkpoint``), converts
it, starts it on the CPU as the engine does and counts one B-row decode step (reserve, decode, commit). A step
replayed from a CUDA graph still pays each kernel's launch gap on the device, so where a step's bytes are few the
count, not the bytes, sets its time (docs/performance.md, Qwen4Exp).

What counts as one launch:
- a call of an op the CUDA path runs as a Triton kernel (listed in ``ninfer.ops.dispatch.TRITON_OPS``; with
  ``--ops triton`` every kernel written): the reference that runs here in its place is not counted. A few ops
  launch more than one kernel (the grouped MoE beyond one token), so their count is a lower bound;
- every other torch op that is not a view, an allocation or a read of a scalar (cuBLAS, torch's elementwise and
  reduction kernels, copies).
A read of a tensor's value on the host (``.item()``, ``nonzero``) is counted apart: a graph cannot hold it. The
batch's assembly (``ninfer.core.batch_assembly``) works on host tensors on CUDA too: its ops are listed as host
work, and its copies to the device (one a field) are not counted.
The CUDA path and the CPU's take the same branches in the decode step of these models; torch fuses nothing
without ``torch.compile``, which the engine does not use.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pkgutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch nothing: storage made or dropped, metadata
_FREE = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "detach_", "alias", "resize_", "set_",
         "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
_SYNCS = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "unique_consecutive", "_unique2"}
_SKIP = ("torch", "benchmarks", "ninfer.ops", "contextlib", "functools", "threading", "_pytest")
_HOST = "ninfer.core.batch_assembly"  # builds the step's inputs on the host, whatever the device


def _part(frame) -> str:
    """The innermost model function on the stack: ``module:function`` of the first frame outside torch, the op
    layer and this tool."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(_SKIP) and name != __name__:
            return f"{name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class LaunchCounter(TorchDispatchMode):
    """Counts launches (module docstring) by the model function that makes them, and host syncs apart."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[tuple[str, str]] = Counter()  # (the model function that makes it, the kernel)
        self.syncs: Counter[str] = Counter()
        self.host: Counter[str] = Counter()
        self._kernel_frames: set = set()  # op calls a Triton kernel stands in for: their torch ops are not counted

    def _in_kernel(self, frame) -> bool:
        while frame is not None:
            if frame in self._kernel_frames:
                return True
            frame = frame.f_back
        return False

    def kernel_call(self, op: str, frame) -> None:
        """The op function in ``frame`` runs as one Triton kernel on CUDA."""
        if self._in_kernel(frame):
            return
        self._kernel_frames.add(frame)
        self.launches[(_part(frame), f"triton {op}")] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        name = func._schema.name.split("::")[-1]
        if self._in_kernel(frame) or name in _FREE or func.is_view:
            return out
        part = _part(frame)
        if part.startswith(_HOST):
            self.host[part] += 1
            return out
        if name in _SYNCS:
            self.syncs[part] += 1
        if name not in ("_local_scalar_dense", "is_nonzero"):  # a copy of one value to the host, no kernel
            self.launches[(part, f"torch {name}")] += 1
        return out


def _kernel_written(module: str, name: str) -> bool:
    from ninfer.ops.dispatch import TRITON_OPS, _load

    if f"{module}.{name}" in TRITON_OPS:
        return True
    try:
        _load(module, name)
    except (ImportError, AttributeError):
        return False
    return True


@contextlib.contextmanager
def counting_kernels(counter: LaunchCounter):
    """Every ``ninfer.ops`` module's ``triton_kernel`` tells ``counter`` where CUDA would launch a kernel (as
    ``NINFER_OPS`` selects them) and returns None, so the reference runs here, uncounted."""
    from ninfer.ops import dispatch

    def looked_up(module: str, name: str, tensor: torch.Tensor):
        if dispatch.triton_selected(module, name) and _kernel_written(module, name):
            frame = sys._getframe(1)
            while frame.f_code.co_name.startswith("_") and frame.f_back is not None:  # a private lookup helper
                frame = frame.f_back
            counter.kernel_call(f"{module}.{name}", frame)
        return None

    modules = [m for n, m in list(sys.modules.items())
               if n.startswith("ninfer.ops.") and not n.startswith("ninfer.ops.triton")
               and getattr(m, "triton_kernel", None) is dispatch.triton_kernel]
    for m in modules:
        m.triton_kernel = looked_up
    try:
        yield counter
    finally:
        for m in modules:
            m.triton_kernel = dispatch.triton_kernel


def count_step(artifact: Path, batch: int, context: int) -> LaunchCounter:
    """One counted decode step of ``batch`` rows after ``context`` prompt tokens each, on the CPU in fp32."""
    import ninfer.ops
    from benchmarks.architectures import qwen35_view
    from benchmarks.moe_runs import on_instance
    from benchmarks.programs import warm_decode
    from ninfer.contract.config import StartupOptions

    for op_module in pkgutil.iter_modules(ninfer.ops.__path__):  # each op module, to patch its lookups
        if not op_module.ispkg:
            importlib.import_module(f"ninfer.ops.{op_module.name}")
    options = StartupOptions(device="cpu", dtype="float32", max_concurrency=batch, context_cache=False)

    def run(inst) -> LaunchCounter:
        counter = LaunchCounter()
        with warm_decode(inst.program, qwen35_view(inst.config), batch, context) as step, torch.inference_mode():
            with counting_kernels(counter), counter:
                step()
        return counter

    return on_instance(artifact, options, run)


def tiny_artifact(arch: str, layers: int, variant: str | None, workdir: Path) -> Path:
    """A tiny random ``arch`` checkpoint (``ninfer tiny-checkpoint``, no MTP) converted into ``workdir``."""
    from ninfer.cli import main as ninfer

    src, out = workdir / "ckpt", workdir / "tiny.ninfer"
    args = ["tiny-checkpoint", str(src), "--arch", arch, "--layers", str(layers), "--no-mtp"]
    if variant:
        args += ["--variant", variant]
    if ninfer(args) or ninfer(["convert", str(src), str(out)]):
        raise RuntimeError(f"could not make the tiny {arch} artifact")
    return out


def report(counter: LaunchCounter, layers: int) -> dict:
    """The counts as JSON: totals, by model function (``by_part``), by kernel (``by_kind``) and both (``detail``)."""
    parts: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for (part, kind), n in counter.launches.items():
        parts[part] += n
        kinds[kind] += n
    total = sum(parts.values())
    return {"launches": total, "per_layer": total / layers, "layers": layers, "syncs": sum(counter.syncs.values()),
            "host_ops": sum(counter.host.values()), "by_part": dict(parts.most_common()),
            "by_kind": dict(kinds.most_common()),
            "detail": [[part, kind, n] for (part, kind), n in sorted(counter.launches.items())],
            "syncs_by_part": dict(counter.syncs.most_common())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen4exp", help="a tiny-checkpoint architecture (qwen35, qwen35_moe, qwen4exp)")
    p.add_argument("--variant", default=None, help="a named tiny configuration of the architecture")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=40, help="prompt tokens per row before the counted step")
    p.add_argument("--json", default=None, help="write the counts here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        counter = count_step(tiny_artifact(args.arch, args.layers, args.variant, Path(tmp)), args.batch, args.context)
    res = {"arch": args.arch, "variant": args.variant, "batch": args.batch, "context": args.context,
           **report(counter, args.layers)}
    print(f"# {args.arch}{' ' + args.variant if args.variant else ''}: {res['launches']} launches in a B={args.batch} "
          f"decode step of {args.layers} layers ({res['per_layer']:.1f} a layer), {res['syncs']} host reads of the "
          f"device's values; {res['host_ops']} ops assembling the batch on the host")
    print("| made by | launches |\n|---|---|")
    for part, n in res["by_part"].items():
        print(f"| {part} | {n} |")
    print("\n| kernel | launches |\n|---|---|")
    for kind, n in res["by_kind"].items():
        print(f"| {kind} | {n} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
