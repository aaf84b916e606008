"""Per-sequence KV block tables over one PagedKVPool: unit reservations, settlement, shared prefixes.

A sequence's ``pages`` list is its block table: the pages covering its physical frontier
``computed``, then what it holds for the unit it runs next (its reservation). A page shared with
another history (a fork) is read-only: before a unit writes it, the sequence gets a private copy
(copy-on-write), and the reservation counts those copies, so it stays exact. ``pages_epoch`` moves
on whenever an entry is replaced or the list is truncated (cached block-table rows, such as the
decode graphs' static tables, are keyed by it); appending keeps it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ninfer.core.kv_pool import PagedKVPool, pages_for


class PagedHistory(Protocol):
    """What the tables read and update on a sequence record (``SequenceRecord`` has these)."""

    computed: int
    pages: list[int]
    pages_epoch: int


class SequencePages:
    """Reservation, copy-on-write and settlement of sequences' block tables in ``pool``."""

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size

    def needed(self, seq: PagedHistory, positions: int) -> int:
        """Fresh pages a unit writing computed..positions needs: new pages plus private copies of shared ones."""
        first = seq.computed // self.page_size
        covered = pages_for(positions, self.page_size)
        refcount = self.pool.allocator.refcount
        cow = sum(1 for p in seq.pages[first:covered] if refcount(p) > 1)
        return max(0, covered - len(seq.pages)) + cow

    def hold(self, seq: PagedHistory, positions: int) -> bool:
        """Own every page positions computed..positions touch (allocate, or copy a shared one); False, taking
        nothing, when the free pages do not cover that."""
        need = self.needed(seq, positions)
        if need == 0:
            return True
        if need > self.pool.allocator.num_free:
            return False
        covered = pages_for(positions, self.page_size)
        for i in range(seq.computed // self.page_size, min(len(seq.pages), covered)):
            private = self.pool.writable(seq.pages[i])
            if private != seq.pages[i]:
                seq.pages[i] = private
                seq.pages_epoch += 1  # an entry changed: cached block-table rows are stale
        seq.pages.extend(self.pool.allocator.allocate(covered - len(seq.pages)))
        return True

    def settle(self, seq: PagedHistory) -> None:
        """End of a unit: free the unused reservation beyond the committed frontier."""
        keep = pages_for(seq.computed, self.page_size)
        if len(seq.pages) > keep:
            self.pool.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
            seq.pages_epoch += 1

    def share_prefix(self, seq: PagedHistory) -> list[int]:
        """The pages covering ``seq``'s frontier with one more reference each: a fork's block table."""
        pages = seq.pages[:pages_for(seq.computed, self.page_size)]
        self.pool.allocator.share(pages)
        return list(pages)

    def release(self, seq: PagedHistory) -> None:
        """Drop ``seq``'s reference to every page it holds (shared pages stay with their other holders)."""
        self.pool.allocator.free(seq.pages)

    def reserved(self, seqs: Iterable[PagedHistory]) -> int:
        """Pages held beyond the frontiers of ``seqs`` (their reservations)."""
        return sum(max(0, len(s.pages) - pages_for(s.computed, self.page_size)) for s in seqs)
