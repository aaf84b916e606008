"""Startup memory contracts: what a model needs (``ModelProfile``, before any weight byte is read), what the
runtime grants its Program (``ProgramCapacity``) and what the start actually took (``MemorySummary``).

The runtime's planner (``ninfer.core.device_plan``) judges a profile's placement candidates against the device
budget, calibrates the CUDA graphs once the weights are resident and sizes the KV pool from what is left
(docs/memory.md). Every figure is in bytes; differences of memory snapshots are signed.
"""

from __future__ import annotations

import attrs
from attrs import validators as v

_bytes = v.and_(v.instance_of(int), v.ge(0))


@attrs.frozen(kw_only=True)
class WeightPlacement:
    """One way to place the fixed weights (a startup candidate): bytes resident on the device and on the host.
    All-device is the only candidate of a dense model; a MoE model adds host placements for its experts.

    A placement with host experts also needs ``staging_bytes`` of device memory (the buffers whole layers stream
    through for long token runs) and may cache experts on the device: ``expert_bytes`` is one cacheable expert
    (0: nothing to cache), ``experts`` how many there are (the cache never needs more slots).

    ``step_bytes``: the weight bytes a one-row decode step reads (a MoE model's dense weights and k experts per
    layer, not its whole banks); 0 means all of ``device_bytes`` (a dense model). Launch choices that depend on
    how large a step's kernels are (programmatic dependent launch) read it."""

    name: str
    device_bytes: int = attrs.field(validator=_bytes)
    host_bytes: int = attrs.field(default=0, validator=_bytes)
    staging_bytes: int = attrs.field(default=0, validator=_bytes)
    expert_bytes: int = attrs.field(default=0, validator=_bytes)
    experts: int = attrs.field(default=0, validator=_bytes)
    step_bytes: int = attrs.field(default=0, validator=_bytes)

    @property
    def step_read_bytes(self) -> int:
        """The weight bytes a one-row decode step reads: ``step_bytes``, or all of ``device_bytes`` when 0."""
        return self.step_bytes or self.device_bytes


_width = v.and_(v.instance_of(int), v.ge(0))


@attrs.frozen(kw_only=True)
class ModelShape:
    """A model's per-token widths, declared by its plugin: the runtime's planner sizes a unit's transient memory
    (the prefill workspace, the CUDA graph estimate) from them, the same way for every architecture.

    ``hidden_size``: the residual stream. ``vocab_size``: the logits row. ``mlp_width``: elements per token the
    feed-forward activations hold at once (gate and up of what runs: a MoE layer's routed and shared experts and
    its router logits). ``mixer_width``: elements per token the widest token mixer's projections hold at once
    (attention's q, k and v; a linear-attention layer's convolution input and output)."""

    hidden_size: int = attrs.field(validator=v.and_(v.instance_of(int), v.gt(0)))
    vocab_size: int = attrs.field(validator=v.and_(v.instance_of(int), v.gt(0)))
    mlp_width: int = attrs.field(validator=_width)
    mixer_width: int = attrs.field(validator=_width)

    @property
    def activation_width(self) -> int:
        """Elements per token a prefill chunk holds at once: the residual stream and its normed copies and
        projections, the MLP, the mixer, and an eighth of a logits row (the chunk's last rows only)."""
        return 4 * self.hidden_size + self.mlp_width + self.mixer_width + self.vocab_size // 8


@attrs.frozen(kw_only=True)
class EncoderNeeds:
    """A media encoder's device bytes for the largest item one request can carry: ``workspace_bytes`` (its call
    over that item), ``output_bytes`` (the item's output rows, held through the prefill chunk that places them)
    and ``cuda_cache_bytes`` (tables it keeps on a CUDA device)."""

    workspace_bytes: int = attrs.field(validator=_bytes)
    output_bytes: int = attrs.field(validator=_bytes)
    cuda_cache_bytes: int = attrs.field(default=0, validator=_bytes)


@attrs.frozen(kw_only=True)
class ModelProfile:
    """What one model needs, computed from the artifact's header, its bindings and the selected features alone.

    ``placements``: weight candidates, preferred first. ``state_slot_bytes``: one StateImage slot (a sequence's
    fixed state; 0 for a pure-attention model). ``kv_page_bytes`` / ``page_size``: one page of the paged KV pool
    and the positions it holds. ``backing_bytes``: other explicit Program backing sized by the options (verify
    records of a speculative unit, live until the commit boundary). ``shape`` / ``encoder``: the widths (and media
    encoder) the planner sizes the transient figures from (``ninfer.core.device_plan.sized``). ``workspace_bytes``:
    the transient peak of a unit (sequentially exclusive scratch, taken at its largest: a full prefill chunk).
    ``graph_bytes``: an estimate of the CUDA graph set (replaced by the calibrated figure once weights are
    resident). Both are the planner's from ``shape``; a profile without a shape gives them itself.
    ``model_limit``: the longest history the model supports. ``layers``: decoder layers the weights spread over.
    """

    architecture: str
    dtype: str
    features: tuple[str, ...] = attrs.field(converter=tuple)
    placements: tuple[WeightPlacement, ...] = attrs.field(converter=tuple, validator=v.min_len(1))
    state_slot_bytes: int = attrs.field(validator=_bytes)
    kv_page_bytes: int = attrs.field(validator=v.and_(v.instance_of(int), v.gt(0)))
    page_size: int = attrs.field(validator=v.and_(v.instance_of(int), v.gt(0)))
    backing_bytes: int = attrs.field(default=0, validator=_bytes)
    shape: ModelShape | None = attrs.field(default=None, validator=v.optional(v.instance_of(ModelShape)))
    encoder: EncoderNeeds | None = attrs.field(default=None, validator=v.optional(v.instance_of(EncoderNeeds)))
    workspace_bytes: int = attrs.field(default=0, validator=_bytes)
    graph_bytes: int = attrs.field(default=0, validator=_bytes)
    model_limit: int = attrs.field(validator=v.and_(v.instance_of(int), v.gt(0)))
    layers: int = attrs.field(validator=v.and_(v.instance_of(int), v.gt(0)))

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_page_bytes / self.page_size


