"""Startup planning against what a start really takes, on the published 9B and 27B shapes (docs/memory.md).

For each shape, device budget and speculative setting:

(a) the plan from the artifact's header alone (what ``ninfer plan`` reports: the table, KV pages and tokens,
    or the PlanError), timed;
(b) when it fits, ``ninfer.Engine`` starts under that budget (timed; graph calibration included) and its
    ``MemorySummary`` is recorded with the allocator's reserved bytes; then ``max_concurrency`` requests with a
    prompt of one prefill chunk each drive the workspace to its peak. The peak reserved bytes (weights, stores,
    workspaces and the CUDA graph pools all live in the caching allocator) are compared with the budget:
    recorded, not asserted;
(c) when the plan refuses, the Engine start is tried too: it must refuse with the PlanError before reading a
    weight (the bytes the process read during the attempt are recorded, from /proc/self/io).

The artifacts are sparse. The real converter runs over a source checkpoint whose safetensors header is real
and whose data is a hole, and writes the artifact with ``SparseArtifactWriter``: the converter's own header
(every object, binding and use of the shape, MTP head included) over a data region left as a hole, each weight
checksum the crc32 of that many zero bytes (valid: ``verify`` passes). A 54 GB 27B artifact then takes no disk
and no write time. Zero weights give garbage tokens, which memory does not care about.

    python -m benchmarks.memory_plan --shapes 9b 27b --workdir /tmp/memplan --json out.json      # GPU machine
    python -m benchmarks.memory_plan --shapes tiny --device cpu --budgets-mib 1 64 --prompt-tokens 16  # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path

from benchmarks.load_throughput import _host, _import_paths

_import_paths()

import attrs  # noqa: E402
import torch  # noqa: E402

from ninfer.artifact.format import (  # noqa: E402
    PREFIX_SIZE,
    RESOURCE_FEATURE,
    ArtifactHeader,
    align_up,
    checksum_text,
    header_to_json,
    pack_prefix,
)
from ninfer.artifact.writer import ArtifactWriter, tensor_bytes  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
_ZEROS = bytes(16 * MIB)


def zero_crcs(sizes) -> dict[int, int]:
    """crc32 of n zero bytes for every n in ``sizes``, extending one running crc over the sorted sizes (the work
    is the largest size once, not the sum)."""
    out: dict[int, int] = {}
    crc, done = 0, 0
    for n in sorted(set(sizes)):
        while done < n:
            step = min(len(_ZEROS), n - done)
            crc = zlib.crc32(memoryview(_ZEROS)[:step], crc)
            done += step
        out[n] = crc
    return out


class SparseArtifactWriter(ArtifactWriter):
    """The converter's writer with every weight object left as a hole of zeros; frontend resources are written.
    Same layout, header and atomic rename as ``ArtifactWriter.write``; no weight source is ever read."""

    def write(self, path, *, metadata, config, features, frontend=None, progress=None, digest=None):
        from ninfer.artifact.reader import _validate

        path = Path(path)
        pending = list(self._objects.values())

        def header(objects, meta=metadata) -> ArtifactHeader:
            return ArtifactHeader(metadata=meta, config=config, features=features, alignment=self.alignment,
                                  data_size=self._end, objects=objects, bindings=tuple(self._bindings.values()),
                                  uses=tuple(self._uses), frontend=frontend)

        draft = header(tuple(p.obj for p in pending))
        _validate(draft, path)
        header_len = len(header_to_json(draft))
        data_start = align_up(PREFIX_SIZE + header_len, self.alignment)
        zeros = zero_crcs(p.obj.nbytes for p in pending if p.obj.feature != RESOURCE_FEATURE)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                final = []
                for p in pending:
                    crc = zeros.get(p.obj.nbytes, 0)
                    if p.obj.feature == RESOURCE_FEATURE:
                        data = b"".join(bytes(c if isinstance(c, bytes | bytearray | memoryview) else tensor_bytes(c))
                                        for c in p.source())
                        f.seek(data_start + p.obj.offset)
                        f.write(data)
                        crc = zlib.crc32(data)
                    final.append(attrs.evolve(p.obj, checksum=checksum_text(crc)))
                f.truncate(data_start + self._end)  # the rest is a hole: zeros on read, no disk
                meta = metadata if digest is None else attrs.evolve(metadata, source_digest=digest(tuple(final)))
                raw = header_to_json(header(tuple(final), meta))
                if len(raw) != header_len:
                    raise RuntimeError(f"header length changed from {header_len} to {len(raw)}")
                f.seek(0)
                f.write(pack_prefix(header_len, zlib.crc32(raw)))
                f.write(raw)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return header(tuple(final), meta)


def shape_config(shape: str) -> dict:
    from benchmarks.shapes import MOE_SHAPES, SHAPES

    # an MTP head: --speculative mtp plans
    return dict({**SHAPES, **MOE_SHAPES}[shape], dtype="bfloat16", mtp_num_hidden_layers=1)


def write_sparse_source(directory: Path, config: dict, shard_bytes: int = 4 * GIB) -> int:
    """A checkpoint in published naming (flat text + ``mtp.*``) whose tensor data is a hole: config.json, tokenizer
    files, safetensors shards with real headers (and their index). Shards as published: one mapping of 54 GB
    is refused where memory overcommit is heuristic. Returns the tensor bytes it declares."""
    from benchmarks.load_throughput import write_source_files
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.source_mapping import expected_parameters

    write_source_files(directory, config)
    shards: list[dict] = [{}]
    sizes = [0]
    for name, (_, shape) in expected_parameters(parse_config(config), ("text", "mtp")).items():
        fp32 = name.endswith(("A_log", "linear_attn.norm.weight"))  # fp32 in published checkpoints
        nbytes = math.prod(shape) * (4 if fp32 else 2)
        if sizes[-1] and sizes[-1] + nbytes > shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = {"dtype": "F32" if fp32 else "BF16", "shape": list(shape),
                            "data_offsets": [sizes[-1], sizes[-1] + nbytes]}
        sizes[-1] += nbytes
    weight_map = {}
    for i, (entries, size) in enumerate(zip(shards, sizes, strict=True)):
        file = directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        raw = json.dumps({"__metadata__": {"format": "pt"}, **entries}).encode()
        raw += b" " * (-len(raw) % 8)
        with open(file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
        os.truncate(file, 8 + len(raw) + size)
        weight_map.update(dict.fromkeys(entries, file.name))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}))
    return sum(sizes)


def write_sparse_artifact(shape: str, workdir: Path) -> Path:
    """The shape's artifact through the real converter, data left as a hole (see the module docstring)."""
    import ninfer_convert.convert as convert

    src, out = workdir / f"{shape}-source", workdir / f"{shape}.ninfer"
    shutil.rmtree(src, ignore_errors=True)
    write_sparse_source(src, shape_config(shape))
    try:
        convert.convert_checkpoint(src, out, name=f"sparse-{shape}", host=_host(), make_writer=SparseArtifactWriter)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return out


