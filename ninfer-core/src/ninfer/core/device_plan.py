"""The startup planner's arithmetic: a ``ModelProfile`` judged against the device budget, before and after the
weights are resident (docs/memory.md).

One function, ``plan_memory``, answers both questions. Before loading (``ninfer plan``, and every start before a
weight byte is read) it picks the first placement candidate whose fixed needs fit and refuses, with the numbers,
when none does. Once the weights are resident and the CUDA graphs calibrated, the runtime calls it again with
what is left (``weights_resident=True``, the calibrated graph figure) to size the formal KV pool.

Fixed needs: the weights, one StateImage slot per sequence plus the scratch slot, other explicit backing
(verify records), the workspace peak, the CUDA graphs and, on CUDA, at least 1 GiB of headroom for what is
not counted exactly (design document). Context-cache checkpoint slots come next (``checkpoint_slots``, else
up to 8 per concurrent sequence within an eighth of the room). KV pages take the rest, up to what the
resident sequences could use at once (4x with the context cache: cached prefixes share the pool); an explicit
``num_pages`` is granted exactly or refused. A placement with host experts adds its staging buffers to the fixed
needs and may cache experts on the device: an explicit ``expert_cache_bytes`` is charged before the KV pages;
otherwise the cache takes half of what the minimum KV leaves (up to every expert), the KV pages the rest, and
what the KV pages cannot use goes back to the cache. The budget is ``device_budget_bytes`` (else
``NINFER_VRAM_BUDGET_MIB``, else the device); free memory is a second bound. Host budgets (paused Snapshots,
the cache's pinned replicas) are planned against the host's available memory the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import attrs

from ninfer import env
from ninfer.contract.config import StartupOptions
from ninfer.contract.memory import HostMemory, ModelProfile, ProgramCapacity, WeightPlacement
from ninfer.core.sizes import GIB, MIB, format_bytes

CPU_KV_BUDGET = 256 * MIB
CPU_HOST_BUDGET = 256 * MIB
CUDA_HOST_BUDGET = 8 * GIB
CPU_CACHE_HOST_BUDGET = 256 * MIB
CUDA_CACHE_HOST_BUDGET = 16 * GIB
HOST_DEFAULT_SHARE = 4  # a default host budget takes at most this fraction (1/n) of the available host memory
CHECKPOINT_SLOTS_PER_SEQUENCE = 8  # prompt end, turn end and grid points of a few conversations each
CPU_CHECKPOINT_SLOTS = 32
CACHE_POOL_FACTOR = 4  # KV pages beyond the residents' needs: room for cached prefixes
HEADROOM = GIB
WORKSPACE_TOKENS = 2048  # the largest prefill chunk the workspace estimate covers
GRAPH_DRIVER_BYTES = 4 * MIB  # per captured graph, before calibration measures it


# What bounds the KV pages: "num_pages" (asked for exactly), "sequences" (all the resident sequences could use at
# full context, times CACHE_POOL_FACTOR with the context cache), "room" (what the budget or free memory leaves after
# the fixed needs), "cpu_default" (CPU_KV_BUDGET: a CPU planned without a budget).
KvBound = Literal["num_pages", "sequences", "room", "cpu_default"]


class PlanError(ValueError):
    """The budget cannot hold a working instance (the message names what took the room)."""


@attrs.frozen(kw_only=True)
class DeviceRoom:
    """What the planner may take. ``budget_bytes``: the device budget left (None: unbounded, a CPU without one);
    ``free_bytes``: free device memory (None: not known); ``total_bytes``: the device's size (None: CPU)."""

    is_cuda: bool
    budget_bytes: int | None
    free_bytes: int | None = None
    total_bytes: int | None = None

    @property
    def available(self) -> int | None:
        bounds = [b for b in (self.budget_bytes, self.free_bytes) if b is not None]
        return min(bounds) if bounds else None


