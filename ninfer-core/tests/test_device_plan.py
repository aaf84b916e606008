"""The planner's arithmetic (``plan_memory``): a ModelProfile against a DeviceRoom. KV pages from what is left
(explicit pages granted or refused), max_model_len, checkpoint slots, host budgets, PDL, candidate choice,
refusals that name the numbers, and no negative figure anywhere. CUDA rooms are plain numbers here."""

from __future__ import annotations

import itertools

import attrs
import pytest
import torch

from ninfer.contract import ModelProfile, StartupOptions, WeightPlacement
from ninfer.core.device_plan import (
    CACHE_POOL_FACTOR,
    CPU_CACHE_HOST_BUDGET,
    CPU_CHECKPOINT_SLOTS,
    CPU_HOST_BUDGET,
    CPU_KV_BUDGET,
    GIB,
    HEADROOM,
    MIB,
    DeviceRoom,
    PlanError,
    graph_estimate,
    plan_memory,
    resident_bytes,
)

PAGE = 1024
SLOT = 512
WORKSPACE = 4096
GRAPHS = 8 * MIB
CPU = DeviceRoom(is_cuda=False, budget_bytes=None)


def profile(weights: int = 1000, limit: int = 64, *, host: int = 0, backing: int = 0, extra=()) -> ModelProfile:
    return ModelProfile(architecture="Toy", dtype="float32", features=("text",),
                        placements=(WeightPlacement(name="all-device", device_bytes=weights, host_bytes=host), *extra),
                        state_slot_bytes=SLOT, kv_page_bytes=PAGE, page_size=4, backing_bytes=backing,
                        workspace_bytes=WORKSPACE, graph_bytes=GRAPHS, model_limit=limit, layers=2)


def plan(prof: ModelProfile | None = None, room: DeviceRoom = CPU, device: str = "cpu", **options):
    return plan_memory(prof or profile(), StartupOptions(device=device, **options), room, host_available=None)


def cuda(budget: int, free: int | None = None) -> DeviceRoom:
    return DeviceRoom(is_cuda=True, budget_bytes=budget, free_bytes=free if free is not None else budget,
                      total_bytes=80 * GIB)


def test_explicit_pages_win_and_cap_the_model_length():
    p = plan(num_pages=5, max_concurrency=2)
    assert (p.kv_pages, p.kv_bytes, p.kv_tokens, p.kv_automatic) == (5, 5 * PAGE, 20, False)
    assert p.max_model_len == 20  # 5 pages of 4 positions, below the model's 64
    assert p.state_bytes == 3 * SLOT and p.workspace_bytes == WORKSPACE
    assert (p.headroom_bytes, p.graph_bytes, p.pdl) == (0, 0, False)  # the CPU: no headroom, no graphs
    assert plan(num_pages=100, max_model_len=30).max_model_len == 30


def test_cpu_default_budget_never_plans_more_pages_than_the_residents_and_the_cache_can_use():
    p = plan(max_concurrency=3, context_cache=False)
    assert p.kv_pages == 3 * 16 and p.max_model_len == 64  # 64 positions are 16 pages per resident
    assert (p.checkpoint_slots, p.host.cache_budget_bytes, p.host.snapshot_budget_bytes) == (0, 0, CPU_HOST_BUDGET)
    p = plan(max_concurrency=3)
    assert p.kv_pages == CACHE_POOL_FACTOR * 3 * 16  # cached prefixes share the pool
    assert p.checkpoint_slots == min(8 * 3, CPU_CHECKPOINT_SLOTS) and p.host.cache_budget_bytes == CPU_CACHE_HOST_BUDGET
    p = plan(profile(limit=1 << 24), max_concurrency=1, context_cache=False)
    assert p.kv_pages == CPU_KV_BUDGET // PAGE  # no budget on the CPU: a modest default


