"""The context cache's randomized lifecycle: requests, lookups, leases, evictions and clears in any order against
an in-memory ContextStore (ninfer.testing.context_store); the manager's view stays the store's."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ninfer.engine.context_cache import ResourceManager
from ninfer.testing.context_store import BYTES_PER_TOKEN, SLOT_BYTES, MemoryStore, serve

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