@attrs.frozen(kw_only=True)
class ProgramCapacity:
    """What the runtime grants a Program: the native Startup passes it, unchanged, to the Program it builds.

    ``kv_pages``: usable KV pages (the Program adds its scratch page). ``max_model_len``: the longest history
    (None: what the pages hold; a direct build's choice); in a ``calibration`` build it is the planned context although the few pages cannot hold it (the graphs are
    captured for the real context; a calibration Program never runs a sequence). ``checkpoint_slots`` /
    ``cache_host_budget_bytes``: the context cache's device StateImages and pinned host bytes.
    ``host_budget_bytes``: host bytes paused Snapshots may hold. ``pdl``: programmatic dependent launch.
    ``expert_cache_slots``: device slots of the host experts' cache (one expert each; 0 with all-device weights).
    """

    kv_pages: int = attrs.field(validator=v.and_(v.instance_of(int), v.ge(1)))
    max_model_len: int | None = attrs.field(default=None, validator=v.optional(v.and_(v.instance_of(int), v.ge(1))))
    checkpoint_slots: int = attrs.field(default=0, validator=_bytes)
    host_budget_bytes: int = attrs.field(default=0, validator=_bytes)
    cache_host_budget_bytes: int = attrs.field(default=0, validator=_bytes)
    pdl: bool = False
    calibration: bool = False
    expert_cache_slots: int = attrs.field(default=0, validator=_bytes)


@attrs.frozen(kw_only=True)
class GraphMemory:
    """The CUDA graph set's memory, from device snapshots (driver and lazy-loading included, so not a pure
    allocation figure). ``calibration_growth``: preparing the calibration Program (its few pages and every graph).
    ``retained_after_release``: what stayed after only its graphs were destroyed, beyond its explicit backing
    (already in the next baseline, so not charged again). ``rebuild_estimate``: what the graphs took, charged
    to the formal plan (0 allowed). ``formal_growth``: preparing the formal Program. All signed."""

    calibration_growth: int = 0
    retained_after_release: int = 0
    rebuild_estimate: int = 0
    formal_growth: int = 0


@attrs.frozen(kw_only=True)
class HostMemory:
    """Host bytes the start planned: resident host weights, the Snapshot budget of paused requests, the context
    cache's pinned replicas, and what the host had available when planned (None: unknown)."""

    weights_bytes: int = 0
    snapshot_budget_bytes: int = 0
    cache_budget_bytes: int = 0
    available_bytes: int | None = None

    @property
    def planned_bytes(self) -> int:
        return self.weights_bytes + self.snapshot_budget_bytes + self.cache_budget_bytes


@attrs.frozen(kw_only=True)
class MemorySummary:
    """What a start took (``Engine.memory``; printed at startup, exported in ``/metrics``).

    ``budget_bytes``: the device budget (None on a CPU without one). ``weights_bytes``: resident device weights.
    ``runtime_reservation_bytes``: the Program's explicit backing only (StateImages, KV pages, checkpoint
    slots, verify records). ``startup_retained_bytes``: device growth before the formal Program was allocated,
    less the weights (CUDA context, kernels, calibration leftovers). ``workspace_bytes``: the planned transient
    peak. ``kv_automatic``: the KV capacity came from the budget (not ``num_pages``). ``corrections``: capacity
    rebuilds after a formal allocation fell short (0 or 1). ``reserved_bytes``: what the caching allocator held
    once the start was done. ``expert_cache_slots`` / ``expert_cache_bytes``: the host experts' device cache;
    ``staging_bytes``: the device buffers whole host-expert layers stream through.
    """

    device: str
    placement: str
    budget_bytes: int | None
    device_total_bytes: int | None
    weights_bytes: int
    runtime_reservation_bytes: int
    startup_retained_bytes: int
    workspace_bytes: int
    cuda_graph: GraphMemory
    kv_pages: int
    page_size: int
    kv_automatic: bool
    max_model_len: int
    headroom_bytes: int
    reserved_bytes: int
    corrections: int
    host: HostMemory
    calibration_seconds: float = 0.0
    expert_cache_slots: int = 0
    expert_cache_bytes: int = 0
    staging_bytes: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size


__all__ = ["EncoderNeeds", "GraphMemory", "HostMemory", "MemorySummary", "ModelProfile", "ModelShape",
           "ProgramCapacity", "WeightPlacement"]