def test_a_cuda_plan_charges_weights_states_workspace_graphs_and_headroom_then_gives_kv_the_rest():
    p = plan(profile(limit=1 << 24), cuda(2 * GIB), device="cuda", max_concurrency=2, context_cache=False)
    fixed = 1000 + 3 * SLOT + WORKSPACE + GRAPHS + HEADROOM
    assert (p.weights_bytes, p.graph_bytes, p.headroom_bytes) == (1000, GRAPHS, HEADROOM)
    assert p.kv_pages == (2 * GIB - fixed) // PAGE
    assert p.needed_bytes <= 2 * GIB and dict(p.table())["KV pages"] == p.kv_bytes
    # free memory bounds it too
    assert plan(profile(limit=1 << 24), cuda(4 * GIB, free=2 * GIB), device="cuda", max_concurrency=2,
                context_cache=False).kv_pages == p.kv_pages
    # weights already resident (the formal plan): not charged again; the calibrated graph figure replaces the guess
    q = plan_memory(profile(limit=1 << 24), StartupOptions(device="cuda", max_concurrency=2, context_cache=False),
                    cuda(2 * GIB), weights_resident=True, graph_bytes=-5)
    assert (q.weights_bytes, q.graph_bytes) == (0, 0) and q.kv_pages == (2 * GIB - fixed + 1000 + GRAPHS) // PAGE


def test_checkpoint_slots_come_out_of_the_room():
    fixed = 1000 + 5 * SLOT + WORKSPACE
    room = 32 * SLOT * 8 + 7 * PAGE
    p = plan(profile(limit=4096), DeviceRoom(is_cuda=False, budget_bytes=fixed + room))
    assert p.checkpoint_slots == 8 * 4  # 8 per sequence: inside an eighth of the room
    assert p.kv_pages == (room - 32 * SLOT) // PAGE
    assert plan(profile(limit=4096), DeviceRoom(is_cuda=False, budget_bytes=fixed + room),
                checkpoint_slots=2).checkpoint_slots == 2


def test_a_model_that_cannot_fit_is_refused_with_the_numbers():
    with pytest.raises(PlanError, match=r"does not fit: it needs .*weights 2\.00 GiB.*headroom 1\.00 GiB.*"
                                        r"the budget allows 1\.50 GiB.*short by"):
        plan(profile(weights=2 * GIB), cuda(int(1.5 * GIB)), device="cuda")
    with pytest.raises(PlanError, match=r"KV minimum \(1000 pages\)"):
        plan(profile(), DeviceRoom(is_cuda=False, budget_bytes=1000 + 5 * SLOT + WORKSPACE + 10 * PAGE),
             num_pages=1000)
    with pytest.raises(PlanError, match="checkpoint_slots=500"):
        plan(profile(), DeviceRoom(is_cuda=False, budget_bytes=1000 + 5 * SLOT + WORKSPACE + 10 * PAGE + 8 * SLOT),
             checkpoint_slots=500)


def test_the_first_placement_candidate_that_fits_is_chosen():
    hosted = WeightPlacement(name="host-experts", device_bytes=100, host_bytes=3 * GIB)
    p = plan(profile(weights=3 * GIB, extra=(hosted,)), cuda(2 * GIB), device="cuda")
    assert p.placement.name == "host-experts" and p.host.weights_bytes == 3 * GIB
    with pytest.raises(PlanError, match="candidates tried: all-device, host-experts"):
        plan(profile(weights=3 * GIB, extra=(attrs_evolve(hosted, device_bytes=2 * GIB),)), cuda(2 * GIB),
             device="cuda")


def attrs_evolve(obj, **changes):
    import attrs

    return attrs.evolve(obj, **changes)


def test_host_weights_come_first_and_default_budgets_share_what_they_leave():
    hosted = WeightPlacement(name="host-experts", device_bytes=100, host_bytes=12 * GIB)
    p = plan_memory(profile(weights=3 * GIB, extra=(hosted,)), StartupOptions(device="cuda"), cuda(2 * GIB),
                    host_available=16 * GIB)
    assert p.placement.name == "host-experts" and p.host.snapshot_budget_bytes == GIB == p.host.cache_budget_bytes
    with pytest.raises(PlanError, match="placement 'host-experts' needs 12.00 GiB"):
        plan_memory(profile(weights=3 * GIB, extra=(hosted,)), StartupOptions(device="cuda"), cuda(2 * GIB),
                    host_available=8 * GIB)


