"""The ``moe`` suite: a MoE model on one GPU: all-device decode against its bytes floor, host experts under a device
budget, and transformers on the same weights, for the 35B-A3B shape (Qwen3.5 MoE) or the published Qwen4Exp shape
(``--shape qwen4exp``) at a reduced depth scaled to full depth.

The disk cannot hold the 35B-A3B checkpoint and its artifact at full depth, so the benchmark writes the shape with
``--layers`` decoder layers (default 8: two groups of 3 Gated DeltaNet + 1 attention layer, the full model's mix)
and random bf16 weights (``benchmarks/moe_weights.py``; the router is random too, so routing is spread as a
trained router's is, though real routers are more skewed), converts it with the real converter, and measures:

1. all-device (every weight on the GPU): decode tokens/s at B = 1 and 8 (Program-level steps: reserve, decode,
   commit, after ``--context`` prompt tokens) and a ``--prefill`` token prompt, with the bytes floor of a step:
   the dense weights, the experts the step hits (B=1: k per layer; B=8: the expected distinct experts of 8
   tokens under uniform routing) and each row's state and
   KV, over the copy bandwidth measured in the same run;
2. host experts: the planner's expert cache for the FULL-depth model under ``--budget-gib`` (a sparse full-depth
   artifact, so nothing is written), its slots per layer given to the reduced model (``expert_cache_bytes``),
   then decode and prefill as above with the cache hit rate over the timed decode steps (random routing: a real
   router's skew changes the hit rate);
3. transformers ``generate`` on the written checkpoint (``--no-hf`` skips it), and ours over it at B=1.

Host experts also get a host-bandwidth floor: a missed expert runs on the CPU team, which must read its bytes from
host memory once; the expected missed experts of a step (distinct experts x layers x the measured miss rate) over
the host read rate measured in the same run, or the step's bytes floor where that is larger.

Qwen4Exp (``--shape qwen4exp``, default 4 layers: 3 Gated DeltaNet + 1 QSA, PLE on the second, as the published
model's first group): the published widths, 512 experts x top-10 (5 GB a layer), the n-gram table reduced
(``moe_weights.REDUCED``: its rows are looked up in host memory, 16 a token). PLE runs once per forward (the n-gram
windows, then its one layer in the published model), so decode times it apart (``moe_runs.once_ms``, replayed
from a CUDA graph) and counts it with the head, not with the layers.

Scaling to full depth (every table says so): per-layer time = (measured - head) / L, where the head (embedding
lookup, lm_head and argmax of the same rows; Qwen4Exp's PLE at decode) is timed alone; full-depth time = head + full
layers x per-layer.
What else a step does once (reserve, commit) is counted per layer, so the full-depth figure errs slow. The floor
at full depth is computed from the full-depth config directly.

    scripts/gpu moe                                                                       # on the GPU machine
    scripts/gpu moe --shape qwen4exp --layers 4                                           # Qwen4Exp
    python -m benchmarks.moe --shape tiny --layers 4 --device cpu --prefill 64 ...        # CPU smoke run (tested)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import moe_weights as mw
from benchmarks.architectures import label, qwen35_view
from benchmarks.harness import (
    GIB,
    device_info,
    fmt,
    plugin_host,
    run_with_plugins,
    target_lines,
    write_source,
)
from benchmarks.moe_runs import (
    decode_run,
    head_ms,
    host_read_bandwidth,
    on_instance,
    once_ms,
    prefill_run,
    stats_delta,
)
from benchmarks.programs import WARMUP_STEPS

clock = time.perf_counter
B1_FLOOR_TARGET = 0.6  # all-device decode B=1 at >= 0.6 of its bytes floor (full depth)


class HostExpertsUnavailable(RuntimeError):
    """This tree cannot start the host-experts placement the benchmark asks for (reported, not a failure)."""


# -- the two placements -----------------------------------------------------------------------------------

def scaled(ms: float, head: float, layers: int, full: int) -> dict:
    """Per-layer time and the full-depth time (module docstring); None where the head is not below ``ms``."""
    if ms <= head:
        return {"head_ms": head, "per_layer_ms": None, "full_ms": None}
    per = (ms - head) / layers
    return {"head_ms": head, "per_layer_ms": per, "full_ms": head + full * per}


def measure(program, config, cfg: dict, args, device: str, full_cfg: dict, bw: float, stats=None,
            host_gb_s: float | None = None, label: str | None = None) -> dict:
    """Decode rows (with the bytes floor at this depth and at full depth; with host experts, the host-bandwidth
    floor too) and the prefill, on one Program; with ``--profile`` and a ``label``, each B's steps profiled."""
    L, full, k = cfg["num_hidden_layers"], full_cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    res: dict = {"decode": []}
    for B in args.batches:
        profile = Path(args.profile) / f"profile-{args.shape}-{label}-b{B}.txt" if args.profile and label else None
        row = decode_run(program, config, device, B, args.context, args.steps, stats, profile)
        distinct = k if B == 1 else mw.expected_distinct(cfg["num_experts"], k, B)
        once = once_ms(program, device, B)  # Qwen4Exp's PLE: once per forward, so not scaled with the depth
        row.update(distinct_experts=distinct, once_ms=once,
                   **scaled(row["ms_per_step"], head_ms(program, device, B, B) + once, L, full))
        for tag, c, ms in (("", cfg, row["ms_per_step"]), ("full_", full_cfg, row["full_ms"])):
            row[f"{tag}floor_bytes"] = mw.step_bytes(c, B, args.context, distinct)
            row[f"{tag}floor_ms"] = row[f"{tag}floor_bytes"] / (bw * 1e12) * 1e3
            row[f"{tag}of_floor"] = row[f"{tag}floor_ms"] / ms if ms else None
        row["full_tokens_per_s"] = B / row["full_ms"] * 1e3 if row["full_ms"] else None
        if stats and host_gb_s:
            row.update(host_floor(row, cfg, full_cfg, host_gb_s))
        res["decode"].append(row)
        print(f"#   decode B={B}: {row['ms_per_step']:.3f} ms/step ({L} layers), full depth "
              f"{fmt(row['full_ms'], '.3f')} ms, {fmt(row['full_of_floor'], '.2f')} of the floor", flush=True)
        if profile is not None:
            print(f"#   profiled B={B}: {fmt(row['profile']['launches_per_step'])} launches/step -> {profile}", flush=True)
    before = stats() if stats else None
    p = prefill_run(program, config, device, args.prefill, args.prefill_chunk)
    if stats:
        p["experts"] = stats_delta(before, stats())
    p.update(scaled(p["seconds"] * 1e3, head_ms(program, device, 1, args.prefill), L, full))
    p["full_tokens_per_s"] = args.prefill / p["full_ms"] * 1e3 if p["full_ms"] else None
    res["prefill"] = p
    print(f"#   prefill {args.prefill}: {p['tokens_per_s']:.0f} tok/s ({L} layers)", flush=True)
    return res


