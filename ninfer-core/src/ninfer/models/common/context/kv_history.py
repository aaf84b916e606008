"""KVHistoryStore: the KV histories of one PagedKVPool, their exact read-only prefixes, and unit reservations.

A sequence's ``pages`` list is its block table: the pages covering its physical frontier ``computed``,
then what it holds for the unit it runs next (its reservation). Every page has at most one writer (its
owner: the history that allocated or copied it) and any number of readers, each needing a leading part
of the page intact: a ``KVPrefixRef`` (a checkpoint's exact prefix of ``length`` tokens) reads every
page it covers, fully except its tail page; a history that adopted a prefix (a fork, a restore from a
checkpoint) reads those pages until it writes them. The owner writes in place at offsets no reader
needs, so saving a prefix copies no tail page; a write that conflicts (a reader's history, or the owner
rewriting a protected offset after a rollback) branches that one page first (copy-on-write). A page
held by one history alone is that history's to write. The reservation counts those copies, so it
stays exact. ``pages_epoch`` moves on whenever an entry is replaced or the list is truncated (cached
block-table rows, such as the decode graphs' static tables, are keyed by it); appending keeps it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

import attrs

from ninfer.core.kv_pool import PagedKVPool, pages_for


class PagedHistory(Protocol):
    """What the store reads and updates on a sequence record (``SequenceRecord`` has these)."""

    id: int
    computed: int
    pages: list[int]
    pages_epoch: int
    adopted: int  # leading positions taken from another history's prefix (read, not owned, until written);
    # as registered at adoption, even after a rollback below it (``_reads`` must find the entries it made)


@attrs.frozen(kw_only=True, eq=False)
class KVPrefixRef:
    """An exact read-only prefix of a history: positions [0, length) in ``pages`` (one reference each)."""

    pages: tuple[int, ...]
    length: int


class KVHistoryStore:
    """Reservation, copy-on-write and settlement of histories' block tables in ``pool``, plus prefix refs."""

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._owner = [0] * pool.num_pages               # history id allowed to write in place (0: none)
        self._readers: dict[int, Counter[int]] = {}      # page -> lengths its readers need intact

    # -- readers ----------------------------------------------------------------------------------
    def _spans(self, length: int) -> list[int]:
        """Per covered page, the leading positions a reader of ``length`` tokens needs."""
        ps = self.page_size
        return [min(ps, length - i * ps) for i in range(pages_for(length, ps))]

    def _protect(self, pages: Iterable[int], length: int) -> None:
        for page, need in zip(pages, self._spans(length), strict=True):
            self._readers.setdefault(page, Counter())[need] += 1

    def _unprotect(self, page: int, need: int) -> None:
        readers = self._readers[page]
        readers[need] -= 1
        if readers[need] == 0:
            del readers[need]
            if not readers:
                del self._readers[page]

    def _reads(self, seq: PagedHistory, i: int) -> int:
        """Positions of its i-th page that ``seq`` reads as an adopted prefix (0: it owns or never read it)."""
        if i * self.page_size >= seq.adopted or self._owner[seq.pages[i]] == seq.id:
            return 0
        return min(self.page_size, seq.adopted - i * self.page_size)

    def protected(self, page: int) -> int:
        """Leading positions of ``page`` that some reader needs intact."""
        readers = self._readers.get(page)
        return max(readers) if readers else 0

    # -- prefixes ---------------------------------------------------------------------------------
    def save_prefix(self, seq: PagedHistory, length: int) -> KVPrefixRef:
        """A read-only ref to ``seq``'s first ``length`` positions (computed ones); no page is copied."""
        if not 0 < length <= seq.computed:
            raise ValueError(f"a prefix of {length} positions is outside the history's frontier {seq.computed}")
        pages = tuple(seq.pages[:pages_for(length, self.page_size)])
        self.pool.allocator.share(pages)
        self._protect(pages, length)
        return KVPrefixRef(pages=pages, length=length)

    def drop_prefix(self, ref: KVPrefixRef) -> None:
        for page, need in zip(ref.pages, self._spans(ref.length), strict=True):
            self._unprotect(page, need)
        self._free(ref.pages)

    def adopt(self, seq: PagedHistory, ref: KVPrefixRef) -> None:
        """Start an empty history from ``ref``'s prefix: it reads the pages until it writes them."""
        if seq.pages or seq.computed:
            raise ValueError("only an empty history adopts a prefix")
        self.pool.allocator.share(ref.pages)
        self._protect(ref.pages, ref.length)
        seq.pages.extend(ref.pages)
        seq.computed = seq.adopted = ref.length

    # -- units ------------------------------------------------------------------------------------
    def _in_place(self, seq: PagedHistory, i: int, offset: int) -> bool:
        page = seq.pages[i]
        if self.pool.allocator.refcount(page) == 1:
            return True  # nobody else holds it
        return self._owner[page] == seq.id and offset >= self.protected(page)

    def _writes(self, seq: PagedHistory, positions: int):
        """(index, offset) of each held page that positions computed..positions write."""
        ps = self.page_size
        for i in range(seq.computed // ps, min(len(seq.pages), pages_for(positions, ps))):
            yield i, max(seq.computed, i * ps) - i * ps

    def needed(self, seq: PagedHistory, positions: int) -> int:
        """Fresh pages a unit writing computed..positions needs: new pages plus copies of pages it may not write."""
        cow = sum(1 for i, offset in self._writes(seq, positions) if not self._in_place(seq, i, offset))
        return max(0, pages_for(positions, self.page_size) - len(seq.pages)) + cow

    def hold(self, seq: PagedHistory, positions: int) -> bool:
        """Own every page positions computed..positions touch (allocate, or copy one it may not write); False,
        taking nothing, when the free pages do not cover that."""
        need = self.needed(seq, positions)
        if need > self.pool.allocator.num_free:
            return False
        for i, offset in list(self._writes(seq, positions)):
            page = seq.pages[i]
            reads = self._reads(seq, i)
            if self._in_place(seq, i, offset):
                if reads:
                    self._unprotect(page, reads)
                self._owner[page] = seq.id
                continue
            (new,) = self.pool.allocator.allocate(1)
            self.pool.copy_page(page, new)
            self._owner[new] = seq.id
            self._let_go(seq, i)
            seq.pages[i] = new
            seq.pages_epoch += 1  # an entry changed: cached block-table rows are stale
        self.append_fresh(seq, max(0, pages_for(positions, self.page_size) - len(seq.pages)))
        return True

    def append_fresh(self, seq: PagedHistory, n: int) -> None:
        """Append ``n`` newly allocated pages that ``seq`` owns (raises PoolExhausted, taking nothing)."""
        fresh = self.pool.allocator.allocate(n)
        for page in fresh:
            self._owner[page] = seq.id
        seq.pages.extend(fresh)

    def settle(self, seq: PagedHistory) -> None:
        """End of a unit: free the unused reservation beyond the committed frontier."""
        keep = pages_for(seq.computed, self.page_size)
        if len(seq.pages) > keep:
            for i in range(keep, len(seq.pages)):
                self._let_go(seq, i)
            del seq.pages[keep:]
            seq.pages_epoch += 1
        # ``adopted`` stays as registered after a rollback: a kept page it still reads keeps its full reader
        # entry (more protection than needed until the history copies the page, never less).

    def release(self, seq: PagedHistory) -> None:
        """Drop ``seq``'s hold on every page (pages others hold stay with them)."""
        for i in range(len(seq.pages)):
            self._let_go(seq, i)
        seq.pages.clear()
        seq.adopted = 0

    def _let_go(self, seq: PagedHistory, i: int) -> None:
        """Drop ``seq``'s reference to its i-th page (as reader or owner)."""
        page = seq.pages[i]
        reads = self._reads(seq, i)
        if reads:
            self._unprotect(page, reads)
        elif self._owner[page] == seq.id:
            self._owner[page] = 0
        self._free([page])

    def _free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        self.pool.allocator.free(pages)
        for page in pages:
            if self.pool.allocator.refcount(page) == 0:
                self._owner[page] = 0

    def reserved(self, seqs: Iterable[PagedHistory]) -> int:
        """Pages held beyond the frontiers of ``seqs`` (their reservations)."""
        return sum(max(0, len(s.pages) - pages_for(s.computed, self.page_size)) for s in seqs)