def engine_kwargs(device: str, budget: int, max_concurrency: int, speculative: str) -> dict:
    from ninfer.contract.config import StartupFeatures

    features = StartupFeatures(speculative=None if speculative == "none" else speculative)
    return dict(device=device, device_budget_bytes=budget, max_concurrency=max_concurrency, features=features,
                verify=False)


def plan_row(path: Path, kwargs: dict, memory) -> dict:
    """(a): the plan from the header alone, as every start makes it before reading a weight."""
    from ninfer.contract.config import EngineConfig
    from ninfer.core.device_plan import PlanError
    from ninfer.engine.startup import native_startup, open_model, profile_and_plan

    options = EngineConfig(**kwargs).for_device(kwargs["device"]).startup_options()
    memory.settle()
    t0 = time.perf_counter()
    artifact = open_model(path, verify=False)
    try:
        startup = native_startup(artifact)
        try:
            _, plan = profile_and_plan(startup, artifact, options, memory.snapshot())
        except PlanError as exc:
            return {"fits": False, "error": str(exc), "seconds": time.perf_counter() - t0}
    finally:
        artifact.close()
    return {"fits": True, "seconds": time.perf_counter() - t0, "table": dict(plan.table()),
            "placement": plan.placement.name, "needed_bytes": plan.needed_bytes, "kv_pages": plan.kv_pages,
            "kv_tokens": plan.kv_tokens, "max_model_len": plan.max_model_len, "pdl": plan.pdl}