@attrs.frozen(kw_only=True)
class MemoryPlan:
    """The planner's answer: the chosen placement and every category in bytes (``table``), KV pages and tokens."""

    profile: ModelProfile
    placement: WeightPlacement
    room: DeviceRoom
    weights_bytes: int  # charged to this plan (0 once the weights are resident)
    state_bytes: int
    checkpoint_slots: int
    checkpoint_bytes: int
    backing_bytes: int
    workspace_bytes: int
    graph_bytes: int
    headroom_bytes: int
    staging_bytes: int
    expert_cache_slots: int
    kv_pages: int
    kv_automatic: bool
    kv_bound: KvBound  # what stopped the KV pages where they are (``ninfer plan`` explains it)
    max_model_len: int
    host: HostMemory
    pdl: bool

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.profile.kv_page_bytes

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.profile.page_size

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_cache_slots * self.placement.expert_bytes

    @property
    def needed_bytes(self) -> int:
        return sum(b for _, b in self.table())

    def table(self) -> list[tuple[str, int]]:
        """(category, bytes) of everything this plan charges to the device."""
        return [("weights", self.weights_bytes), ("StateImages", self.state_bytes),
                ("checkpoint slots", self.checkpoint_bytes), ("verify records", self.backing_bytes),
                ("workspace", self.workspace_bytes), ("CUDA graphs", self.graph_bytes),
                ("headroom", self.headroom_bytes), ("expert staging", self.staging_bytes),
                ("expert cache", self.expert_cache_bytes), ("KV pages", self.kv_bytes)]

    def capacity(self, *, kv_pages: int | None = None, calibration: bool = False) -> ProgramCapacity:
        """The ProgramCapacity this plan grants (``kv_pages``: a calibration build's few pages)."""
        return ProgramCapacity(kv_pages=kv_pages or self.kv_pages, max_model_len=self.max_model_len,
                               checkpoint_slots=self.checkpoint_slots, host_budget_bytes=self.host.snapshot_budget_bytes,
                               cache_host_budget_bytes=self.host.cache_budget_bytes, pdl=self.pdl,
                               calibration=calibration, expert_cache_slots=self.expert_cache_slots)


def resident_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct storages behind ``tensors``: views of one parent count once (meta tensors too, so a
    profile built on the meta device counts exactly what a real build allocates); a quantized weight counts its
    planes."""
    from ninfer.ops.quant import QuantizedWeight

    seen: dict[int, int] = {}
    for plane in (p for t in tensors for p in (t.planes() if isinstance(t, QuantizedWeight) else (t,))):
        storage = plane.untyped_storage()
        seen[storage._cdata] = storage.nbytes()  # the StorageImpl: one per allocation, shared by its views
    return sum(seen.values())


ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
SPECULATIVE_GRAPH_SETS = 3  # per B, a speculative Program: its plain decode and the verify unit's two stages


def sized(profile: ModelProfile, options: StartupOptions) -> ModelProfile:
    """``profile`` with its workspace and CUDA graph estimate computed from its ``shape`` (a profile without a
    shape keeps its own figures). The workspace is a full prefill chunk's activations; with a media encoder,
    the larger of its call and that chunk beside the encoder's output rows, plus its tables on CUDA."""
    shape = profile.shape
    if shape is None:
        return profile
    size, width = ELEMENT_SIZE[profile.dtype], shape.activation_width
    workspace = WORKSPACE_TOKENS * width * size
    encoder = profile.encoder
    if encoder is not None:
        cache = encoder.cuda_cache_bytes if options.device.startswith("cuda") else 0
        workspace = max(encoder.workspace_bytes, workspace + encoder.output_bytes) + cache
    k = options.features.draft_tokens
    graphs = graph_estimate(vocab_size=shape.vocab_size, activation_width=width, element_size=size,
                            max_batch=options.max_concurrency, rows_per_sequence=k + 1,
                            graph_sets=SPECULATIVE_GRAPH_SETS if k else 1)
    return attrs.evolve(profile, workspace_bytes=workspace, graph_bytes=graphs)


def graph_estimate(*, vocab_size: int, activation_width: int, element_size: int, max_batch: int,
                   rows_per_sequence: int = 1, graph_sets: int = 1) -> int:
    """A CUDA graph set before calibration: each captured B keeps its fp32 logits rows alive in the shared pool,
    the largest B's activations are the pool's transient peak, and the driver keeps some memory per graph."""
    rows = sum(range(1, max_batch + 1)) * rows_per_sequence
    peak = max_batch * rows_per_sequence * activation_width * element_size
    return graph_sets * (rows * vocab_size * 4 + peak + max_batch * GRAPH_DRIVER_BYTES)


def device_budget(options: StartupOptions) -> int | None:
    """The configured device budget: ``device_budget_bytes``, else ``NINFER_VRAM_BUDGET_MIB``, else None."""
    if options.device_budget_bytes is not None:
        return options.device_budget_bytes
    mib = env.get("NINFER_VRAM_BUDGET_MIB")
    return None if mib is None else mib * MIB


