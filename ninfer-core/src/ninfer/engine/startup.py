"""The runtime's model startup: artifact -> architecture plugin -> profile -> plan -> weights -> graph
calibration -> formal Program (at most one capacity correction) -> ModelInstance with its MemorySummary.

The engine dispatches on the artifact's architecture once, here. The native Startup (``ninfer.contract.Startup``)
says what the model needs and builds what it is granted; the budget, the candidate choice, the calibration and
the bounded rebuild are this module's (docs/memory.md), so every architecture starts the same way:

1. ``profile`` from the header alone; ``plan_memory`` refuses, with the numbers, a model that cannot fit
   before a weight byte is read.
2. ``load`` the chosen placement's weights.
3. On CUDA with graphs: build a calibration Program with a few KV pages and the real context, batch sizes
   and speculative setup, snapshot device memory before, after, and after destroying only its graphs, then
   destroy it. What the graphs took is the rebuild estimate charged to the formal plan.
4. Re-read free memory, plan the formal KV pool from it, build the formal Program. When that allocation falls
   short (out of memory, or the allocator ends above the budget), rebuild once with fewer automatic KV pages;
   explicit capacity and features are never cut.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING

import attrs
import torch

from ninfer.contract.config import StartupOptions
from ninfer.contract.memory import GraphMemory, MemorySummary, ModelProfile
from ninfer.contract.model import ModelInstance, Startup
from ninfer.core.device import Device
from ninfer.core.device_memory import DeviceMemory, MemorySnapshot, host_available_bytes
from ninfer.core.device_plan import DeviceRoom, MemoryPlan, PlanError, device_budget, plan_memory, sized
from ninfer.plugins import PluginHost, default_host

if TYPE_CHECKING:
    from ninfer.artifact import Artifact

CALIBRATION_PAGES = 4  # physical KV pages of the calibration Program (graphs take page ids as inputs)


def build_instance(model: str | os.PathLike, options: StartupOptions, *, host: PluginHost | None = None,
                   verify: bool = True, memory: DeviceMemory | None = None) -> tuple[ModelInstance, str, Artifact]:
    """Open ``model`` (a .ninfer artifact), find its plugin and start the ModelInstance (``instance.memory`` is
    its MemorySummary). ``verify``: check the checksum of every object the load reads. ``memory``: the device
    readings (a test's fake allocator; default: the device's own).

    Returns the instance, its public name (``metadata.name``) and the opened artifact (the engine keeps
    it alive: loaded weights may borrow its mapping)."""
    artifact = open_model(model, verify=verify)
    try:
        instance = start(native_startup(artifact, host), artifact, options, memory)
    except BaseException:
        artifact.close()
        raise
    return instance, artifact.metadata.name, artifact


def open_model(model: str | os.PathLike, *, verify: bool = True) -> Artifact:
    from ninfer.artifact import open_artifact  # lazy: keeps ``import ninfer`` light

    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model artifact {path!r} does not exist")
    return open_artifact(path, verify=verify)


def native_startup(artifact: Artifact, host: PluginHost | None = None) -> Startup:
    """The architecture's Startup (its plugin's ``startup`` slot, a class made with no arguments)."""
    arch = artifact.metadata.architecture
    target = (host or default_host()).architecture(arch).spec.load("startup")
    startup = target() if isinstance(target, type) else target
    missing = [m for m in ("profile", "load", "instance") if not callable(getattr(startup, m, None))]
    if missing:
        raise TypeError(f"the {arch!r} startup {target!r} lacks {', '.join(missing)} of ninfer.contract.Startup")
    return startup


def device_room(options: StartupOptions, snapshot: MemorySnapshot | None, *, held: int = 0) -> DeviceRoom:
    """What a plan may take: the budget less ``held`` (bytes the engine already holds), bounded by the device and
    its free memory on CUDA; the configured budget alone (or nothing) on the CPU."""
    budget = device_budget(options)
    if snapshot is None:  # a CUDA plan needs no GPU here (``ninfer plan --vram-budget``): the kind, not the device
        return DeviceRoom(is_cuda=torch.device(options.device).type == "cuda",
                          budget_bytes=None if budget is None else budget - held)
    budget = min(budget or snapshot.total, snapshot.total)
    return DeviceRoom(is_cuda=True, budget_bytes=budget - held, free_bytes=snapshot.free, total_bytes=snapshot.total)


def profile_and_plan(startup: Startup, artifact: Artifact, options: StartupOptions,
                     snapshot: MemorySnapshot | None, host_available: int | None = None
                     ) -> tuple[ModelProfile, MemoryPlan]:
    """The plan before any weight is read (``ninfer plan`` stops here). The Startup's profile declares the model's
    widths; the planner sizes its workspace and graph estimate from them (``sized``). ``host_available``: the host
    memory planned for (default: this machine's available memory)."""
    profile = startup.profile(artifact, options)
    if not isinstance(profile, ModelProfile):
        raise TypeError(f"the {artifact.metadata.architecture!r} Startup's profile returned "
                        f"{type(profile).__name__}, not a ModelProfile")
    profile = sized(profile, options)
    host = host_available_bytes() if host_available is None else host_available
    return profile, plan_memory(profile, options, device_room(options, snapshot), host_available=host)


def start(startup: Startup, artifact: Artifact, options: StartupOptions,
          memory: DeviceMemory | None = None) -> ModelInstance:
    """Start ``startup``'s model from an opened artifact (the steps of the module docstring). ``memory``: the
    device readings (default: the device's own)."""
    if not isinstance(options, StartupOptions):  # before anything reads it (the device readings do)
        raise TypeError(f"options must be StartupOptions, got {type(options).__name__}")
    memory = memory or DeviceMemory(Device.parse(options.device))
    memory.settle()
    first = memory.snapshot()
    profile, plan = profile_and_plan(startup, artifact, options, first)
    loaded = startup.load(artifact, options, plan.placement)
    graphs, seconds = GraphMemory(), 0.0
    if memory.measures and options.cuda_graphs:
        graphs, seconds = calibrate(startup, loaded, options, plan, memory)
    memory.settle()
    before = memory.snapshot()
    held = before.reserved if before is not None else plan.weights_bytes
    formal = plan_memory(profile, options, device_room(options, before, held=held), placement=plan.placement,
                         weights_resident=True, graph_bytes=graphs.rebuild_estimate if memory.measures else None,
                         host_available=plan.host.available_bytes)
    instance, formal, corrections, growth = build_formal(startup, loaded, options, formal, memory)
    program = instance.program
    if program is None:
        raise ValueError(f"architecture {artifact.metadata.architecture!r} built no Program; generation needs one")
    after = memory.snapshot()
    summary = MemorySummary(
        device=options.device, placement=plan.placement.name, budget_bytes=plan.room.budget_bytes,
        device_total_bytes=first.total if first is not None else None, weights_bytes=plan.placement.device_bytes,
        runtime_reservation_bytes=program.backing_bytes(),
        startup_retained_bytes=(before.used - first.used - plan.placement.device_bytes) if first is not None else 0,
        workspace_bytes=profile.workspace_bytes, cuda_graph=attrs.evolve(graphs, formal_growth=growth),
        kv_pages=formal.kv_pages, page_size=profile.page_size,
        kv_automatic=formal.kv_automatic, max_model_len=program.max_model_len, headroom_bytes=formal.headroom_bytes,
        reserved_bytes=after.reserved if after is not None else 0, corrections=corrections, host=formal.host,
        calibration_seconds=seconds, expert_cache_slots=formal.expert_cache_slots,
        expert_cache_bytes=formal.expert_cache_bytes, staging_bytes=formal.staging_bytes)
    return attrs.evolve(instance, memory=summary)


def calibrate(startup: Startup, loaded, options: StartupOptions, plan: MemoryPlan,
              memory: DeviceMemory) -> tuple[GraphMemory, float]:
    """Capture the complete graph set on a calibration Program (a few pages, no checkpoint slots or host cache),
    measure, drop it (the caller settles before its next reading). Returns the calibration figures and the
    seconds it took."""
    t0 = time.perf_counter()
    memory.settle()
    s0 = memory.snapshot()
    capacity = attrs.evolve(plan.capacity(kv_pages=min(plan.kv_pages, CALIBRATION_PAGES), calibration=True),
                            checkpoint_slots=0, cache_host_budget_bytes=0, host_budget_bytes=0, expert_cache_slots=0)
    program = startup.instance(loaded, options, capacity).program
    memory.settle()
    s1 = memory.snapshot()
    backing = program.backing_bytes()
    program.release_graphs()
    memory.settle()
    s2 = memory.snapshot()
    del program  # released by the caller's settle before it reads free memory again
    return GraphMemory(calibration_growth=s1.used - s0.used, retained_after_release=s2.used - s0.used - backing,
                       rebuild_estimate=max(0, s1.used - s2.used)), time.perf_counter() - t0


def build_formal(startup: Startup, loaded, options: StartupOptions, plan: MemoryPlan,
                 memory: DeviceMemory) -> tuple[ModelInstance, MemoryPlan, int, int]:
    """Build the formal Program; one correction rebuild with fewer automatic KV pages when the allocation falls
    short. Returns the instance, the plan it was built to, the corrections made (0 or 1) and the formal growth
    (device used, signed)."""
    budget = plan.room.budget_bytes
    for attempt in (0, 1):
        before = memory.snapshot()
        try:
            instance, error = startup.instance(loaded, options, plan.capacity()), None
        except torch.OutOfMemoryError as exc:
            instance, error = None, f"out of memory: {str(exc).splitlines()[0]}"
        after = memory.snapshot()
        over = 0
        if instance is not None and after is not None and before is not None and budget is not None:
            # Against the budget left beside what was held before: the new backing and graphs, plus the workspace
            # a unit will take on top of them.
            over = after.reserved - before.reserved + plan.workspace_bytes - budget
        graph_error = instance.program.graph_error if instance is not None and instance.program is not None else None
        if error is None and graph_error is not None and "out of memory" in graph_error:
            error = f"CUDA graph capture ran out of memory: {graph_error}"
        if error is None and over > 0:
            error = f"the formal allocation ended {over / 2**20:.1f} MiB above the budget"
        if error is None:
            growth = after.used - before.used if after is not None and before is not None else 0
            return instance, plan, attempt, growth
        if attempt == 1 or not plan.kv_automatic:
            why = "after one correction rebuild" if attempt else "and num_pages is explicit, so it is not cut"
            raise PlanError(f"the formal Program does not fit: {error} ({why}); lower max_concurrency, "
                            f"max_model_len or num_pages, or raise the budget")
        instance = None  # the short Program goes before the rebuild allocates
        memory.settle()
        page = plan.profile.kv_page_bytes
        cut = math.ceil(max(over, 0) / page) + max(1, plan.kv_pages // 16)  # the overshoot and a margin
        pages = plan.kv_pages - cut
        if pages < options.max_concurrency:
            raise PlanError(f"the formal Program does not fit: {error}; a correction leaves {max(pages, 0)} KV "
                            f"pages, fewer than one per concurrent sequence")
        plan = attrs.evolve(plan, kv_pages=pages, max_model_len=min(plan.max_model_len, pages * plan.profile.page_size))
    raise AssertionError("unreachable")

