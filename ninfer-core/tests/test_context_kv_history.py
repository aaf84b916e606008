"""KVHistoryStore: unit reservations, exact read-only prefixes, copy-on-write on conflict, settlement (CPU)."""

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_saving_a_prefix_copies_no_page_and_the_owner_keeps_writing_in_place():
    pool, t = _tables()
    a = History()
    assert t.hold(a, 6)
    a.computed = 6
    ref = t.save_prefix(a, 6)  # positions 0..5: page 1 holds 4, 5 (its tail)
    assert pool.allocator.num_used == 2 and t.protected(a.pages[1]) == 2 and t.protected(a.pages[0]) == 4
    assert t.needed(a, 8) == 0 and t.hold(a, 8) and a.pages_epoch == 0  # offsets 2, 3: past the ref, in place
    a.computed = 3  # a rollback: rewriting position 3 (protected in page 0) copies page 0 first
    assert t.needed(a, 4) == 1
    t.drop_prefix(ref)
    assert t.protected(a.pages[1]) == 0 and t.needed(a, 4) == 0  # sole holder again: in place
    t.release(a)
    assert pool.allocator.num_used == 0


def test_a_page_held_by_one_history_alone_is_its_to_write():
    pool, t = _tables()
    a, b = History(), History()
    assert t.hold(a, 6)
    a.computed = 6
    ref = t.save_prefix(a, 6)
    t.adopt(b, ref)
    t.drop_prefix(ref)
    t.release(a)  # b alone holds both pages now, though it never allocated them
    assert t.needed(b, 8) == 0 and t.hold(b, 8) and pool.allocator.num_used == 2
    t.release(b)
    assert pool.allocator.num_used == 0 and t.protected(0) == t.protected(1) == 0


OPS = ["new", "write", "write", "write", "rollback", "rollback", "save", "save", "drop", "adopt", "adopt", "release"]


@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1000), st.integers(1, 9)), min_size=8, max_size=60))
@settings(max_examples=200, deadline=None)
def test_no_write_ever_changes_a_position_another_holder_reads(ops):
    """Random histories, prefix refs, adoptions, rollbacks and releases over a small pool: every position a
    history has computed and every position a ref covers keeps the value written for it, and at the end
    every page is free again."""
    pool, t = _tables(num_pages=12)
    k = pool.storage[0, 0]  # layer 0 K: [pages, page_size, heads, dim]
    hist: dict[int, tuple[History, list[float]]] = {}
    refs: list[tuple[object, list[float]]] = []
    stamp = iter(range(1, 1 << 30))

    def value_at(h, p):
        return float(k[h.pages[p // 4], p % 4, 0, 0])

    for op, pick, n in ops:
        live = sorted(hist)
        h, vals = hist[live[pick % len(live)]] if live else (None, None)
        if op == "new" or (h is None and op != "adopt"):
            fresh = History()
            hist[fresh.id] = (fresh, [])
        elif op == "write":
            if t.hold(h, h.computed + n):
                for p in range(h.computed, h.computed + n):
                    v = float(next(stamp))
                    k[h.pages[p // 4], p % 4, 0, 0] = v
                    vals.append(v)
                h.computed += n
                t.settle(h)
        elif op == "rollback" and h.computed:
            h.computed = pick % h.computed
            del vals[h.computed:]
            t.settle(h)
        elif op == "save" and h.computed:
            length = 1 + pick % h.computed
            refs.append((t.save_prefix(h, length), vals[:length]))
        elif op == "drop" and refs:
            ref, _ = refs.pop(pick % len(refs))
            t.drop_prefix(ref)
        elif op == "adopt" and refs:
            ref, rvals = refs[pick % len(refs)]
            child = History()
            t.adopt(child, ref)
            hist[child.id] = (child, list(rvals))
        elif op == "release":
            t.release(h)
            del hist[h.id]
        for h, vals in hist.values():
            assert [value_at(h, p) for p in range(h.computed)] == vals
        for ref, rvals in refs:
            assert [float(k[ref.pages[p // 4], p % 4, 0, 0]) for p in range(ref.length)] == rvals
    for h, _ in hist.values():
        t.release(h)
    for ref, _ in refs:
        t.drop_prefix(ref)
    assert pool.allocator.num_used == 0 and all(t.protected(p) == 0 for p in range(pool.num_pages))
