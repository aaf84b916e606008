"""Host experts on the CPU: the expert cache's bookkeeping, and HostExperts (cache hits + the CPU team's misses,
whole layers streamed through the staging buffers) equal to the routed-experts reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer.core.cpu_executor import CpuExecutor
from ninfer.models.common.moe.expert_cache import ExpertCache
from ninfer.models.common.moe.host_experts import HostExperts, expert_bytes, staging_bytes
from ninfer.models.common.moe.transfers import Transfers
from ninfer.ops.moe import moe_experts_ref, moe_route

E, H, INTER, K = 8, 32, 16, 2


def _banks(layers: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(E, 2 * INTER, H, generator=g) * 0.2, torch.randn(E, H, INTER, generator=g) * 0.2)
            for _ in range(layers)]


def _routing(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    weights, ids = moe_route(torch.randn(n, E, generator=g), K)
    return x, ids, weights


@pytest.fixture
def team():
    with CpuExecutor(2) as t:
        yield t


def _cache(slots: int, layers: int = 2) -> ExpertCache:
    return ExpertCache(layers=layers, experts=E, slots=slots, gate_up_shape=(2 * INTER, H), down_shape=(H, INTER),
                       dtype=torch.float32, device=torch.device("cpu"), transfers=Transfers(torch.device("cpu")))


def test_cache_admits_into_free_slots_then_evicts_the_lowest_score():
    banks = _banks(2)
    cache = _cache(slots=2)
    cache.observe(0, np.array([3, 3, 3, 5]))
    assert cache.admit(0, cache.by_score(0, np.array([3, 5])), *banks[0], limit=4) == 2
    assert (cache.lookup(0, np.array([[3, 5, 1]])) >= 0).tolist() == [[True, True, False]]
    slot = int(cache.lookup(0, np.array([3]))[0])
    assert torch.equal(cache.gate_up[slot], banks[0][0][3]) and torch.equal(cache.down[slot], banks[0][1][3])
    # Expert 1 of layer 1, used once, does not beat expert 5 (score 1, no decay yet in layer 0): not admitted.
    cache.observe(1, np.array([1]))
    assert cache.admit(1, np.array([1]), *banks[1], limit=1) == 0
    # Used often, it replaces the lowest-scored resident one (5), and 3 stays.
    cache.observe(1, np.array([1] * 6))
    assert cache.admit(1, np.array([1]), *banks[1], limit=1) == 1
    assert cache.lookup(1, np.array([1]))[0] >= 0 and cache.lookup(0, np.array([5]))[0] == -1
    assert cache.lookup(0, np.array([3]))[0] >= 0
    assert torch.equal(cache.gate_up[int(cache.lookup(1, np.array([1]))[0])], banks[1][0][1])


def test_cache_with_no_slots_admits_nothing():
    cache = _cache(slots=0)
    cache.observe(0, np.array([1, 2]))
    assert cache.admit(0, np.array([1, 2]), *_banks(1)[0], limit=2) == 0
    assert (cache.lookup(0, np.array([[1, 2]])) == -1).all()


@pytest.mark.parametrize("slots", [0, 3, 2 * E])
def test_mixed_calls_equal_the_reference(team, slots):
    banks = _banks(2)
    experts = HostExperts(banks, device=torch.device("cpu"), cache_slots=slots, team=team, top_k=K,
                          stream_min_tokens=64)
    for step in range(6):  # the cache fills as the steps go: later steps mix hits and misses
        for layer, (gate_up, down) in enumerate(banks):
            x, ids, weights = _routing(1 + step % 3, seed=10 * step + layer)
            got = experts.routed(gate_up, x, ids, weights)
            torch.testing.assert_close(got, moe_experts_ref(x, gate_up, down, ids, weights), rtol=1e-5, atol=1e-6)
    stats = experts.stats
    assert stats.mixed_calls == 12 and stats.streamed_calls == 0
    assert stats.mixed_s >= stats.wait_s + stats.team_s + stats.upload_s and min(stats.team_s, stats.wait_s) >= 0
    assert stats.cache_hits + stats.cache_misses == sum(2 * (1 + s % 3) * K for s in range(6))
    if slots == 0:
        assert stats.cache_hits == 0 and stats.admitted == 0
    else:
        assert stats.cache_hits > 0 and stats.admitted > 0
    experts.close()


def test_streamed_calls_equal_the_reference_and_warm_the_cache(team):
    banks = _banks(3, seed=1)
    experts = HostExperts(banks, device=torch.device("cpu"), cache_slots=4, team=team, top_k=K,
                          stream_min_tokens=8)
    for chunk in range(2):
        for layer, (gate_up, down) in enumerate(banks):
            x, ids, weights = _routing(12, seed=100 + 10 * chunk + layer)
            got = experts.routed(gate_up, x, ids, weights)
            torch.testing.assert_close(got, moe_experts_ref(x, gate_up, down, ids, weights), rtol=1e-5, atol=1e-6)
    stats = experts.stats
    assert stats.streamed_calls == 6 and stats.mixed_calls == 0 and stats.streamed_pairs == 6 * 12 * K
    # Each call stages the next layer ahead (after the last, the first): 3 layers, 2 chunks, one upload each,
    # plus the first layer's own upload at the very start.
    assert stats.streamed_layers == 7
    assert stats.admitted >= 4
    x, ids, weights = _routing(2, seed=7)  # now a few tokens: some pairs hit the warmed cache
    gate_up, down = banks[2]
    torch.testing.assert_close(experts.routed(gate_up, x, ids, weights), moe_experts_ref(x, gate_up, down, ids, weights),
                               rtol=1e-5, atol=1e-6)
    experts.close()


def test_bf16_mixed_call_rounds_like_the_reference(team):
    banks = [(g.bfloat16(), d.bfloat16()) for g, d in _banks(1, seed=3)]
    experts = HostExperts(banks, device=torch.device("cpu"), cache_slots=0, team=team, top_k=K)
    x, ids, weights = _routing(3, seed=4)
    x, weights = x.bfloat16(), weights.bfloat16()
    got = experts.routed(banks[0][0], x, ids, weights)
    torch.testing.assert_close(got, moe_experts_ref(x, *banks[0], ids, weights), rtol=2e-2, atol=2e-3)
    experts.close()


def test_unknown_bank_and_mismatched_layers_are_refused(team):
    banks = _banks(1)
    experts = HostExperts(banks, device=torch.device("cpu"), cache_slots=0, team=team, top_k=K)
    x, ids, weights = _routing(1, seed=0)
    with pytest.raises(ValueError, match="not one of the host experts' layers"):
        experts.routed(torch.zeros(E, 2 * INTER, H), x, ids, weights)
    with pytest.raises(ValueError, match="one shape"):
        HostExperts([*banks, (torch.zeros(E, 2 * INTER, H + 1), torch.zeros(E, H + 1, INTER))],
                    device=torch.device("cpu"), cache_slots=0, team=team, top_k=K)
    experts.close()


def test_sizes():
    gate_up, down = _banks(1)[0]
    assert expert_bytes(gate_up, down) == (2 * INTER * H + H * INTER) * 4
    assert staging_bytes(gate_up, down) == 2 * E * expert_bytes(gate_up, down)


def test_the_next_layers_predicted_experts_are_uploaded_ahead(team):
    """With the next layer's router, a call uploads the experts its own input predicts for the next layer; when
    the next layer's input is that same input (a residual stream that barely changed), they all hit."""
    banks = _banks(2, seed=5)
    g = torch.Generator().manual_seed(6)
    routers = [torch.randn(E, H, generator=g), None]
    experts = HostExperts(banks, device=torch.device("cpu"), cache_slots=6, team=team, top_k=K,
                          next_routers=routers, stream_min_tokens=64, admit_per_call=0)
    x = torch.randn(1, H, generator=g)
    for layer, (gate_up, down) in enumerate(banks):
        logits = x @ (routers[0] if layer == 1 else torch.randn(E, H, generator=g)).T
        weights, ids = moe_route(logits, K)
        got = experts.routed(gate_up, x, ids, weights)
        torch.testing.assert_close(got, moe_experts_ref(x, gate_up, down, ids, weights), rtol=1e-5, atol=1e-6)
    stats = experts.stats
    old = experts.team
    experts.replace_team(CpuExecutor(1))
    assert old.closed and not experts.team.closed
    assert stats.prefetched == K and stats.admitted == 0
    assert (stats.cache_hits, stats.cache_misses) == (K, K)  # layer 0 missed everything, layer 1 hit everything
    with pytest.raises(ValueError, match="1 next-layer routers for 2 layers"):
        HostExperts(banks, device=torch.device("cpu"), cache_slots=0, team=team, top_k=K, next_routers=[None])
    experts.close()


def test_a_mixed_call_holds_the_caller_at_one_intra_op_thread(team, monkeypatch):
    """While the team computes, the control thread's own torch ops start no OpenMP team (whose spinning threads
    slowed the pinned workers several times on the H200's host: docs/moe.md); its thread count comes back."""
    from ninfer.models.common.moe import host_experts as he

    seen = []
    real = he.cpu_experts

    def recording(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(he, "cpu_experts", recording)
    banks = _banks(1)
    experts = HostExperts(banks, device=torch.device("cpu"), cache_slots=0, team=team, top_k=K, stream_min_tokens=64)
    before = torch.get_num_threads()
    x, ids, weights = _routing(2, seed=3)
    torch.testing.assert_close(experts.routed(banks[0][0], x, ids, weights),
                               moe_experts_ref(x, *banks[0], ids, weights), rtol=1e-5, atol=1e-6)
    assert seen == [1] and torch.get_num_threads() == before
    experts.close()
