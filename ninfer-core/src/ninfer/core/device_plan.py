"""What a native Startup decides about the device before it builds its Program: how many KV pages fit,
the longest history they allow, the host bytes paused Snapshots may hold, the context cache's checkpoint
slots and host bytes, and whether launches use PDL.

The KV pool takes what the device budget leaves after the resident weights, the StateImage slots (one
per sequence and the scratch slot), a workspace estimate and, on CUDA, a fixed headroom of 1 GiB for what
is not counted exactly (design document); on the CPU a modest default applies unless a budget is given.
An explicit ``num_pages`` wins. With the context cache on, checkpoint StateImage slots come out of the
budget first (``checkpoint_slots``, else up to 8 per concurrent sequence within an eighth of the room),
and the KV pool may grow to 4x what the resident sequences could use at once (cached prefixes share
it). Budgets follow ``StartupOptions``: ``NINFER_VRAM_BUDGET_MIB`` caps the CUDA
budget when ``device_budget_bytes`` is None, ``NINFER_HOST_BUDGET_MIB`` sets the host budget when
``host_budget_bytes`` is None. PDL pays for small decoder layers only (``ops.triton._pdl.prefers_pdl``).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

from ninfer import env
from ninfer.contract.config import StartupOptions
from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.device import Device, dtype_name
from ninfer.core.kv_pool import PagedKVPool, pages_for

GIB = 1 << 30
MIB = 1 << 20
CPU_KV_BUDGET = 256 * MIB
CPU_HOST_BUDGET = 256 * MIB
CUDA_HOST_BUDGET = 8 * GIB
CPU_CACHE_HOST_BUDGET = 256 * MIB
CUDA_CACHE_HOST_BUDGET = 16 * GIB
CHECKPOINT_SLOTS_PER_SEQUENCE = 8  # prompt end, turn end and grid points of a few conversations each
CPU_CHECKPOINT_SLOTS = 32
CACHE_POOL_FACTOR = 4  # KV pages beyond the residents' needs: room for cached prefixes
HEADROOM = GIB
WORKSPACE_TOKENS = 2048  # the largest prefill chunk the workspace estimate covers


class PlanError(ValueError):
    """The budget cannot hold a working instance (the message names what took the room)."""


@attrs.frozen(kw_only=True)
class DevicePlan:
    """What Startup decided, in bytes and pages; the Program keeps it as ``program.plan``."""

    device: str
    dtype: str
    weight_bytes: int
    state_bytes: int
    workspace_bytes: int
    headroom_bytes: int
    kv_page_bytes: int
    kv_pages: int
    page_size: int
    max_model_len: int
    host_budget_bytes: int
    pdl: bool
    checkpoint_slots: int = 0
    cache_host_budget_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.kv_page_bytes * self.kv_pages


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: views of one parent count once."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _env_bytes(name: str) -> int | None:
    mib = env.get(name)
    return None if mib is None else mib * MIB


def plan_device(options: StartupOptions, device: Device, *, compute: torch.dtype, weight_bytes: int, layers: int,
                state_layout: StateImageLayout, kv_pool: KVPoolSpec, activation_width: int,
                model_limit: int) -> DevicePlan:
    """Plan one Program on ``device``. ``weight_bytes``: resident weights (``resident_bytes``); ``layers``:
    decoder layers they are spread over (for the PDL choice); ``activation_width``: elements per token of the
    activations a prefill chunk holds at once (the workspace estimate); ``model_limit``: the longest history
    the model supports (its max_position_embeddings)."""
    limit = min(model_limit, options.max_model_len or model_limit)
    page_size, page_bytes = kv_pool.page_size, PagedKVPool.page_bytes(kv_pool)
    slot_bytes = state_layout.nbytes_per_slot
    state_bytes = slot_bytes * (options.max_concurrency + 1)
    workspace = WORKSPACE_TOKENS * activation_width * torch.empty((), dtype=compute).element_size()
    headroom, num_pages = 0, options.num_pages
    room = None
    if device.is_cuda:
        headroom = HEADROOM
        torch.cuda.empty_cache()  # loading staged through the caching allocator: return that first
        free, total = torch.cuda.mem_get_info(device.torch)
        budget = min(options.device_budget_bytes or _env_bytes("NINFER_VRAM_BUDGET_MIB") or total, total)
        # The weights are resident already: what is free now is what the stores can still take.
        room = min(budget - weight_bytes, free) - state_bytes - workspace - headroom
    elif options.device_budget_bytes is not None:
        room = options.device_budget_bytes - weight_bytes - state_bytes - workspace
    slots = _checkpoint_slots(options, device, slot_bytes, room)
    if room is not None:
        room -= slots * slot_bytes
    if num_pages is None:
        useful = pages_for(limit, page_size) * options.max_concurrency  # more could never run at once
        if options.context_cache:
            useful *= CACHE_POOL_FACTOR
        room = CPU_KV_BUDGET if room is None else room
        num_pages = min(room // page_bytes, useful) if room > 0 else 0
        if num_pages < 1:
            raise PlanError(
                f"the device budget leaves no room for KV pages: weights {weight_bytes / MIB:.1f} MiB, StateImages "
                f"{state_bytes / MIB:.1f} MiB, checkpoint slots {slots * slot_bytes / MIB:.1f} MiB, workspace {workspace / MIB:.1f} MiB, headroom {headroom / MIB:.0f} MiB; "
                f"one page needs {page_bytes / MIB:.3f} MiB")
    host_budget = options.host_budget_bytes
    if host_budget is None:
        host_budget = _env_bytes("NINFER_HOST_BUDGET_MIB")
        host_budget = host_budget if host_budget is not None else (
            CUDA_HOST_BUDGET if device.is_cuda else CPU_HOST_BUDGET)
    pdl = False
    if device.is_cuda:
        from ninfer.ops.triton._pdl import prefers_pdl

        pdl = options.pdl if options.pdl is not None else prefers_pdl(weight_bytes / layers)
    cache_host = 0
    if options.context_cache:
        cache_host = options.cache_host_budget_bytes
        if cache_host is None:
            cache_host = _env_bytes("NINFER_CACHE_HOST_BUDGET_MIB")
        if cache_host is None:
            cache_host = CUDA_CACHE_HOST_BUDGET if device.is_cuda else CPU_CACHE_HOST_BUDGET
    return DevicePlan(device=str(device), dtype=dtype_name(compute), weight_bytes=weight_bytes,
                      checkpoint_slots=slots, cache_host_budget_bytes=cache_host,
                      state_bytes=state_bytes, workspace_bytes=workspace, headroom_bytes=headroom,
                      kv_page_bytes=page_bytes, kv_pages=int(num_pages), page_size=page_size,
                      max_model_len=min(limit, int(num_pages) * page_size), host_budget_bytes=host_budget, pdl=pdl)


def _checkpoint_slots(options: StartupOptions, device: Device, slot_bytes: int, room: int | None) -> int:
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