def run_all_device(path: Path, cfg: dict, full_cfg: dict, args, device: str, bw: float, label: str = "all_device"
                   ) -> dict:
    """Every weight on the device; programmatic dependent launch as the model prefers it."""
    from ninfer.contract.config import StartupOptions

    options = StartupOptions(device=device, max_concurrency=max(args.batches), max_model_len=_max_len(args),
                             context_cache=False)
    t = clock()

    def run(inst) -> dict:
        res: dict = {"start_s": clock() - t, "placement": inst.memory.placement, "pdl": inst.program.pdl,
                     "graphs": inst.program.graphs is not None, "graph_note": inst.program.graph_error}
        res.update(measure(inst.program, qwen35_view(inst.config), cfg, args, device, full_cfg, bw, label=label))
        return res

    return on_instance(path, options, run)


def run_host_experts(path: Path, cfg: dict, full_cfg: dict, args, device: str, bw: float, plan: dict,
                     host_gb_s: float) -> dict:
    """The reduced model with the full-depth plan's expert cache slots per layer."""
    from ninfer.contract.config import StartupOptions
    from ninfer_qwen35.startup import HOST_EXPERTS

    if "error" in plan:
        raise RuntimeError(f"the full-depth plan under the budget failed: {plan['error']}")
    cache = plan["slots_per_layer"] * cfg["num_hidden_layers"] * mw.weight_bytes(cfg)["expert"]
    options = StartupOptions(device=device, max_concurrency=max(args.batches), max_model_len=_max_len(args),
                             context_cache=False, placement=HOST_EXPERTS, expert_cache_bytes=cache)
    t = clock()

    def run(inst) -> dict:
        if inst.memory.placement != HOST_EXPERTS:
            raise HostExpertsUnavailable(f"the start chose placement {inst.memory.placement!r} although "
                                         f"{HOST_EXPERTS!r} was asked: this tree does not honor "
                                         f"StartupOptions.placement yet")
        experts = inst.program.host_experts
        if experts is None:
            raise RuntimeError("placement host-experts started without the Program's host experts runtime")
        res: dict = {"start_s": clock() - t, "placement": inst.memory.placement, "expert_cache_bytes": cache,
                     "slots_per_layer": plan["slots_per_layer"], "memory_expert_cache_slots":
                     inst.memory.expert_cache_slots, "graphs": inst.program.graphs is not None}
        res.update(measure(inst.program, qwen35_view(inst.config), cfg, args, device, full_cfg, bw,
                           stats=lambda: experts.stats, host_gb_s=host_gb_s))
        return res

    return on_instance(path, options, run)


