"""ResourceManager end to end against an in-memory ContextStore: lookups, save points, sessions, eviction
to host or away under slot and host-budget pressure, leases, clear; and a randomized lifecycle."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ninfer.contract.context import CacheUsage, CheckpointInfo, CheckpointKind, ContextStore
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.engine.context_cache import CostModel, ResourceManager

SLOT_BYTES = 1000
BYTES_PER_TOKEN = 100


@attrs.define
class _Checkpoint:
    tokens: tuple[int, ...]
    kind: CheckpointKind
    on_device: bool
    on_host: bool
    generation: int


@attrs.define
class _Sequence:
    tokens: list[int]
    frontier: int
    planned: list[int] = attrs.Factory(list)


class MemoryStore:
    """A ContextStore over plain records: a fixed number of device checkpoint slots, a host budget in
    bytes, reader leases that refuse eviction. A checkpoint's bytes are a state slot plus its tokens' KV
    (no page sharing here, so dropping a copy frees all of it). Sequences exist only to publish saves."""

    def __init__(self, *, slots: int, host_budget: int) -> None:
        self.slots = slots
        self.host_budget = host_budget
        self._checkpoints: dict[int, _Checkpoint] = {}
        self._sequences: dict[int, _Sequence] = {}
        self._leases: Counter[int] = Counter()
        self._published: list[CheckpointInfo] = []
        self._next_id = 0
        self._generation = 0

    # -- test driving (the Program's bind / prefill / decode) ----------------------------------------------
    def open(self, tokens) -> int:
        return self._new_sequence(list(tokens), 0)

    def prefill(self, sequence_id: int, before_save=lambda: None) -> None:
        """Run the prompt up to its last token (the first decode input), saving at the planned points;
        ``before_save`` is the engine's turn to make room between units."""
        seq = self._sequences[sequence_id]
        for p in seq.planned:
            seq.frontier = p
            before_save()
            kind = "prompt" if p == len(seq.tokens) - 1 else "grid"
            self._save(seq.tokens[:p], kind)
        seq.planned = []
        seq.frontier = len(seq.tokens) - 1

    def decode(self, sequence_id: int, generated) -> None:
        seq = self._sequences[sequence_id]
        seq.tokens += list(generated)
        seq.frontier = len(seq.tokens) - 1

    def release(self, sequence_id: int) -> None:
        del self._sequences[sequence_id]

    def replicate(self, checkpoint_id: int) -> CheckpointInfo:
        """Write a host replica while the device copy stays (a Program may do this ahead of pressure)."""
        c = self._checkpoints[checkpoint_id]
        assert c.on_device and not c.on_host and self._host_used() + self.checkpoint(checkpoint_id).host_bytes <= self.host_budget
        c.on_host = True
        return self._placed(checkpoint_id)

    # -- ContextStore ------------------------------------------------------------------------------------
    def plan_saves(self, sequence_id, positions) -> None:
        seq = self._sequences[sequence_id]
        positions = list(positions)
        if positions != sorted(set(positions)) or any(not seq.frontier < p < len(seq.tokens) for p in positions):
            raise ValueError(f"save points {positions} must ascend within ({seq.frontier}, {len(seq.tokens)})")
        seq.planned = positions

    def published(self) -> list[CheckpointInfo]:
        out, self._published = self._published, []
        return out

    def lease(self, checkpoint_id):
        if checkpoint_id not in self._checkpoints:
            return None
        self._leases[checkpoint_id] += 1
        return self.checkpoint(checkpoint_id)

    def unlease(self, checkpoint_id) -> None:
        if self._leases[checkpoint_id] <= 0:
            raise ValueError(f"checkpoint {checkpoint_id} is not leased")
        self._leases[checkpoint_id] -= 1
        if not self._leases[checkpoint_id]:
            del self._leases[checkpoint_id]

    def open_cached(self, prompt: PreparedPrompt, sampling: SamplingParams, checkpoint_id):
        c = self._checkpoints[checkpoint_id]
        if not self._leases[checkpoint_id]:
            raise ValueError(f"checkpoint {checkpoint_id} must be leased to restore from it")
        if not (len(c.tokens) < len(prompt) and prompt.token_ids[:len(c.tokens)] == c.tokens):
            raise ValueError("a checkpoint's tokens must be a proper prefix of the prompt")
        return self._new_sequence(list(prompt.token_ids), len(c.tokens))

    def save_continuation(self, sequence_id, kind):
        seq = self._sequences[sequence_id]
        return self._save(seq.tokens[:seq.frontier], kind, publish=False) if seq.frontier else None

    def checkpoint(self, checkpoint_id) -> CheckpointInfo:
        c = self._checkpoints[checkpoint_id]
        size = SLOT_BYTES + BYTES_PER_TOKEN * len(c.tokens)
        return CheckpointInfo(id=checkpoint_id, generation=c.generation, tokens=c.tokens, kind=c.kind,
                              on_device=c.on_device, on_host=c.on_host, device_bytes=size if c.on_device else 0,
                              host_bytes=size)

    def evict(self, checkpoint_id, *, to_host):
        c = self._unleased(checkpoint_id)
        if not c.on_device:
            raise ValueError(f"checkpoint {checkpoint_id} has no device copy")
        c.on_device = False
        size = self.checkpoint(checkpoint_id).host_bytes
        if to_host and not c.on_host and self._host_used() + size <= self.host_budget:
            c.on_host = True
        if not (to_host and c.on_host):
            del self._checkpoints[checkpoint_id]
            return None
        return self._placed(checkpoint_id)

    def drop_host(self, checkpoint_id):
        c = self._unleased(checkpoint_id)
        if not c.on_host:
            raise ValueError(f"checkpoint {checkpoint_id} has no host replica")
        c.on_host = False
        if not c.on_device:
            del self._checkpoints[checkpoint_id]
            return None
        return self._placed(checkpoint_id)

    def retire(self, checkpoint_id) -> None:
        self._unleased(checkpoint_id)
        del self._checkpoints[checkpoint_id]

    def cache_usage(self) -> CacheUsage:
        infos = [self.checkpoint(i) for i in self._checkpoints]
        device = [i for i in infos if i.on_device]
        return CacheUsage(checkpoints=len(infos), device_slots_total=self.slots, device_slots_used=len(device),
                          device_pages=sum(i.length for i in device),
                          device_pages_alone=sum(i.pages_alone for i in device), device_bytes=sum(i.device_bytes for i in device),
                          host_bytes_used=self._host_used(), host_bytes_total=self.host_budget,
                          leases=sum(self._leases.values()))

    # -- internals -----------------------------------------------------------------------------------------
    def _new_sequence(self, tokens, frontier) -> int:
        self._next_id += 1
        self._sequences[self._next_id] = _Sequence(tokens, frontier)
        return self._next_id

    def _save(self, tokens, kind, *, publish=True):
        if sum(c.on_device for c in self._checkpoints.values()) >= self.slots:
            return None  # no free checkpoint slot: the save is skipped
        self._next_id += 1
        self._generation += 1
        self._checkpoints[self._next_id] = _Checkpoint(tuple(tokens), kind, True, False, self._generation)
        info = self.checkpoint(self._next_id)
        if publish:
            self._published.append(info)
        return info

    def _placed(self, checkpoint_id) -> CheckpointInfo:
        self._generation += 1
        self._checkpoints[checkpoint_id].generation = self._generation
        return self.checkpoint(checkpoint_id)

    def _unleased(self, checkpoint_id) -> _Checkpoint:
        c = self._checkpoints[checkpoint_id]
        if self._leases[checkpoint_id]:
            raise RuntimeError(f"checkpoint {checkpoint_id} is leased")
        return c

    def _host_used(self) -> int:
        return sum(self.checkpoint(i).host_bytes for i, c in self._checkpoints.items() if c.on_host)


