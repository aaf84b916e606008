"""ResourceManager end to end against an in-memory ContextStore (ninfer.testing.context_store): lookups, save
points, sessions, eviction to host or away under slot and host-budget pressure, leases, clear. The randomized
lifecycle is test_context_cache_lifecycle.py."""

from __future__ import annotations

import attrs
import pytest

from ninfer.engine.context_cache import CostModel, ResourceManager
from ninfer.testing.context_store import BYTES_PER_TOKEN, SLOT_BYTES, MemoryStore, make, serve


# -- lookups and saves -------------------------------------------------------------------------------------
def test_an_identical_repeated_prompt_hits_at_its_last_but_one_token():
    rm, store = make()
    prompt = list(range(1, 21))
    assert serve(rm, store, prompt) is None
    hit = serve(rm, store, prompt)
    assert hit is not None and hit.length == len(prompt) - 1 and hit.tokens == tuple(prompt[:-1])


def test_save_points_lie_on_the_grid_then_at_the_prompt_end_and_skip_known_ones():
    rm, store = make(grid=8)
    prompt = list(range(100, 125))  # 25 tokens
    assert rm.save_points(prompt, 0) == [8, 16, 24]
    assert rm.save_points(prompt, 8) == [16, 24]
    assert rm.save_points(prompt[:17], 3) == [8, 16]
    assert rm.save_points(prompt, 24) == [] and rm.save_points(prompt[:1], 0) == []
    serve(rm, store, prompt[:20])  # saves 8, 16, 19
    assert rm.save_points(prompt, 0) == [24]
    assert rm.lookup(prompt).length == 19


def test_a_multi_turn_session_continues_from_its_last_turn():
    rm, store = make()
    turn1 = list(range(1, 11))
    serve(rm, store, turn1, generated=[50, 51, 52], session="chat", order=1)
    turn2 = turn1 + [50, 51, 52, 60, 61]
    hit = serve(rm, store, turn2, generated=[70], session="chat", order=2)
    assert hit.kind == "turn" and hit.tokens == tuple(turn1 + [50, 51])  # the last sampled token was not fed
    assert rm.lookup(turn2 + [70, 80, 81], "chat").length == len(turn2)


def test_the_session_hint_wins_only_when_it_is_at_least_as_long():
    rm, store = make(grid=100)
    base = list(range(1, 9))
    rm.adopt([store._save(base[:4], "turn")])
    rm.bind_session("chat", 1, rm.lookup(base[:5]))
    longer = store._save(base[:6], "prompt")
    rm.adopt([longer])
    assert rm.lookup(base, "chat").id == longer.id
    twin = store._save(base[:6], "turn")  # identical tokens: the session's own checkpoint wins the tie
    rm.bind_session("chat", 2, twin)
    rm.adopt([store._save(base[:6], "prompt")])
    assert rm.lookup(base, "chat").id == twin.id
    assert rm.lookup([9] + base, "chat") is None  # a hint that is no prefix never hits


def test_adopt_keeps_the_higher_generation_and_forgets_what_is_gone():
    rm, store = make()
    info = store._save([1, 2, 3], "prompt")
    moved = store.evict(info.id, to_host=True)
    rm.adopt([moved, info])  # the stale info arrives late
    assert rm.lookup([1, 2, 3, 4]).on_host and not rm.lookup([1, 2, 3, 4]).on_device
    store.drop_host(info.id)
    rm.forget(info.id)
    assert rm.lookup([1, 2, 3, 4]) is None
    gone = store._save([5, 6], "prompt")
    rm.adopt([gone])
    store.retire(gone.id)
    assert rm.lease(gone.id) is None and rm.lookup([5, 6, 7]) is None


def test_a_dropped_session_checkpoint_leaves_no_binding_behind():
    rm, store = make(slots=1, host_budget=0)
    serve(rm, store, [4] * 6, generated=[5], session="s", order=3)
    bound = rm.lookup([4] * 6 + [5, 6], "s")
    assert bound.kind == "turn" and rm._sessions.is_bound(bound.id)
    assert rm.evict_one()
    assert not rm._sessions.is_bound(bound.id) and rm._sessions.get("s") is None
    info = fill(rm, store, [[4] * 3])[0]
    rm.bind_session("s", 2, info)  # older than the binding that went: still refused
    assert rm._sessions.get("s") is None
    rm.bind_session("t", 4, attrs.evolve(info, generation=99, on_device=False, on_host=False))
    assert rm._sessions.get("t") is None and rm.checkpoints() == []  # a gone checkpoint binds nothing


# -- pressure ----------------------------------------------------------------------------------------------
def fill(rm, store, prompts):
    infos = [store._save(p, "prompt") for p in prompts]
    rm.adopt(infos)
    return infos


def test_a_host_replicated_checkpoint_is_demoted_before_a_sole_one():
    rm, store = make(slots=2)
    sole, replicated = fill(rm, store, [list(range(20)), list(range(100, 120))])
    rm.adopt([store.replicate(replicated.id)])
    rm.lookup(list(range(100, 121)))  # even the fresher one goes first: only a transfer is lost
    assert store._save([5] * 4, "prompt") is None  # every slot taken: the store skips the save
    assert rm.ensure_free_slot()
    assert rm.stats().evictions == {"host": 1, "dropped": 0}
    after = store.checkpoint(replicated.id)
    assert after.on_host and not after.on_device and store.checkpoint(sole.id).on_device


