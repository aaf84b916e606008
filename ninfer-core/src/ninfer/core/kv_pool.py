"""Typed paged KV pool: one page allocator shared by the pool's attention layers.

A page holds ``page_size`` token positions of K and V for every layer of the pool, so one page id
addresses the same positions in every layer ([num_pages, page_size, kv_heads, head_dim] per layer
for K and for V), and the same positions of the spec's aux fields (``PagedField``: per-token tensors such as an
indexer's keys, each its own tensor [layers, num_pages, page_size, *shape]). Pages carry reference counts: a page referenced by more than one history is
read-only to all but its one writer, and a conflicting write copies it first (``KVHistoryStore`` in
``models/common/context`` keeps those rules; ``copy_page`` is the copy). Accounting is exact: a page is either on
the free list or referenced, never both, and freeing an unreferenced page is an error.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import attrs
import torch

from ninfer.contract.state import KVPoolSpec
from ninfer.core.device import Device, host_empty, torch_dtype


class PoolExhausted(RuntimeError):
    """Not enough free pages (or state slots) for an allocation; nothing was allocated."""


class PageAllocator:
    """Free list plus reference counts over ``num_pages`` page ids."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages (reference count 1), all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PoolExhausted(f"KV pool has {len(self._free)} free pages, {n} requested")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Add a reference to pages another history already holds (a shared read-only prefix)."""
        pages = list(pages)
        for p in pages:
            self._check(p)
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; pages reaching zero return to the free list."""
        pages = list(pages)
        for p in pages:
            self._check(p)
        if len(set(pages)) != len(pages):
            raise ValueError(f"page listed twice in one free: {pages}")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page} outside 0..{self.num_pages - 1}")
        if self._refs[page] == 0:
            raise ValueError(f"page {page} is not allocated")


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` positions."""
    return -(-tokens // page_size)


@attrs.frozen(eq=False)
class HostPages:
    """Host copies of some pages of a pool: ``kv`` [layers, 2, pages, page_size, kv_heads, head_dim] and, per
    aux field of the spec in its order, [layers, pages, page_size, *shape]."""

    kv: torch.Tensor
    aux: tuple[torch.Tensor, ...] = attrs.field(default=(), converter=tuple)

    @property
    def num_pages(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, *self.aux))