def serve(rm: ResourceManager, store: MemoryStore, prompt, *, generated=(), session=None, order=0):
    """One request as the engine runs it: look up, restore or start fresh, save, finish, hand over."""
    hit = rm.lookup(prompt, session)
    seq = None
    if hit is not None and rm.lease(hit.id) is not None:
        seq = store.open_cached(PreparedPrompt(token_ids=prompt), SamplingParams(), hit.id)
        rm.unlease(hit.id)
    start = 0 if seq is None else hit.length
    if seq is None:
        seq, hit = store.open(prompt), None
    store.plan_saves(seq, rm.save_points(prompt, start))

    def before_save():
        rm.adopt(store.published())
        rm.ensure_free_slot()

    store.prefill(seq, before_save)
    rm.adopt(store.published())
    if generated:
        store.decode(seq, generated)
        rm.ensure_free_slot()
        final = store.save_continuation(seq, "turn")
        if final is not None:
            if session is not None:
                rm.bind_session(session, order, final)
            else:
                rm.adopt([final])
    store.release(seq)
    return hit


def make(slots=8, host_budget=10**6, block=4, grid=8) -> tuple[ResourceManager, MemoryStore]:
    store = MemoryStore(slots=slots, host_budget=host_budget)
    assert isinstance(store, ContextStore)
    return ResourceManager(store, block=block, grid=grid), store


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