def test_eviction_keeps_the_long_unique_suffix_and_demotes_it_only_when_worth_it():
    rm, store = make(slots=3, host_budget=0)
    base = list(range(40))
    trunk, twig, other = fill(rm, store, [base[:38], base[:39], [7] * 10])
    # The twig covers one token beyond the trunk: losing it costs one token, the others much more.
    assert rm.evict_one()
    assert {i.id for i in rm.checkpoints()} == {trunk.id, other.id} and twig.id not in store._checkpoints
    assert rm.stats().evictions == {"host": 0, "dropped": 1}
    # With room on the host, a suffix worth more than its transfer is kept there instead, once restored before
    # (without that evidence of demand the device->host copy is not made: it is dropped).
    rm2, store2 = make(slots=2)
    kept, unused = fill(rm2, store2, [base, list(range(100, 140))])
    rm2.lookup(base + [0])
    assert rm2.evict_one() and unused.id not in store2._checkpoints  # never restored: dropped
    assert rm2.evict_one() and store2.checkpoint(kept.id).on_host


def test_recency_breaks_ties_and_a_hit_refreshes():
    rm, store = make(slots=2, host_budget=0)
    a, b = fill(rm, store, [[1] * 12, [2] * 12])
    rm.lookup([1] * 13)  # a hit on a makes b the stalest
    assert rm.evict_one()
    assert [i.id for i in rm.checkpoints()] == [a.id]


def test_host_room_is_made_by_dropping_lower_priority_replicas_only():
    size = SLOT_BYTES + BYTES_PER_TOKEN * 20
    rm, store = make(slots=1, host_budget=size)
    old = fill(rm, store, [list(range(20))])[0]
    rm.lookup(list(range(21)))  # restored once: worth a host copy
    assert rm.evict_one()  # demoted: the budget has room
    assert store.checkpoint(old.id).on_host and rm.stats().evictions["host"] == 1
    new = fill(rm, store, [list(range(50, 70))])[0]
    for _ in range(200):  # the replica ages; the new checkpoint stays fresh (and has demand)
        rm.lookup(list(range(50, 71)))
    assert rm.evict_one()
    assert store.checkpoint(new.id).on_host and old.id not in store._checkpoints
    assert rm.stats().evictions == {"host": 2, "dropped": 0}
    assert [i.id for i in rm.checkpoints()] == [new.id]


def test_a_fresher_replica_is_not_dropped_for_a_staler_one():
    size = SLOT_BYTES + BYTES_PER_TOKEN * 20
    rm, store = make(slots=1, host_budget=size)
    fill(rm, store, [list(range(20))])
    rm.lookup(list(range(21)))
    rm.evict_one()
    stale = fill(rm, store, [list(range(50, 70))])[0]
    for _ in range(200):
        rm.lookup(list(range(21)))  # the replica keeps hitting
    assert rm.evict_one()
    assert stale.id not in store._checkpoints
    assert rm.stats().evictions == {"host": 1, "dropped": 1}


def test_leased_checkpoints_are_never_evicted_and_block_clear():
    rm, store = make(slots=1)
    a = fill(rm, store, [[3] * 9])[0]
    rm.lookup([3] * 10)
    assert rm.lease(a.id).id == a.id
    assert not rm.evict_one() and not rm.ensure_free_slot()
    with pytest.raises(RuntimeError, match="leased"):
        rm.clear()
    rm.unlease(a.id)
    assert rm.ensure_free_slot()
    rm.clear()
    assert store.cache_usage().empty and rm.checkpoints() == [] and rm.lookup([3] * 10) is None


def test_no_slots_means_no_free_slot():
    rm, _ = make(slots=0)
    assert not rm.ensure_free_slot() and not rm.evict_one()


def test_clear_retires_everything_including_unadopted_publications_and_keeps_counters():
    rm, store = make(slots=2, host_budget=0)
    serve(rm, store, list(range(30)), generated=[1, 2], session="s", order=1)
    assert rm.stats().evictions["dropped"] > 0
    store._save([8, 8, 8], "prompt")  # published, not yet adopted
    before = rm.stats().evictions
    rm.clear()
    assert store.cache_usage().empty and rm.stats().checkpoints == 0
    assert rm.stats().evictions == before
    assert rm.lookup(list(range(30)), "s") is None


def test_stats_come_from_the_store():
    rm, store = make()
    fill(rm, store, [[1] * 5, [2] * 7])
    s = rm.stats()
    assert (s.checkpoints, s.device_bytes, s.host_bytes) == (2, 2 * SLOT_BYTES + 12 * BYTES_PER_TOKEN, 0)


def test_constructor_rejects_a_bad_grid_or_block():
    store = MemoryStore(slots=1, host_budget=0)
    with pytest.raises(ValueError, match="grid"):
        ResourceManager(store, block=4, grid=0)
    with pytest.raises(ValueError, match="block"):
        ResourceManager(store, block=0, grid=4, cost=CostModel())