def _read_bytes() -> int | None:
    """Bytes this process has read through read/pread so far (None without /proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def refusal_row(path: Path, kwargs: dict) -> dict:
    """(c): an Engine start the plan refuses must raise its PlanError before reading the weights."""
    from ninfer import Engine

    r0 = _read_bytes()
    t0 = time.perf_counter()
    try:
        engine = Engine(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - recorded: the PlanError expected, anything else reported
        r1 = _read_bytes()
        return {"refused": True, "error_type": type(exc).__name__, "error": str(exc),
                "seconds": time.perf_counter() - t0, "read_bytes": None if r0 is None or r1 is None else r1 - r0}
    engine.close()
    return {"refused": False, "seconds": time.perf_counter() - t0}


def engine_row(path: Path, kwargs: dict, memory, *, budget: int, prompt_tokens: int | None, max_tokens: int,
               timeout: float) -> dict:
    """(b): start under the budget, record its MemorySummary, then a full-chunk prefill on every sequence."""
    from ninfer import Engine
    from ninfer.contract.prompt import TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams

    cuda = memory.measures
    memory.settle()
    memory.reset_peak()
    t0 = time.perf_counter()
    engine = Engine(path, **kwargs)
    row: dict = {"start_seconds": time.perf_counter() - t0}
    try:
        summary = engine.instance.memory
        row["memory"] = attrs.asdict(summary)
        row["kv_tokens"] = summary.kv_tokens
        row["calibration_seconds"] = summary.calibration_seconds
        if cuda:
            snap = memory.snapshot()
            row.update(start_peak_reserved=memory.peak_reserved(), reserved_after_start=snap.reserved,
                       device_used_after_start=snap.used)
        length = prompt_tokens or engine.config.prefill_chunk or 2048
        length = max(1, min(length, engine.max_model_len - max_tokens - 1))
        # Distinct prompts of byte tokens (valid for every tokenizer here); no context-cache reuse between them.
        prompts = [tuple(random.Random(i).randrange(256) for _ in range(length)) for i in range(engine.max_concurrency)]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        memory.reset_peak()
        t1 = time.perf_counter()
        try:
            handles = [engine.submit(GenerationRequest(input=TextInput(token_ids=p), sampling=sampling,
                                                       context_cache=False)) for p in prompts]
            results = [h.result(timeout) for h in handles]
            errors = [r.error for r in results if r.error]
            row.update(workload_requests=len(results), workload_prompt_tokens=length,
                       workload_generated=sum(len(r.token_ids) for r in results),
                       workload_errors=errors[:3], workload_ok=not errors)
        except Exception as exc:  # noqa: BLE001 - recorded in the row; the next budget still runs
            row.update(workload_ok=False, workload_errors=[f"{type(exc).__name__}: {exc}"])
        if cuda:
            torch.cuda.synchronize()
        row["workload_seconds"] = time.perf_counter() - t1
        if cuda:
            row["peak_reserved"] = memory.peak_reserved()
            row["peak_within_budget"] = max(row["peak_reserved"], row["start_peak_reserved"]) <= budget
        else:
            row["peak_reserved"] = row["peak_within_budget"] = None  # the CPU has no allocator to read
    finally:
        engine.close()
        del engine
        gc.collect()
        memory.settle()
    if cuda:  # what the next start finds held: the engine must have given everything back
        row["reserved_after_close"] = memory.snapshot().reserved
    return row


def run(shapes, budgets, *, device: str, workdir: Path, max_concurrency: int, speculative, prompt_tokens,
        max_tokens: int, timeout: float, plan_only: bool = False, json_path: Path | None = None) -> dict:
    """Every (shape, speculative, budget) row; ``json_path`` is rewritten after each row, so a run cut short by
    its time limit still leaves the rows it finished."""
    from ninfer.core.device import Device
    from ninfer.core.device_memory import DeviceMemory

    memory = DeviceMemory(Device.parse(device))
    rows: list[dict] = []
    out: dict = {"device": device, "rows": rows}
    if memory.measures:
        out["gpu"] = torch.cuda.get_device_name(memory.device.torch)
        out["device_total_bytes"] = torch.cuda.mem_get_info(memory.device.torch)[1]
    for shape in shapes:
        t0 = time.perf_counter()
        path = write_sparse_artifact(shape, workdir)
        write_s = time.perf_counter() - t0
        print(f"{shape}: sparse artifact {path.stat().st_size / 1e9:.2f} GB ({write_s:.1f} s)", file=sys.stderr)
        for spec in speculative:
            for budget in budgets:
                kwargs = engine_kwargs(device, budget, max_concurrency, spec)
                row = {"shape": shape, "speculative": spec, "budget_bytes": budget,
                       "max_concurrency": max_concurrency, "artifact_bytes": path.stat().st_size,
                       "artifact_write_seconds": write_s, "plan": plan_row(path, kwargs, memory)}
                if plan_only:
                    pass
                elif row["plan"]["fits"]:
                    try:
                        row["engine"] = engine_row(path, kwargs, memory, budget=budget,
                                                   prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                                   timeout=timeout)
                    except Exception as exc:  # noqa: BLE001 - a start that fails is a result, not a crash
                        row["engine"] = {"error": f"{type(exc).__name__}: {exc}"}
                        gc.collect()
                        memory.settle()
                else:
                    row["refusal"] = refusal_row(path, kwargs)
                print(format_row(row), file=sys.stderr)
                rows.append(row)
                if json_path is not None:
                    json_path.write_text(json.dumps(out, indent=1, default=str))
        path.unlink()
    return out


def _g(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


COLUMNS = ("shape", "spec", "budget GiB", "plan weights GiB", "plan KV tokens", "plan fits", "weights GiB",
           "KV tokens", "graphs calib / rebuild GiB", "reserved after start GiB", "peak in start GiB",
           "peak in workload GiB", "peaks <= budget", "start s", "calibration s", "plan s")
_ENGINE_CELLS = len(COLUMNS) - 7  # from "weights GiB" to "calibration s"


def format_row(row: dict) -> str:
    plan, eng, ref = row["plan"], row.get("engine"), row.get("refusal")
    cells = [row["shape"], row["speculative"], _g(row["budget_bytes"]),
             _g(plan["table"]["weights"]) if plan["fits"] else "-", str(plan.get("kv_tokens", "-")),
             "yes" if plan["fits"] else "no"]
    if eng is not None and "memory" in eng:
        m, graphs = eng["memory"], eng["memory"]["cuda_graph"]
        peak_ok = eng.get("peak_within_budget")
        verdict = {None: "-", True: "PASS", False: "FAIL"}[peak_ok]
        if not eng.get("workload_ok"):
            verdict += " (workload error)"
        cells += [_g(m["weights_bytes"]), str(eng["kv_tokens"]),
                  f"{_g(graphs['calibration_growth'])} / {_g(graphs['rebuild_estimate'])}",
                  _g(eng.get("reserved_after_start")), _g(eng.get("start_peak_reserved")), _g(eng.get("peak_reserved")),
                  verdict, f"{eng['start_seconds']:.1f}", f"{eng['calibration_seconds']:.1f}"]
    elif eng is not None:
        cells += [f"start failed: {eng['error'][:160]}"] + ["-"] * (_ENGINE_CELLS - 1)
    elif ref is not None:
        what = ("STARTED (plan said no)" if not ref["refused"] else "refused" if ref["error_type"] == "PlanError"
                else f"failed with {ref['error_type']}, not PlanError")
        read = ref.get("read_bytes")
        cells += [f"{what} in {ref['seconds']:.2f} s" + ("" if read is None else f", read {read / MIB:.1f} MiB")]
        cells += ["-"] * (_ENGINE_CELLS - 1)
    else:  # --plan-only
        cells += ["-"] * _ENGINE_CELLS
    cells.append(f"{plan['seconds']:.2f}")
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    from benchmarks.shapes import MOE_SHAPES, SHAPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["9b", "27b"], choices=sorted({**SHAPES, **MOE_SHAPES}))
    budgets = p.add_mutually_exclusive_group()
    budgets.add_argument("--budgets-gib", nargs="+", type=float, default=[24, 48, 80])
    budgets.add_argument("--budgets-mib", nargs="+", type=float, help="budgets in MiB (CPU smoke runs)")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--speculative", nargs="+", choices=("none", "mtp"), default=["none"],
                   help="start without speculative decoding (none) and/or with the MTP head (mtp)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--prompt-tokens", type=int, help="prompt length per request (default: the prefill chunk)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0, help="hang guard for the workload's requests (s)")
    p.add_argument("--plan-only", action="store_true", help="plan from the header alone; start no Engine")
    p.add_argument("--workdir", help="folder for the sparse artifacts (default: a temp dir)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("memory_plan: no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    scale, values = (MIB, args.budgets_mib) if args.budgets_mib else (GIB, args.budgets_gib)
    budget_bytes = [int(v * scale) for v in values]
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ninfer-memplan-", dir=base))
    try:
        res = run(args.shapes, budget_bytes, device=args.device, workdir=workdir,
                  max_concurrency=args.max_concurrency, speculative=args.speculative,
                  prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, timeout=args.timeout,
                  plan_only=args.plan_only, json_path=Path(args.json) if args.json else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in res["rows"]:
        print(format_row(row))
    for row in res["rows"]:
        if not row["plan"]["fits"]:
            print(f"{row['shape']} {row['speculative']} @ {_g(row['budget_bytes'])} GiB: {row['plan']['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