# -- randomized lifecycle ----------------------------------------------------------------------------------
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class Lifecycle(RuleBasedStateMachine):
    """Requests, lookups, leases, evictions and clears in any order: the manager's view stays the store's."""

    @initialize(slots=st.integers(0, 4), host_slots=st.integers(0, 3), block=st.integers(1, 4),
                grid=st.integers(1, 5))
    def setup(self, slots, host_slots, block, grid):
        self.store = MemoryStore(slots=slots, host_budget=host_slots * (SLOT_BYTES + 8 * BYTES_PER_TOKEN))
        self.rm = ResourceManager(self.store, block=block, grid=grid)
        self.order = 0
        self.held: list[int] = []
        self.history: list[list[int]] = [[]]

    @rule(data=st.data(), suffix=prompts, generated=st.lists(st.integers(0, 2), max_size=3),
          session=st.sampled_from([None, "a", "b"]))
    def request(self, data, suffix, generated, session):
        """A new prompt, or an earlier one (repeated, or continued like a chat's next turn)."""
        base = data.draw(st.sampled_from(self.history))
        prompt = base + data.draw(st.sampled_from([suffix, suffix[:1], []])) or suffix
        self.history.append(prompt + generated)
        self.order += 1
        hit = self.rm.lookup(prompt, session)
        if hit is not None:
            self.check_hit(hit, prompt)
        serve(self.rm, self.store, prompt, generated=generated, session=session, order=self.order)

    @rule(prompt=prompts, session=st.sampled_from([None, "a", "b"]))
    def lookup(self, prompt, session):
        hit = self.rm.lookup(prompt, session)
        if hit is not None:
            self.check_hit(hit, prompt)

    @rule(data=st.data())
    def lease(self, data):
        known = self.rm.checkpoints()
        if known:
            info = data.draw(st.sampled_from(known))
            assert self.rm.lease(info.id) is not None
            self.held.append(info.id)

    @rule()
    def unlease(self):
        if self.held:
            self.rm.unlease(self.held.pop())

    @rule()
    def evict(self):
        evictable = [i for i in self.rm.checkpoints() if i.on_device and i.id not in self.held]
        assert self.rm.evict_one() == bool(evictable)

    @rule()
    def clear(self):
        if self.held:
            with pytest.raises(RuntimeError):
                self.rm.clear()
            return
        self.rm.clear()
        assert self.store.cache_usage().empty and self.rm.checkpoints() == []

    def check_hit(self, hit, prompt):
        assert hit.length < len(prompt) and tuple(prompt[:hit.length]) == hit.tokens
        live = self.store.checkpoint(hit.id)  # KeyError if the store no longer has it
        assert live.tokens == hit.tokens

    @invariant()
    def the_manager_sees_what_the_store_holds(self):
        self.rm.adopt(self.store.published())
        mine = {i.id: i for i in self.rm.checkpoints()}
        assert set(mine) == set(self.store._checkpoints)
        for cid, info in mine.items():
            live = self.store.checkpoint(cid)
            assert (info.on_device, info.on_host, info.tokens) == (live.on_device, live.on_host, live.tokens)
        assert self.store.cache_usage().leases == len(self.held)

    def teardown(self):
        while self.held:
            self.rm.unlease(self.held.pop())
        self.rm.clear()
        assert self.store.cache_usage().empty


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
