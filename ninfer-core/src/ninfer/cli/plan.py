"""``ninfer plan [MODEL] [--vram-budget MIB] [--max-concurrency N] [--context N] [--speculative mtp] ...``: will it
fit? The startup plan, from the artifact's header alone: no weight byte is read and nothing is allocated.

It runs the start's first step (``ninfer.engine.startup.profile_and_plan``: the model's profile judged against
the device budget) and prints every category the plan charges, the bound it was judged against, the KV pages
and tokens and the context they allow, or what does not fit and by how much (exit 1). The device is CUDA by
default: on a machine with a GPU its size and free memory bound the plan (``--vram-budget`` lowers the bound);
on one without, ``--vram-budget`` alone is the GPU planned for ("will it fit on a 24 GiB GPU?"); ``--host-memory``
is the host planned for (default: this machine's available memory). The CUDA graph
figure is the profile's estimate (a start replaces it by a calibrated one). ``--vram-budget`` is one definition
for ``plan``, ``generate`` and ``serve``, with ``--placement`` and ``--expert-cache`` (``memory_args``).

Light at import (argparse and the config contract only), so ``ninfer --help`` loads no torch.
"""

from __future__ import annotations

import argparse
import json
import sys

from ninfer.cli.memory_args import add_memory_arguments, with_memory_options
from ninfer.cli.model_args import add_dtype_argument, add_model_argument
from ninfer.cli.number_args import whole_number
from ninfer.cli.speculative_args import add_speculative_arguments, speculative_features
from ninfer.cli.vision_args import add_vision_argument, with_vision
from ninfer.contract.config import MAX_CONCURRENCY, StartupOptions
from ninfer.engine.memory_report import format_bytes

FITS, DOES_NOT_FIT, BAD_INPUT = 0, 1, 2


def add_plan_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="will it fit? the memory plan from the artifact header, no weights read",
                              description="Plan a start of MODEL without loading it: weights, StateImages, "
                                          "checkpoint slots, verify records, workspace, CUDA graphs (estimate), "
                                          "headroom and KV pages against the device budget; the KV tokens and "
                                          "context that fit, or what does not fit and by how much (exit 1).")
    add_model_argument(p)
    add_memory_arguments(p)
    add_vision_argument(p)
    p.add_argument("--device", default="cuda",
                   help="cuda, cuda:N or cpu (default: cuda; without a GPU here, --vram-budget is the GPU "
                        "planned for)")
    p.add_argument("--max-concurrency", type=whole_number(1, MAX_CONCURRENCY), default=4, metavar=f"1..{MAX_CONCURRENCY}",
                   help="requests resident at once (default 4, as ninfer serve)")
    p.add_argument("--context", type=whole_number(2), metavar="TOKENS", help="context limit (default: the model's)")
    add_dtype_argument(p)
    p.add_argument("--page-size", type=whole_number(1), default=16, metavar="N", help="KV positions per page (default 16)")
    p.add_argument("--num-pages", type=whole_number(1), metavar="N", help="KV pages, exactly (default: from the budget)")
    p.add_argument("--no-context-cache", action="store_true", help="plan without the context cache")
    p.add_argument("--checkpoint-slots", type=whole_number(0), metavar="N",
                   help="device slots for context-cache checkpoints (default: from the budget)")
    p.add_argument("--host-memory", type=whole_number(1, unit=" of MiB"), metavar="MIB",
                   help="host MiB available to plan for (default: this machine's available memory): host-resident "
                        "weights (experts, n-gram tables) and host budgets are judged against it")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_speculative_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    import ninfer
    from ninfer.core.device_plan import PlanError

    try:
        model = ninfer.resolve_model_path(args.model)
        return _plan(args, model)
    except PlanError as exc:  # the planner's refusal, with its numbers
        return _refused(args, model, str(exc))
    except BrokenPipeError:
        raise  # the reader of stdout left: ninfer.cli.main ends quietly
    except (OSError, ValueError, TypeError, LookupError, RuntimeError) as exc:
        print(f"ninfer plan: {exc}", file=sys.stderr)
        return BAD_INPUT