class PagedKVPool:
    """K/V tensors of one typed pool, its aux fields' tensors, and its page allocator."""

    def __init__(self, spec: KVPoolSpec, num_pages: int, device: Device, dtype: str | torch.dtype | None = None):
        self.spec = spec
        self.device = device
        self.dtype = torch_dtype(dtype if dtype is not None else spec.dtype)
        self.page_size = spec.page_size
        self.allocator = PageAllocator(num_pages)
        # [layers, 2 (K, V), pages, page_size, kv_heads, head_dim]: each layer's K and V contiguous.
        self.storage = torch.zeros((spec.layers, 2, num_pages, spec.page_size, spec.kv_heads, spec.head_dim),
                                   dtype=self.dtype, device=device.torch)
        # Each aux field its own tensor [layers, pages, page_size, *shape] in its own dtype.
        self.aux_storage: tuple[torch.Tensor, ...] = tuple(
            torch.zeros((f.layers, num_pages, spec.page_size, *f.shape), dtype=torch_dtype(f.dtype),
                        device=device.torch) for f in spec.aux)

    @staticmethod
    def page_bytes(spec: KVPoolSpec, dtype: str | torch.dtype | None = None) -> int:
        d = torch_dtype(dtype if dtype is not None else spec.dtype)
        elem = torch.empty((), dtype=d).element_size()
        return 2 * spec.layers * spec.page_size * spec.kv_heads * spec.head_dim * elem + \
            sum(f.nbytes_per_token for f in spec.aux) * spec.page_size

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.storage, *self.aux_storage))

    @property
    def nbytes_per_page(self) -> int:
        return self.nbytes // self.num_pages

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [num_pages, page_size, kv_heads, head_dim] (non-owning views)."""
        return [(self.storage[i, 0], self.storage[i, 1]) for i in range(self.spec.layers)]

    def aux_caches(self, name: str) -> list[torch.Tensor]:
        """Per layer of aux field ``name``, its [num_pages, page_size, *shape] (non-owning views)."""
        for f, t in zip(self.spec.aux, self.aux_storage, strict=True):
            if f.name == name:
                return list(t.unbind(0))
        raise KeyError(f"KV pool {self.spec.name!r} has no aux field {name!r} "
                       f"(it has {[f.name for f in self.spec.aux]})")

    # -- copy-on-write and transfers ---------------------------------------------------------------
    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page (all layers, K, V and aux): a copy-on-write branch (``KVHistoryStore`` decides when)."""
        self.storage[:, :, dst].copy_(self.storage[:, :, src])
        for t in self.aux_storage:
            t[:, dst].copy_(t[:, src])

    # Host transfers go through device temporaries of at most this size (a pause under memory pressure
    # must not need a second copy of a long history on the device).
    transfer_block_bytes = 64 << 20

    def _blocks(self, n: int):
        step = max(1, self.transfer_block_bytes // self.nbytes_per_page)
        return ((i, min(i + step, n)) for i in range(0, n, step))

    def _pairs(self, host: HostPages | torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(pool tensor, host tensor, page dim) of each part a transfer moves."""
        if isinstance(host, torch.Tensor):
            if self.aux_storage:
                raise ValueError(f"KV pool {self.spec.name!r} has aux fields {[f.name for f in self.spec.aux]}: "
                                 "its host copies are HostPages, not a K/V tensor alone")
            host = HostPages(kv=host)
        if len(host.aux) != len(self.aux_storage):
            raise ValueError(f"host copy has {len(host.aux)} aux tensors, KV pool {self.spec.name!r} has "
                             f"{len(self.aux_storage)} aux fields")
        return [(self.storage, host.kv, 2)] + [(t, h, 1) for t, h in zip(self.aux_storage, host.aux, strict=True)]

    def read_pages(self, pages: Sequence[int], out: HostPages | torch.Tensor) -> None:
        """Copy ``pages`` (all layers, K, V and aux) into ``out`` (``HostPages``; a pool without aux fields also
        takes the K/V tensor [layers, 2, len(pages), page, heads, dim] alone)."""
        parts = self._pairs(out)
        for lo, hi in self._blocks(len(pages)):
            idx = torch.tensor(list(pages[lo:hi]), dtype=torch.int64, device=self.storage.device)
            for store, host, dim in parts:
                host.narrow(dim, lo, hi - lo).copy_(store.index_select(dim, idx))

    def write_pages(self, pages: Sequence[int], data: HostPages | torch.Tensor) -> None:
        """Inverse of :meth:`read_pages`."""
        parts = self._pairs(data)
        for lo, hi in self._blocks(len(pages)):
            idx = torch.tensor(list(pages[lo:hi]), dtype=torch.int64, device=self.storage.device)
            for store, host, dim in parts:
                store.index_copy_(dim, idx, host.narrow(dim, lo, hi - lo).to(store.device))

    def read_to_host(self, pages: Sequence[int]) -> HostPages:
        """A host copy of ``pages`` (pinned when the pool is on CUDA)."""
        n = len(pages)
        out = HostPages(kv=host_empty(self.host_shape(n), self.dtype, self.device),
                        aux=[host_empty((f.layers, n, self.page_size, *f.shape), torch_dtype(f.dtype), self.device)
                             for f in self.spec.aux])
        self.read_pages(pages, out)
        return out

    def host_shape(self, n_pages: int) -> tuple[int, ...]:
        """The K/V part of a host copy of ``n_pages``."""
        s = self.spec
        return (s.layers, 2, n_pages, s.page_size, s.kv_heads, s.head_dim)
