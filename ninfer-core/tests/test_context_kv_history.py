"""KVHistoryStore: unit reservations, exact read-only prefixes, copy-on-write on conflict, settlement (CPU)."""

import attrs
import torch

from ninfer.contract.state import KVPoolSpec
from ninfer.core.device import Device
from ninfer.core.kv_pool import PagedKVPool
from ninfer.models.common.context import KVHistoryStore


_ids = iter(range(1, 1 << 30))


@attrs.define
class History:
    id: int = attrs.field(factory=lambda: next(_ids))
    computed: int = 0
    adopted: int = 0
    pages: list = attrs.field(factory=list)
    pages_epoch: int = 0


def _tables(num_pages=8):
    pool = PagedKVPool(KVPoolSpec(name="main", layers=2, kv_heads=1, head_dim=2, dtype="float32", page_size=4),
                       num_pages, Device("cpu"))
    return pool, KVHistoryStore(pool)


def test_hold_takes_what_a_unit_needs_and_settle_frees_the_rest():
    pool, t = _tables()
    h = History()
    assert t.needed(h, 5) == 2 and t.hold(h, 5) and len(h.pages) == 2
    assert t.hold(h, 6) and len(h.pages) == 2  # already covered: a no-op
    assert t.reserved([h]) == 2
    h.computed = 3
    t.settle(h)  # positions 0..2 need one page
    assert len(h.pages) == 1 and h.pages_epoch == 1 and pool.allocator.num_used == 1 and t.reserved([h]) == 0
    assert not t.hold(h, 4 * 9)  # more than the pool: nothing taken
    assert len(h.pages) == 1 and pool.allocator.num_used == 1
    t.release(h)
    assert pool.allocator.num_used == 0


def test_shared_pages_are_copied_before_a_write():
    pool, t = _tables()
    a = History()
    assert t.hold(a, 6)
    a.computed = 6
    pool.storage[:, :, a.pages[1]] = 7.0
    b = History()
    ref = t.save_prefix(a, 6)
    t.adopt(b, ref)
    t.drop_prefix(ref)
    assert b.pages == a.pages and pool.allocator.num_used == 2
    # b writes position 6 (page 1, still shared): it needs one private copy, counted by the reservation
    assert t.needed(b, 7) == 1 and t.hold(b, 7)
    assert b.pages[0] == a.pages[0] and b.pages[1] != a.pages[1] and b.pages_epoch == 1
    assert torch.equal(pool.storage[:, :, b.pages[1]], pool.storage[:, :, a.pages[1]])
    assert t.needed(a, 7) == 0  # a's page 1 is its own again
    t.release(a)
    t.release(b)
    assert pool.allocator.num_used == 0