def _plan(args: argparse.Namespace, model: str) -> int:
    from ninfer.core.device_plan import device_budget
    from ninfer.engine.startup import native_startup, open_model, profile_and_plan

    options = StartupOptions(device=args.device, max_concurrency=args.max_concurrency, max_model_len=args.context,
                             context_cache=not args.no_context_cache,
                             features=with_vision(speculative_features(args), args),
                             checkpoint_slots=args.checkpoint_slots, dtype=args.dtype, page_size=args.page_size,
                             num_pages=args.num_pages)
    options = with_memory_options(options, args)
    snapshot = _snapshot(options.device)
    if snapshot is None and options.device.startswith("cuda") and device_budget(options) is None:
        raise ValueError("no CUDA device here to plan against: give --vram-budget MIB (the GPU's memory to plan "
                         "for; NINFER_VRAM_BUDGET_MIB also sets it) or --device cpu")
    with open_model(model, verify=False) as artifact:  # the header only: nothing the plan reads is checksummed
        host_memory = None if args.host_memory is None else args.host_memory * (1 << 20)
        profile, plan = profile_and_plan(native_startup(artifact, args.host), artifact, options, snapshot,
                                         host_memory)
    if options.max_model_len is not None and options.max_model_len > profile.model_limit:
        raise ValueError(f"--context {options.max_model_len} exceeds the model's limit {profile.model_limit}")
    report = plan_report(model, options, profile, plan)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return FITS if report["fits"] else DOES_NOT_FIT


