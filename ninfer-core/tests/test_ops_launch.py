"""Launch context (ninfer/ops/launch.py): arrival counters belong to an owner (a Program) that frees them, and a
launch scope routes the kernels' counters to its owner; outside any scope they are the process-wide ones."""

from __future__ import annotations

import threading

import torch

from ninfer.ops import launch


def test_an_owner_holds_its_counters_until_released():
    owner = launch.Arrivals()
    cpu = torch.device("cpu")
    first = owner.counters(cpu, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert owner.counters(cpu, 10) is first  # one buffer while it is large enough
    grown = owner.counters(cpu, 5000)
    assert grown.numel() >= 5000 and grown is not first
    assert owner.nbytes() == (first.numel() + grown.numel()) * 4  # the outgrown one is kept (graphs may use it)
    owner.release()
    assert owner.nbytes() == 0
    assert owner.counters(cpu, 1) is not grown  # allocated afresh after a release


def test_the_scope_routes_counters_to_its_owner():
    cpu = torch.device("cpu")
    owner = launch.Arrivals()
    unscoped = launch.arrival_counters(cpu, 8)
    with launch.scope(False, owner):
        mine = launch.arrival_counters(cpu, 8)
        seen = []
        other = threading.Thread(target=lambda: seen.append(launch.arrival_counters(cpu, 8)))
        other.start()
        other.join()
    assert mine is owner.counters(cpu, 8) and mine is not unscoped
    assert seen[0] is unscoped  # another thread is outside this scope
    assert launch.arrival_counters(cpu, 8) is unscoped
    owner.release()
    assert owner.nbytes() == 0 and launch.arrival_counters(cpu, 8) is unscoped