def plan_memory(profile: ModelProfile, options: StartupOptions, room: DeviceRoom, *,
                placement: WeightPlacement | None = None, weights_resident: bool = False,
                graph_bytes: int | None = None, host_available: int | None = None) -> MemoryPlan:
    """Plan one Program. ``placement``: the candidate already chosen (else the first that fits);
    ``weights_resident``: the weights are loaded and ``room`` is what is left beside them; ``graph_bytes``: the
    calibrated graph figure (else the profile's estimate); ``host_available``: the host's available bytes."""
    profile = sized(profile, options)  # a profile straight from a Startup declares widths, not bytes
    limit = min(profile.model_limit, options.max_model_len or profile.model_limit)
    page_bytes = profile.kv_page_bytes
    useful = _pages_for(limit, profile.page_size) * options.max_concurrency  # more could never run at once
    if options.context_cache:
        useful *= CACHE_POOL_FACTOR
    state = profile.state_slot_bytes * (options.max_concurrency + 1)
    headroom = HEADROOM if room.is_cuda else 0
    graphs = (profile.graph_bytes if graph_bytes is None else max(0, graph_bytes)) if room.is_cuda else 0
    candidates = (placement,) if placement is not None else _candidates(profile, options)
    minimum = options.num_pages or options.max_concurrency  # at least one page per concurrent sequence
    avail = room.available
    plan = None
    for cand in candidates:
        weights = 0 if weights_resident else cand.device_bytes
        fixed = (weights + state + profile.backing_bytes + profile.workspace_bytes + graphs + headroom
                 + cand.staging_bytes + _explicit_cache(options, cand) * cand.expert_bytes)
        if avail is None or fixed + minimum * page_bytes <= avail:
            plan = (cand, weights, fixed)
            break
    if plan is None:  # the numbers of the most frugal candidate (the last)
        cand = candidates[-1]
        weights = 0 if weights_resident else cand.device_bytes
        parts = [("weights", weights), ("StateImages", state), ("verify records", profile.backing_bytes),
                 ("workspace", profile.workspace_bytes), ("CUDA graphs", graphs), ("headroom", headroom),
                 ("expert staging", cand.staging_bytes),
                 ("expert cache", _explicit_cache(options, cand) * cand.expert_bytes),
                 (f"KV minimum ({minimum} pages)", minimum * page_bytes)]
        need = sum(b for _, b in parts)
        raise PlanError(
            f"{profile.architecture} ({'+'.join(profile.features)}, {profile.dtype}) does not fit: it needs "
            f"{format_bytes(need)} ({', '.join(f'{k} {format_bytes(b)}' for k, b in parts if b)}) but {_room(room)}; short by "
            f"{format_bytes(need - avail)}" + (f" (placement {cand.name}; candidates tried: "
                                               f"{', '.join(c.name for c in candidates)})" if len(candidates) > 1 else ""))
    cand, weights, fixed = plan
    host = plan_host(options, room.is_cuda, cand, host_available)
    left = None if avail is None else avail - fixed
    cache_slots = _explicit_cache(options, cand)
    auto_cache = left is not None and options.expert_cache_bytes is None and cand.expert_bytes > 0
    slots = _checkpoint_slots(options, profile.state_slot_bytes, left)
    checkpoint = slots * profile.state_slot_bytes
    if options.num_pages is not None:
        pages = options.num_pages
        if left is not None and checkpoint + pages * page_bytes > left:
            raise PlanError(f"num_pages={pages} needs {format_bytes(pages * page_bytes)} of KV, but after the fixed needs "
                            f"({format_bytes(fixed)}) and {slots} checkpoint slots ({format_bytes(checkpoint)}) {_room(room)} "
                            f"leaves {format_bytes(max(0, left - checkpoint))}")
    else:
        kv_room = CPU_KV_BUDGET if left is None else left - checkpoint
        if auto_cache:
            share = max(0, kv_room - minimum * page_bytes) // 2
            cache_slots = min(cand.experts, share // cand.expert_bytes)
            kv_room -= cache_slots * cand.expert_bytes
        pages = min(max(0, kv_room) // page_bytes, useful)
        if pages < minimum:  # the checkpoint slots took it: the fixed needs alone were judged to fit
            if options.checkpoint_slots:
                raise PlanError(f"checkpoint_slots={slots} ({format_bytes(checkpoint)}) leave fewer than {minimum} KV "
                                f"pages after the fixed needs ({format_bytes(fixed)}); {_room(room)}")
            slots, checkpoint = 0, 0
            if auto_cache:
                cache_slots = 0
            pages = min(max(0, left) // page_bytes, useful) if left is not None else useful
    bound: KvBound = ("num_pages" if options.num_pages is not None else "sequences" if pages == useful
                      else "cpu_default" if left is None else "room")
    if auto_cache:  # the cache also takes what the KV pages cannot use
        spare = left - checkpoint - pages * page_bytes - cache_slots * cand.expert_bytes
        cache_slots += max(0, min(cand.experts - cache_slots, spare // cand.expert_bytes))
    return MemoryPlan(profile=profile, placement=cand, room=room, weights_bytes=weights, state_bytes=state,
                      checkpoint_slots=slots, checkpoint_bytes=checkpoint, backing_bytes=profile.backing_bytes,
                      workspace_bytes=profile.workspace_bytes, graph_bytes=graphs, headroom_bytes=headroom,
                      staging_bytes=cand.staging_bytes, expert_cache_slots=int(cache_slots),
                      kv_pages=int(pages), kv_automatic=options.num_pages is None, kv_bound=bound,
                      max_model_len=min(limit, int(pages) * profile.page_size), host=host,
                      pdl=_pdl(options, room.is_cuda, cand.step_read_bytes / profile.layers))


def _candidates(profile: ModelProfile, options: StartupOptions) -> tuple[WeightPlacement, ...]:
    """The profile's placement candidates, or the one ``options.placement`` names."""
    if options.placement is None:
        return profile.placements
    chosen = tuple(c for c in profile.placements if c.name == options.placement)
    if not chosen:  # bad input, not a budget too small
        raise ValueError(f"placement {options.placement!r} is not one of this model's: "
                        f"{', '.join(c.name for c in profile.placements)}")
    return chosen


def _explicit_cache(options: StartupOptions, placement: WeightPlacement) -> int:
    """Expert cache slots an explicit ``expert_cache_bytes`` asks for (0 without experts to cache)."""
    if options.expert_cache_bytes is None or not placement.expert_bytes:
        return 0
    return min(placement.experts, options.expert_cache_bytes // placement.expert_bytes)


def plan_host(options: StartupOptions, is_cuda: bool, placement: WeightPlacement,
              available: int | None) -> HostMemory:
    """Host budgets: explicit ones must fit the available memory with the host weights; defaults (8 GiB of
    Snapshots and 16 GiB of cache replicas on CUDA, 256 MiB each on the CPU) take at most a quarter each of what
    the host weights leave."""
    left = None if available is None else max(0, available - placement.host_bytes)

    def pick(explicit: int | None, variable: str, default: int) -> tuple[int, bool]:
        if explicit is None:
            mib = env.get(variable)
            explicit = None if mib is None else mib * MIB
        if explicit is not None:
            return explicit, True
        return (default if left is None else min(default, left // HOST_DEFAULT_SHARE)), False

    snapshots, s_explicit = pick(options.host_budget_bytes, "NINFER_HOST_BUDGET_MIB",
                                 CUDA_HOST_BUDGET if is_cuda else CPU_HOST_BUDGET)
    cache, c_explicit = (0, False) if not options.context_cache else pick(
        options.cache_host_budget_bytes, "NINFER_CACHE_HOST_BUDGET_MIB",
        CUDA_CACHE_HOST_BUDGET if is_cuda else CPU_CACHE_HOST_BUDGET)
    host = HostMemory(weights_bytes=placement.host_bytes, snapshot_budget_bytes=snapshots, cache_budget_bytes=cache,
                      available_bytes=available)
    if available is not None and (s_explicit or c_explicit or placement.host_bytes) and host.planned_bytes > available:
        raise PlanError(f"host memory: placement {placement.name!r} needs {format_bytes(host.planned_bytes)} (host weights "
                        f"{format_bytes(placement.host_bytes)}, Snapshot budget {format_bytes(snapshots)}, cache replicas "
                        f"{format_bytes(cache)}) but {format_bytes(available)} is available")
    return host


def _pdl(options: StartupOptions, is_cuda: bool, layer_bytes: float) -> bool:
    if not is_cuda:
        return False
    if options.pdl is not None:
        return options.pdl
    from ninfer.ops.launch import prefers_pdl

    return prefers_pdl(layer_bytes)


def _checkpoint_slots(options: StartupOptions, slot_bytes: int, room: int | None) -> int:
    """Device StateImage slots for checkpoints: the explicit count, else a few per concurrent sequence within
    an eighth of the room (CPU without a budget: a fixed count)."""
    if not options.context_cache:
        return 0
    if options.checkpoint_slots is not None:
        return options.checkpoint_slots
    want = CHECKPOINT_SLOTS_PER_SEQUENCE * options.max_concurrency
    if room is None:
        return min(want, CPU_CHECKPOINT_SLOTS)
    if slot_bytes == 0:
        return want
    return max(0, min(want, room // 8 // slot_bytes))


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _room(room: DeviceRoom) -> str:
    parts = []
    if room.budget_bytes is not None:
        parts.append(f"the budget allows {format_bytes(room.budget_bytes)}")
    if room.free_bytes is not None:
        parts.append(f"{format_bytes(room.free_bytes)} is free on the device")
    return " and ".join(parts) or "nothing bounds it"