def _snapshot(device: str):
    """Free and total memory of the CUDA device planned for, when this machine has it (else None)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    from ninfer.core.device import Device
    from ninfer.core.device_memory import DeviceMemory

    return DeviceMemory(Device.parse(device)).snapshot()


def plan_report(model: str, options, profile, plan) -> dict:
    """The plan as plain data (what ``--json`` prints): every category in bytes, the bound, KV and context.
    A context asked for (``--context``) that the KV pool cannot hold is the one refusal found here: the start
    would refuse it, so it does not fit, short by the missing tokens and their KV bytes."""
    room = plan.room
    categories = {("CUDA graphs (estimate)" if name == "CUDA graphs" else name): b for name, b in plan.table()}
    report = {
        "model": model, "architecture": profile.architecture, "dtype": profile.dtype,
        "features": list(profile.features), "device": options.device, "placement": plan.placement.name,
        "max_concurrency": options.max_concurrency, "budget_bytes": room.budget_bytes, "free_bytes": room.free_bytes,
        "total_bytes": room.total_bytes, "available_bytes": room.available, "categories": categories,
        "needed_bytes": plan.needed_bytes,
        "unused_bytes": None if room.available is None else room.available - plan.needed_bytes,
        "kv_pages": plan.kv_pages, "page_size": profile.page_size, "kv_tokens": plan.kv_tokens,
        "kv_bytes_per_token": profile.kv_bytes_per_token, "kv_bound": plan.kv_bound,
        "kv_why": _kv_why(plan.kv_bound, options, plan), "model_limit": profile.model_limit,
        "context": plan.max_model_len, "full_contexts_at_once": plan.kv_tokens // plan.max_model_len,
        "expert_cache_slots": plan.expert_cache_slots, "experts": plan.placement.experts,
        "host": {"weights_bytes": plan.host.weights_bytes, "snapshot_budget_bytes": plan.host.snapshot_budget_bytes,
                 "cache_budget_bytes": plan.host.cache_budget_bytes, "available_bytes": plan.host.available_bytes},
        "fits": True, "error": None,
    }
    wanted = options.max_model_len
    if wanted is not None and plan.max_model_len < wanted:
        pages = -(-wanted // profile.page_size) - plan.kv_pages
        report.update(fits=False, error=(
            f"context {wanted:,} needs more KV than the pool holds ({plan.kv_tokens:,} tokens); short by "
            f"{wanted - plan.kv_tokens:,} tokens ({pages:,} pages, {format_bytes(pages * profile.kv_page_bytes)})"))
    return report


def render(r: dict) -> str:
    """The human-readable plan: a table of categories, the bound, KV and context, and the verdict."""
    lines = [f"plan: {r['model']}", f"  {r['architecture']} ({'+'.join(r['features'])}, {r['dtype']}) on "
             f"{r['device']}, max_concurrency {r['max_concurrency']}, placement {r['placement']}"]
    lines.append(f"  bound: {_bound(r)}")
    width = max(len(k) for k in r["categories"])
    for name, b in r["categories"].items():
        if not b:  # nothing charged (no drafts to verify, no graphs or headroom on the CPU)
            continue
        lines.append(f"    {name:<{width}}  {format_bytes(b):>11}")
    lines.append(f"    {'total':<{width}}  {format_bytes(r['needed_bytes']):>11}"
                 + (f"   ({format_bytes(r['unused_bytes'])} of the bound unused)" if r["unused_bytes"] else ""))
    lines.append(f"  KV: {r['kv_pages']:,} pages x {r['page_size']} = {r['kv_tokens']:,} tokens "
                 f"({format_bytes(r['kv_bytes_per_token'])} per token)")
    lines.append(f"      {r['kv_why']}")
    lines.append(f"  context: {r['context']:,} of the model's {r['model_limit']:,}; {r['full_contexts_at_once']:,} "
                 f"full-length sequence(s) at once")
    if r["experts"]:
        lines.append(f"  expert cache: {r['expert_cache_slots']:,} of {r['experts']:,} routed experts on the device")
    host = r["host"]
    lines.append(f"  host: Snapshots {format_bytes(host['snapshot_budget_bytes'])}, cache replicas "
                 f"{format_bytes(host['cache_budget_bytes'])}"
                 + (f", weights {format_bytes(host['weights_bytes'])}" if host["weights_bytes"] else "")
                 + (f" of {format_bytes(host['available_bytes'])} available" if host["available_bytes"] else ""))
    lines.append("fits" if r["fits"] else f"does not fit: {r['error']}")
    return "\n".join(lines)


def _kv_why(bound: str, options, plan) -> str:
    """Why the KV pool stops where it does (the planner's ``kv_bound``), and what would move it."""
    from ninfer.core.device_plan import CACHE_POOL_FACTOR, CPU_KV_BUDGET

    if bound == "num_pages":
        return "as --num-pages asks"
    if bound == "sequences":
        limit = min(plan.profile.model_limit, options.max_model_len or plan.profile.model_limit)
        cache = f", x {CACHE_POOL_FACTOR} for the context cache's prefixes" if options.context_cache else ""
        return (f"all that {options.max_concurrency} sequence(s) of {limit:,} tokens can use{cache}; more needs "
                f"a higher --max-concurrency or --context")
    if bound == "cpu_default":
        return f"the CPU's default KV budget ({format_bytes(CPU_KV_BUDGET)}); --vram-budget or --num-pages sets it"
    room = plan.room
    which = ("free device memory" if room.free_bytes is not None and (room.budget_bytes is None
                                                                     or room.free_bytes < room.budget_bytes)
             else "the budget")
    return f"what {which} leaves after the other categories; a larger --vram-budget gives more"


def _bound(r: dict) -> str:
    parts = []
    if r["budget_bytes"] is not None:
        parts.append(f"budget {format_bytes(r['budget_bytes'])}")
    if r["free_bytes"] is not None:
        parts.append(f"{format_bytes(r['free_bytes'])} free of {format_bytes(r['total_bytes'])} on the device")
    if not parts:
        return "none (the CPU without --vram-budget: KV takes the CPU default)"
    return " and ".join(parts)


def _refused(args: argparse.Namespace, model: str, message: str) -> int:
    if args.json:
        print(json.dumps({"model": model, "device": args.device, "fits": False, "error": message}, indent=2))
    else:
        print(f"plan: {model}\n  {message}\ndoes not fit")
    return DOES_NOT_FIT
