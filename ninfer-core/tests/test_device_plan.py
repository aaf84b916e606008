"""DevicePlan: KV pages from the budget (explicit pages win), max_model_len, the host budget, PDL, and the
resident bytes of tensors that share storage. The CUDA branch runs on the CPU with the device's memory faked."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract import KVPoolSpec, StartupOptions, StateField, StateImageLayout
from ninfer.core.device import Device
from ninfer.core.device_plan import (
    CACHE_POOL_FACTOR,
    CPU_CACHE_HOST_BUDGET,
    CPU_CHECKPOINT_SLOTS,
    CPU_HOST_BUDGET,
    HEADROOM,
    MIB,
    WORKSPACE_TOKENS,
    PlanError,
    plan_device,
    resident_bytes,
)

POOL = KVPoolSpec(name="main", layers=2, kv_heads=2, head_dim=8, dtype="float32", page_size=4)
PAGE = 2 * 2 * 4 * 2 * 8 * 4  # K and V, layers, positions, heads, head_dim, fp32
LAYOUT = StateImageLayout(fields=[StateField(name="s", dtype="float32", shape=(64,), layers=2)])  # 512 B a slot
WIDTH = 10  # workspace: WORKSPACE_TOKENS * 10 fp32 elements
CPU = Device("cpu")


def plan(device: Device = CPU, weight_bytes: int = 1000, limit: int = 64, **options):
    return plan_device(StartupOptions(device=str(device), **options), device, compute=torch.float32,
                       weight_bytes=weight_bytes, layers=2, state_layout=LAYOUT, kv_pool=POOL, activation_width=WIDTH,
                       model_limit=limit)


def test_explicit_pages_win_and_cap_the_model_length():
    p = plan(num_pages=5, max_concurrency=2)
    assert (p.kv_pages, p.kv_page_bytes, p.kv_bytes, p.page_size) == (5, PAGE, 5 * PAGE, 4)
    assert p.max_model_len == 20  # 5 pages of 4 positions, below the model's 64
    assert p.state_bytes == 3 * 512 and p.workspace_bytes == WORKSPACE_TOKENS * WIDTH * 4
    assert (p.headroom_bytes, p.pdl, p.dtype, p.device) == (0, False, "float32", "cpu")
    assert plan(num_pages=100, max_model_len=30).max_model_len == 30


def test_cpu_default_budget_never_plans_more_pages_than_the_residents_and_the_cache_can_use():
    p = plan(max_concurrency=3, context_cache=False)
    assert p.kv_pages == 3 * 16 and p.max_model_len == 64  # 64 positions are 16 pages per resident
    assert (p.checkpoint_slots, p.cache_host_budget_bytes) == (0, 0)
    p = plan(max_concurrency=3)
    assert p.kv_pages == CACHE_POOL_FACTOR * 3 * 16  # cached prefixes share the pool
    assert p.checkpoint_slots == min(8 * 3, CPU_CHECKPOINT_SLOTS) and p.cache_host_budget_bytes == CPU_CACHE_HOST_BUDGET


def test_checkpoint_slots_come_out_of_the_budget():
    fixed = 1000 + 5 * 512 + WORKSPACE_TOKENS * WIDTH * 4
    room = 32 * 512 * 8 + 7 * PAGE
    p = plan(device_budget_bytes=fixed + room, limit=4096)
    assert p.checkpoint_slots == 8 * 4  # 8 per sequence: inside an eighth of the room
    assert p.kv_pages == (room - 32 * 512) // PAGE
    assert plan(device_budget_bytes=fixed + room // 2, limit=4096).checkpoint_slots == room // 2 // 8 // 512
    assert plan(num_pages=2, checkpoint_slots=3).checkpoint_slots == 3
    assert plan(num_pages=2, cache_host_budget_bytes=5).cache_host_budget_bytes == 5


def test_a_cpu_budget_leaves_room_after_weights_state_and_workspace():
    fixed = 1000 + 5 * 512 + WORKSPACE_TOKENS * WIDTH * 4
    assert plan(device_budget_bytes=fixed + 7 * PAGE + PAGE // 2, limit=4096, context_cache=False).kv_pages == 7
    with pytest.raises(PlanError, match="no room for KV pages: weights 0.0 MiB"):
        plan(device_budget_bytes=fixed + PAGE - 1, context_cache=False)


def test_host_budget_option_then_environment_then_default(monkeypatch):
    assert plan(num_pages=2, host_budget_bytes=0).host_budget_bytes == 0
    assert plan(num_pages=2).host_budget_bytes == CPU_HOST_BUDGET
    monkeypatch.setenv("NINFER_HOST_BUDGET_MIB", "3")
    assert plan(num_pages=2).host_budget_bytes == 3 * MIB
    assert plan(num_pages=2, host_budget_bytes=5).host_budget_bytes == 5


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of 8 GiB, ``free["bytes"]`` of it free (the CPU machine has none)."""
    free = {"bytes": 8 << 30}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 8 << 30))
    monkeypatch.delenv("NINFER_VRAM_BUDGET_MIB", raising=False)
    monkeypatch.delenv("NINFER_PDL", raising=False)
    return free


def test_cuda_budget_keeps_headroom_and_honours_the_budget_cap(fake_cuda, monkeypatch):
    cuda = Device("cuda", 0)
    fixed = 1000 + 5 * 512 + WORKSPACE_TOKENS * WIDTH * 4 + HEADROOM
    budget = fixed + 9 * PAGE + 1
    p = plan(cuda, device_budget_bytes=budget, limit=1 << 20, context_cache=False)
    assert (p.kv_pages, p.headroom_bytes) == (9, HEADROOM)
    fake_cuda["bytes"] = budget - 1000 - 4 * PAGE  # the weights are resident already: less is free than budgeted
    assert plan(cuda, device_budget_bytes=budget, limit=1 << 20, context_cache=False).kv_pages == 5
    monkeypatch.setenv("NINFER_VRAM_BUDGET_MIB", "1")  # below the headroom alone
    with pytest.raises(PlanError, match="headroom 1024 MiB"):
        plan(cuda, limit=1 << 20)


def test_cuda_pdl_follows_the_layer_size_unless_the_options_decide(fake_cuda):
    cuda = Device("cuda", 0)
    assert plan(cuda, num_pages=2, weight_bytes=2 * MIB).pdl is True  # 1 MiB a layer: small
    assert plan(cuda, num_pages=2, weight_bytes=2 << 30).pdl is False  # 1 GiB a layer
    assert plan(cuda, num_pages=2, weight_bytes=2 * MIB, pdl=False).pdl is False
    assert plan(num_pages=2, pdl=True).pdl is False  # the CPU launches no Triton kernels


def test_resident_bytes_counts_each_storage_once():
    parent = torch.zeros(10, 4)
    views = [parent[:5], parent[5:], parent.view(-1)]
    assert resident_bytes([parent, *views, torch.zeros(3, dtype=torch.float16)]) == 160 + 6