def test_host_budgets_are_planned_against_the_host():
    p = plan_memory(profile(), StartupOptions(device="cuda"), cuda(8 * GIB), host_available=16 * GIB)
    assert p.host.snapshot_budget_bytes == 4 * GIB and p.host.cache_budget_bytes == 4 * GIB  # a quarter each
    with pytest.raises(PlanError, match="host memory: placement .all-device. needs"):
        plan_memory(profile(), StartupOptions(device="cuda", host_budget_bytes=20 * GIB), cuda(8 * GIB),
                    host_available=16 * GIB)


def test_budget_arithmetic_is_never_negative():
    """Over a grid of budgets, models and options: every figure is >= 0, a fitting plan needs at most what it
    was given, and what does not fit is refused (never a plan with negative KV)."""
    for budget, weights, conc, cache, pages in itertools.product(
            (GIB + 10_000, int(1.2 * GIB), 2 * GIB, 3 * GIB), (0, 1000, GIB // 2, GIB), (1, 3, 8), (False, True),
            (None, 1, 64)):
        try:
            p = plan(profile(weights=weights, limit=1 << 16), cuda(budget), device="cuda", max_concurrency=conc,
                     context_cache=cache, num_pages=pages)
        except PlanError:
            continue
        assert all(b >= 0 for _, b in p.table())
        assert p.kv_pages == pages if pages else p.kv_pages >= conc  # explicit pages are granted exactly
        assert p.max_model_len >= 1 and p.needed_bytes <= budget


def test_cuda_pdl_follows_the_layer_size_unless_the_options_decide():
    room = cuda(4 * GIB)
    assert plan(profile(weights=2 * MIB), room, device="cuda", num_pages=2).pdl is True  # 1 MiB a layer: small
    assert plan(profile(weights=2 * GIB), room, device="cuda", num_pages=2).pdl is False  # 1 GiB a layer
    assert plan(profile(weights=2 * MIB), room, device="cuda", num_pages=2, pdl=False).pdl is False
    assert plan(num_pages=2, pdl=True).pdl is False  # the CPU launches no Triton kernels


def test_pdl_reads_the_bytes_a_decode_step_reads_not_the_whole_expert_banks():
    """A MoE placement of 2 GiB whose one-row step reads 100 MiB (dense weights + k experts): small layers."""
    moe = ModelProfile(architecture="Toy", dtype="float32", features=("text",), placements=(
        WeightPlacement(name="all-device", device_bytes=2 * GIB, step_bytes=100 * MIB),), state_slot_bytes=SLOT,
        kv_page_bytes=PAGE, page_size=4, workspace_bytes=WORKSPACE, graph_bytes=GRAPHS, model_limit=64, layers=2)
    assert plan(moe, cuda(4 * GIB), device="cuda", num_pages=2).pdl is True


def test_graph_estimate_counts_every_batch_size_logits_and_the_speculative_sets():
    one = graph_estimate(vocab_size=1000, activation_width=10, element_size=2, max_batch=2)
    assert one == (3 * 1000 * 4 + 2 * 10 * 2 + 2 * 4 * MIB)
    assert graph_estimate(vocab_size=1000, activation_width=10, element_size=2, max_batch=2, rows_per_sequence=3,
                          graph_sets=3) > 3 * one


def test_resident_bytes_counts_each_storage_once_meta_tensors_too():
    parent = torch.zeros(10, 4)
    views = [parent[:5], parent[5:], parent.view(-1)]
    assert resident_bytes([parent, *views, torch.zeros(3, dtype=torch.float16)]) == 160 + 6
    meta = torch.empty(10, 4, device="meta")
    assert resident_bytes([meta, meta[:5], torch.empty(3, dtype=torch.float16, device="meta")]) == 160 + 6


# -- host experts: staging buffers, the expert cache, a named placement ------------------------------------------
EXPERT = 4 * MIB
STAGING = 64 * MIB
HOST_EXPERTS = WeightPlacement(name="host-experts", device_bytes=1 * GIB, host_bytes=30 * GIB,
                               staging_bytes=STAGING, expert_bytes=EXPERT, experts=1000)


def moe_profile(limit: int = 64) -> ModelProfile:
    return profile(weights=31 * GIB, limit=limit, extra=(HOST_EXPERTS,))


def test_host_experts_are_chosen_when_all_device_does_not_fit_and_the_cache_shares_with_kv():
    p = plan(moe_profile(limit=1 << 24), cuda(8 * GIB), device="cuda", context_cache=False)
    assert p.placement.name == "host-experts" and p.staging_bytes == STAGING
    assert p.expert_cache_slots > 0 and p.expert_cache_bytes == p.expert_cache_slots * EXPERT
    assert p.needed_bytes <= 8 * GIB
    # The KV pages (wanting far more than there is) and the cache split what the minimum KV leaves, near halves.
    assert abs(p.expert_cache_bytes - p.kv_bytes) <= 2 * EXPERT + 4 * PAGE
    assert p.capacity().expert_cache_slots == p.expert_cache_slots
    assert ("expert staging", STAGING) in p.table() and ("expert cache", p.expert_cache_bytes) in p.table()


def test_the_cache_takes_what_the_kv_pages_cannot_use_up_to_every_expert():
    p = plan(moe_profile(limit=64), cuda(8 * GIB), device="cuda", context_cache=False)
    useful = 64 // 4 * 4  # pages of a 64-position history for 4 sequences
    assert p.kv_pages == useful
    assert p.expert_cache_slots == min(1000, (8 * GIB - (p.needed_bytes - p.expert_cache_bytes)) // EXPERT)
    roomy = plan(moe_profile(limit=64), cuda(40 * GIB), device="cuda", context_cache=False, placement="host-experts")
    assert roomy.expert_cache_slots == 1000  # never more slots than experts


def test_explicit_expert_cache_is_charged_before_the_kv_pages_or_refused():
    p = plan(moe_profile(limit=1 << 20), cuda(8 * GIB), device="cuda", context_cache=False,
             expert_cache_bytes=100 * EXPERT + 5)
    assert p.expert_cache_slots == 100
    with pytest.raises(PlanError, match="expert cache"):
        plan(moe_profile(), cuda(4 * GIB), device="cuda", expert_cache_bytes=8 * GIB)
    assert plan(moe_profile(), cuda(8 * GIB), device="cuda", expert_cache_bytes=0).expert_cache_slots == 0


def test_a_named_placement_is_used_or_refused_with_the_names():
    p = plan(moe_profile(), cuda(80 * GIB), device="cuda", placement="host-experts")
    assert p.placement.name == "host-experts"
    assert plan(moe_profile(), cuda(80 * GIB), device="cuda").placement.name == "all-device"
    assert plan(moe_profile(), cuda(80 * GIB), device="cuda").expert_cache_slots == 0
    with pytest.raises(ValueError, match="'on-disk' is not one of this model's: all-device, host-experts"):
        plan(moe_profile(), cuda(80 * GIB), device="cuda", placement="on-disk")


def test_the_planner_sizes_the_transients_from_the_declared_widths():
    """A profile that declares its widths (``ModelShape``) gets its workspace (a full prefill chunk's
    activations) and graph estimate from the planner, the same rule for every architecture; a media encoder
    (``EncoderNeeds``) adds its peak, and on CUDA its tables."""
    from ninfer.contract import EncoderNeeds, ModelShape
    from ninfer.core.device_plan import WORKSPACE_TOKENS, sized

    shape = ModelShape(hidden_size=8, vocab_size=64, mlp_width=32, mixer_width=16)
    assert shape.activation_width == 4 * 8 + 32 + 16 + 64 // 8
    declared = attrs.evolve(profile(), shape=shape, workspace_bytes=0, graph_bytes=0)
    p = plan(declared, cuda(4 * GIB), device="cuda", max_concurrency=2, num_pages=2)
    assert p.workspace_bytes == WORKSPACE_TOKENS * shape.activation_width * 4
    assert p.graph_bytes == graph_estimate(vocab_size=64, activation_width=shape.activation_width, element_size=4,
                                           max_batch=2)
    encoder = EncoderNeeds(workspace_bytes=10 * MIB, output_bytes=MIB, cuda_cache_bytes=3 * MIB)
    with_encoder = attrs.evolve(declared, encoder=encoder)
    for device, cache in (("cpu", 0), ("cuda", 3 * MIB)):
        options = StartupOptions(device=device)
        assert sized(with_encoder, options).workspace_bytes == max(10 * MIB, p.workspace_bytes + MIB) + cache
    assert sized(profile(), StartupOptions(device="cpu")) == profile()  # no widths: its own figures stand