def run_hf(src: Path, args, device: str, heads: dict | None, layers: int, full: int) -> dict:
    """transformers ``generate`` (B=1, a ``--prefill`` prompt): its prefill and decode, scaled like ours with our
    head times (the same embedding and lm_head work; not scaled without our B=1 run)."""
    from benchmarks import hf_baseline

    res = hf_baseline.run(src, device=device, prompt=args.prefill, new_tokens=args.hf_new_tokens, batches=(1,),
                          clock=clock)
    row = res["rows"][0]
    if heads is None:
        return res
    res["decode"] = scaled(row["decode_ms_per_step"], heads["decode"], layers, full)
    res["prefill"] = scaled(row["prefill_s"] * 1e3, heads["prefill"], layers, full)
    return res


def host_floor(row: dict, cfg: dict, full_cfg: dict, host_gb_s: float) -> dict:
    """The host-bandwidth floor of a host-experts decode row (module docstring), at this depth and at full depth."""
    hit = row["experts"]["hit_rate"]
    out: dict = {}
    for tag, c, ms in (("", cfg, row["ms_per_step"]), ("full_", full_cfg, row["full_ms"])):
        missed = row["distinct_experts"] * c["num_hidden_layers"] * (1 - hit) if hit is not None else None
        host_ms = None if missed is None else missed * mw.weight_bytes(c)["expert"] / (host_gb_s * 1e9) * 1e3
        floor = None if host_ms is None else max(host_ms, row[f"{tag}floor_ms"])
        out.update({f"{tag}missed_experts": missed, f"{tag}host_floor_ms": floor,
                    f"{tag}of_host_floor": floor / ms if floor and ms else None})
    return out


def _max_len(args) -> int:
    steps = args.steps * (2 if args.profile else 1)  # a profile decodes as many steps again
    return max(args.prefill, args.context + steps + WARMUP_STEPS) + 16


def copy_bandwidth(device: str) -> float:
    """TB/s, read + written (``benchmarks.ceilings.copy_bandwidth`` on CUDA; a host copy on the CPU)."""
    from benchmarks import ceilings

    return ceilings.measure([], [], device)["copy_tb_s"]


# -- report -----------------------------------------------------------------------------------------------

def markdown(r: dict) -> str:
    from ninfer.core.sizes import format_bytes

    L, full = r["layers"], r["full_layers"]
    lines = [f"# {r['label']} {r['shape']} on {r['device']['name']} ({r['device']['device']}), torch "
             f"{r['device']['torch']}; copy {r['copy_tb_s']:.2f} TB/s",
             f"Measured at {L} layers; full depth ({full} layers) = head + {full} x (measured - head) / {L}, "
             "the floor from the full-depth config. Random weights and router: routing is uniform-like, "
             "real routers are skewed (hit rates differ)."]
    quantized = f"all-device, {r['args'].get('quantize')} weights (floor columns: bf16's)"
    for key, title in (("all_device", "all-device"), ("quantized", quantized), ("host_experts", "host experts")):
        m = r.get(key)
        if m is None:
            continue
        if "error" in m or "unavailable" in m:
            lines += ["", f"## {title}: {'FAILED' if 'error' in m else 'not run'}: {m.get('error', m.get('unavailable'))}"]
            continue
        extra = f", expert cache {m['slots_per_layer']} slots/layer" if key == "host_experts" else ""
        lines += ["", f"## {title} (start {m['start_s']:.1f} s, CUDA graphs {m['graphs']}{extra})", "",
                  f"| B | ms/step ({L} L) | tok/s ({L} L) | head ms | per-layer ms | full-depth ms | full-depth tok/s "
                  f"| floor ms (full) | of floor ({L} L / full) | distinct experts/layer | cache hit rate |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in m["decode"]:
            hit = d.get("experts", {}).get("hit_rate")
            lines.append(f"| {d['batch']} | {d['ms_per_step']:.3f} | {d['tokens_per_s']:.1f} | {d['head_ms']:.3f} "
                         f"| {fmt(d['per_layer_ms'], '.3f')} | {fmt(d['full_ms'], '.3f')} "
                         f"| {fmt(d['full_tokens_per_s'])} | {d['full_floor_ms']:.3f} "
                         f"| {fmt(d['of_floor'], '.2f')} / {fmt(d['full_of_floor'], '.2f')} "
                         f"| {d['distinct_experts']:.1f} | {fmt(hit, '.3f')} |")
        phases = [(d["batch"], d["experts"]) for d in m["decode"] if d.get("experts", {}).get("mixed_calls")]
        for B, e in phases:  # where a host-experts MoE call's host time goes
            calls = e["mixed_calls"]
            lines.append(f"- B={B}: per MoE call {e['mixed_s'] / calls * 1e3:.2f} ms on the host: waiting for the "
                         f"device {e['wait_s'] / calls * 1e3:.2f}, CPU team {e['team_s'] / calls * 1e3:.2f}, issuing "
                         f"uploads {e['upload_s'] / calls * 1e3:.2f}; {e['cache_misses'] / calls:.1f} misses, "
                         f"{(e['admitted'] + e['prefetched']) / calls:.1f} uploads per call")
        if any("host_floor_ms" in d for d in m["decode"]):
            lines += ["", f"Host-bandwidth floor (host reads {r['host_read_gb_s']:.1f} GB/s):", "",
                      f"| B | missed experts/step ({L} L / full) | host floor ms ({L} L / full) "
                      f"| of host floor ({L} L / full) |", "|---|---|---|---|"]
            lines += [f"| {d['batch']} | {fmt(d['missed_experts'])} / {fmt(d['full_missed_experts'])} "
                      f"| {fmt(d['host_floor_ms'], '.3f')} / {fmt(d['full_host_floor_ms'], '.3f')} "
                      f"| {fmt(d['of_host_floor'], '.2f')} / {fmt(d['full_of_host_floor'], '.2f')} |"
                      for d in m["decode"] if "host_floor_ms" in d]
        for d in (d for d in m["decode"] if "profile" in d):
            pr = d["profile"]
            lines.append(f"- B={d['batch']} profiled: device busy {fmt(pr['device_busy_ms_per_step'], '.3f')} ms/step, "
                         f"{fmt(pr['launches_per_step'])} launches/step; top: " + ", ".join(
                             f"{t['name'][:48]} {t['ms_per_step']:.3f} ms x{t['calls_per_step']:.0f}" for t in pr["top"][:5]))
        p = m["prefill"]
        lines.append(f"\nPrefill {p['tokens']} tokens (chunk {p['chunk']}): {p['tokens_per_s']:.0f} tok/s at {L} "
                     f"layers, {fmt(p['full_tokens_per_s'], '.0f')} tok/s at full depth")
    pairs = zip(r.get("all_device", {}).get("decode", []), r.get("quantized", {}).get("decode", []), strict=False)
    lines += [f"- {r['args']['quantize']} over bf16, decode B={b['batch']}: {q['tokens_per_s'] / b['tokens_per_s']:.2f}x"
              for b, q in pairs if b["tokens_per_s"]]
    plan = r.get("plan", {})
    if plan:
        lines.append(f"\nPlan at full depth under {format_bytes(plan['budget_bytes'])}: "
                     + (plan["error"] if "error" in plan else
                        f"{plan['expert_cache_slots']} expert cache slots ({plan['slots_per_layer']} per layer)"))
    hf = r.get("hf")
    if hf and "error" in hf:
        lines.append(f"\ntransformers failed: {hf['error']}")
    elif hf:
        row = hf["rows"][0]
        lines.append(f"\ntransformers {hf['transformers']} (fla {hf['fla']}): decode B=1 "
                     f"{row['decode_tokens_per_s']:.1f} tok/s, prefill {hf['prompt']} {row['prefill_tokens_per_s']:.0f}"
                     f" tok/s at {L} layers" + ("" if "decode" not in hf else
                     f"; full depth: decode {fmt(hf['decode']['full_ms'], '.2f')} ms/step, prefill "
                     f"{fmt(hf['prefill']['full_ms'], '.0f')} ms"))
        ours = next((d for d in r.get("all_device", {}).get("decode", []) if d["batch"] == 1), None)
        if ours and row["decode_tokens_per_s"]:
            lines.append(f"ours / transformers at B=1, {L} layers: decode "
                         f"{ours['tokens_per_s'] / row['decode_tokens_per_s']:.2f}x")
    lines += target_lines(r.get("targets", {}))
    return "\n".join(lines)


# -- entry point ------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="35b-a3b", choices=sorted(mw.BENCH_SHAPES))
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers written and run (a multiple of 4; default 4 for qwen4exp, else 8)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per row before the decode steps")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--prefill", type=int, default=4096, help="prompt tokens of the prefill run")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill unit")
    p.add_argument("--budget-gib", type=float, default=24.0, help="device budget of the host-experts plan")
    p.add_argument("--plan-max-model-len", type=int, default=None,
                   help="max_model_len of the host-experts plan (default: the model's limit)")
    p.add_argument("--hf-new-tokens", type=int, default=32)
    p.add_argument("--no-host", dest="host", action="store_false", help="skip the host-experts placement")
    p.add_argument("--quantize", choices=("fp8", "nvfp4"), default=None,
                   help="also convert with ninfer convert --quantize and run it all-device, beside bf16")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baseline")
    p.add_argument("--profile", default=None, metavar="DIR", help="also profile each all-device decode B "
                   "(torch.profiler: kernels, launches per step); tables go to DIR/profile-SHAPE-RUN-bB.txt")
    p.add_argument("--workdir", default=None, help="folder for the checkpoint and artifact (default: temp dir)")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = mw.DEFAULT_LAYERS.get(args.shape, 8)
    return args


def _validate(args) -> str | None:
    if args.layers < 4 or args.layers % 4:
        return "--layers must be a positive multiple of 4 (each group: 3 Gated DeltaNet layers + 1 attention)"
    if not all(1 <= b <= 8 for b in args.batches):
        return "--batches values must be in 1..8"
    if min(args.context, args.steps, args.prefill, args.prefill_chunk) < 1 or args.budget_gib <= 0:
        return "--context, --steps, --prefill, --prefill-chunk and --budget-gib must be positive"
    if args.plan_max_model_len is not None and args.plan_max_model_len < 2:
        return "--plan-max-model-len must be >= 2"
    if args.hf_new_tokens < 2:
        return "--hf-new-tokens must be >= 2"
    return None


def main(argv=None) -> int:
    return run_with_plugins(_run, argv)


def _run(argv) -> int:
    args = parse_args(argv)
    if (err := _validate(args)) is not None:
        print(f"moe: {err}", file=sys.stderr)
        return 2
    import torch

    from ninfer_convert.convert import convert_checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("moe: no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    cfg, full_cfg = mw.moe_config(args.shape, args.layers, reduced=True), mw.moe_config(args.shape)
    base = Path(args.workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    need = (2.05 + 0.6 * bool(args.quantize)) * mw.weight_bytes(cfg)["total"]  # checkpoint and artifacts
    if shutil.disk_usage(base).free < need:
        print(f"moe: {base} has {shutil.disk_usage(base).free / 1e9:.1f} GB free, {args.layers} layers of "
              f"{args.shape} need about {need / 1e9:.1f} GB; pass --workdir or fewer --layers", file=sys.stderr)
        return 2
    t0 = clock()
    res: dict = {"shape": args.shape, "label": label(cfg), "reduced": mw.REDUCED.get(args.shape, {}),
                 "layers": args.layers, "full_layers": full_cfg["num_hidden_layers"],
                 "config": cfg, "args": vars(args), "device": device_info(device),
                 "scaling": "full-depth time = head + full_layers x (measured - head) / layers; head = embedding, "
                            "lm_head and argmax of the same rows (and at decode Qwen4Exp's PLE, once per forward) timed "
                            "alone; floor from the full-depth config",
                 "routing_note": "random weights and router (uniform-like routing; real routers are skewed)",
                 "weights": mw.weight_bytes(cfg), "full_weights": mw.weight_bytes(full_cfg)}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2, default=str))

    workdir = Path(tempfile.mkdtemp(prefix=f"ninfer-moe-{args.shape}-", dir=base))
    failed = False
    try:
        res["copy_tb_s"] = copy_bandwidth(device)
        res["host_read_gb_s"] = host_read_bandwidth(device)
        res["plan"] = mw.expert_cache_plan(args.shape, workdir, device=device, budget_bytes=int(args.budget_gib * GIB),
                                           max_concurrency=max(args.batches), max_model_len=args.plan_max_model_len)
        src, art = workdir / "hf", workdir / f"{args.shape}-{args.layers}l.ninfer"
        t = clock()
        res["checkpoint_bytes"] = write_source(src, cfg, device, shard_bytes=2 * GIB)
        res["write_s"] = clock() - t
        res["convert_s"] = convert_checkpoint(src, art, host=plugin_host()).seconds
        if not (args.hf or args.quantize):  # the quantized artifact is converted from it after the bf16 runs
            shutil.rmtree(src)
        save()
        keys = ["all_device", *(["quantized"] if args.quantize else []), *(["host_experts"] if args.host else [])]
        for key in keys:
            print(f"# {key}", flush=True)
            try:
                common = (art, cfg, full_cfg, args, device, res["copy_tb_s"])
                if key == "quantized":  # the same weights through ninfer convert --quantize, all on the device
                    quantized = workdir / f"{args.shape}-{args.layers}l-{args.quantize}.ninfer"
                    convert_checkpoint(src, quantized, host=plugin_host(), quantize=args.quantize)
                    res[key] = run_all_device(quantized, *common[1:], label=key)
                    quantized.unlink()
                else:
                    res[key] = run_all_device(*common) if key == "all_device" else \
                        run_host_experts(*common, res["plan"], res["host_read_gb_s"])
            except HostExpertsUnavailable as exc:
                res[key] = {"unavailable": str(exc)}
                print(f"#   not run: {exc}", file=sys.stderr, flush=True)
            except Exception as exc:  # one placement's failure must not lose the other's figures
                traceback.print_exc()
                res[key] = {"error": f"{type(exc).__name__}: {exc}"}
                failed = True
            save()
        art.unlink()
        if args.hf:
            print("# transformers", flush=True)
            ours = res["all_device"]
            heads = {"decode": ours["decode"][0]["head_ms"], "prefill": ours["prefill"]["head_ms"]} \
                if "decode" in ours and ours["decode"][0]["batch"] == 1 else None
            try:
                res["hf"] = run_hf(src, args, device, heads, args.layers, full_cfg["num_hidden_layers"])
            except Exception as exc:  # the baseline is a comparison, not the measurement: keep ours
                traceback.print_exc()
                res["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ad = res.get("all_device", {})
    b1 = next((d for d in ad.get("decode", []) if d["batch"] == 1), None)
    measured = b1 and b1["full_of_floor"]
    res["targets"] = {"decode_b1_of_floor_full_depth": {"target": B1_FLOOR_TARGET, "measured": measured,
                                                        "met": None if measured is None else measured >= B1_FLOOR_TARGET}}
    res["wall_s"] = clock() - t0
    save()
    print(markdown(res))
    print(f"\n# wall time {res['wall_s']:.1f} s" + ("; FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
