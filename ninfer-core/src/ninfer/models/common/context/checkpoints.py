"""CheckpointStore: a Program's recovery points, their device copies, host replicas and reader leases.

A checkpoint is the state after ``tokens``: the whole StateImage (recurrent state and conv window) in a
slot of the store's own StateImageStorage, and an exact read-only KV prefix (``KVPrefixRef``: the
source's pages, shared, no copy). A host replica holds the same image and those pages' contents in
pinned memory under the host budget, so a checkpoint whose device copy was evicted still restores by
a copy instead of a recomputation. Every publication or placement change takes a new generation; a
leased checkpoint cannot be evicted or retired. This store is the only ledger of what checkpoints hold.
"""

from __future__ import annotations

import itertools
from collections import Counter

import attrs
import torch

from ninfer.contract.context import CacheUsage, CheckpointInfo, CheckpointKind, MediaRun, clip_runs
from ninfer.core.kv_pool import HostPages, pages_for
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.context.errors import ProgramError
from ninfer.models.common.context.kv_history import KVHistoryStore, KVPrefixRef
from ninfer.models.common.context.sequence import SequenceRecord


@attrs.define(eq=False, kw_only=True)
class Checkpoint:
    id: int
    generation: int
    tokens: tuple[int, ...]
    kind: CheckpointKind
    media: tuple[MediaRun, ...] = ()        # the media identity of its placeholder tokens
    slot: int | None = None                 # device copy: a slot of the store's image storage
    prefix: KVPrefixRef | None = None       # device copy: the exact KV prefix
    host_image: torch.Tensor | None = None  # host replica (pinned on CUDA)
    host_kv: HostPages | None = None        # the prefix pages' K/V and aux fields
    leases: int = 0

    @property
    def on_device(self) -> bool:
        return self.slot is not None

    @property
    def on_host(self) -> bool:
        return self.host_image is not None


class CheckpointStore:
    """Checkpoints of the sequences in ``states`` / ``kv``: ``slots`` device images and a host byte budget."""

    def __init__(self, states: StateImageStorage, kv: KVHistoryStore, *, slots: int, host_budget_bytes: int) -> None:
        self.states = states
        self.kv = kv
        self.pool = kv.pool
        self.images = StateImageStorage(states.layout, slots, states.device) if slots > 0 else None
        self.host_budget_bytes = host_budget_bytes
        self.host_bytes_used = 0
        self.records: dict[int, Checkpoint] = {}
        self._ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._published: list[CheckpointInfo] = []

    # -- figures ------------------------------------------------------------------------------------
    def host_bytes(self, length: int) -> int:
        """Host bytes a replica of a ``length``-token checkpoint holds."""
        return self.states.image_bytes + pages_for(length, self.pool.page_size) * self.pool.nbytes_per_page

    def info(self, ck: Checkpoint) -> CheckpointInfo:
        device = alone = 0
        if ck.on_device:
            alone = sum(1 for p in ck.prefix.pages if self.pool.allocator.refcount(p) == 1)
            device = self.states.image_bytes + alone * self.pool.nbytes_per_page
        return CheckpointInfo(id=ck.id, generation=ck.generation, tokens=ck.tokens, kind=ck.kind,
                              on_device=ck.on_device, on_host=ck.on_host, device_bytes=device,
                              host_bytes=self.host_bytes(len(ck.tokens)), pages_alone=alone, media=ck.media)

    def usage(self) -> CacheUsage:
        refs = Counter(p for ck in self.records.values() if ck.prefix is not None for p in ck.prefix.pages)
        pages = set(refs)
        alone = sum(1 for p, n in refs.items() if self.pool.allocator.refcount(p) == n)
        slots_used = self.images.num_used if self.images is not None else 0
        return CacheUsage(checkpoints=len(self.records),
                          device_slots_total=self.images.num_slots if self.images is not None else 0,
                          device_slots_used=slots_used, device_pages=len(pages), device_pages_alone=alone,
                          device_bytes=slots_used * self.states.image_bytes + len(pages) * self.pool.nbytes_per_page,
                          host_bytes_used=self.host_bytes_used, host_bytes_total=self.host_budget_bytes,
                          leases=sum(ck.leases for ck in self.records.values()))

    # -- publication ------------------------------------------------------------------------------
    def save(self, seq: SequenceRecord, kind: CheckpointKind, *, publish: bool = True) -> CheckpointInfo | None:
        """Checkpoint ``seq`` at its frontier (a copy of its image, a read-only ref to its KV prefix); None
        when the frontier is empty or no device slot is free (the save is optional). ``publish``: also list
        it for the next ``drain``."""
        if seq.computed < 1 or self.images is None or self.images.num_free == 0:
            return None
        slot, prefix = self.images.allocate(), None
        try:  # all or nothing: a slot or prefix taken for a save that failed would be held by no checkpoint
            self.images.buffer[slot].copy_(self.states.buffer[seq.slot])
            prefix = self.kv.save_prefix(seq, seq.computed)
            ck = Checkpoint(id=next(self._ids), generation=next(self._generations), kind=kind,
                            tokens=tuple(seq.ledger[:seq.computed]), slot=slot, prefix=prefix,
                            media=clip_runs(seq.media.runs, seq.computed) if seq.media is not None else ())
            info = self.info(ck)
        except BaseException:
            if prefix is not None:
                self.kv.drop_prefix(prefix)
            self.images.free(slot)
            raise
        self.records[ck.id] = ck
        if publish:
            self._published.append(info)
        return info

    def drain(self) -> list[CheckpointInfo]:
        out, self._published = self._published, []
        return out

    def get(self, checkpoint_id: int) -> Checkpoint:
        try:
            return self.records[checkpoint_id]
        except KeyError:
            raise ProgramError(f"unknown checkpoint {checkpoint_id}") from None

    def lease(self, checkpoint_id: int) -> CheckpointInfo | None:
        ck = self.records.get(checkpoint_id)
        if ck is None:
            return None
        ck.leases += 1
        return self.info(ck)

    def unlease(self, checkpoint_id: int) -> None:
        ck = self.get(checkpoint_id)
        if ck.leases == 0:
            raise ProgramError(f"checkpoint {checkpoint_id} is not leased")
        ck.leases -= 1

    # -- materialization ------------------------------------------------------------------------------
    def pages_to_restore(self, ck: Checkpoint) -> int:
        """Free KV pages a restore takes: none from a device copy (its prefix is shared), else the prefix's."""
        return 0 if ck.on_device else pages_for(len(ck.tokens), self.pool.page_size)

    def restore(self, ck: Checkpoint, seq: SequenceRecord) -> None:
        """Make the empty ``seq`` (its slot bound) continue from ``ck``: device copy, else host replica."""
        if ck.leases == 0:
            raise ProgramError(f"checkpoint {ck.id} is restored without a lease")
        if ck.on_device:
            self.states.buffer[seq.slot].copy_(self.images.buffer[ck.slot])
            self.kv.adopt(seq, ck.prefix)
        elif ck.on_host:
            self.kv.append_fresh(seq, self.pages_to_restore(ck))
            self.pool.write_pages(seq.pages, ck.host_kv)
            self.states.restore(seq.slot, ck.host_image)
            seq.computed = len(ck.tokens)
        else:
            raise ProgramError(f"checkpoint {ck.id} has neither a device copy nor a host replica")

    # -- eviction ------------------------------------------------------------------------------------
    def evict(self, checkpoint_id: int, *, to_host: bool) -> CheckpointInfo | None:
        ck = self._unleased(checkpoint_id, "evict")
        if not ck.on_device:
            raise ProgramError(f"checkpoint {checkpoint_id} has no device copy to evict")
        if to_host and not ck.on_host and self.host_bytes_used + self.host_bytes(len(ck.tokens)) <= self.host_budget_bytes:
            # Both copies first: a failed host allocation leaves the checkpoint as it was, on the device only.
            image, kv = self.images.save(ck.slot), self.pool.read_to_host(ck.prefix.pages)
            ck.host_image, ck.host_kv = image, kv
            self.host_bytes_used += self.host_bytes(len(ck.tokens))
        self._release_device(ck)
        return self._changed(ck)

    def drop_host(self, checkpoint_id: int) -> CheckpointInfo | None:
        ck = self._unleased(checkpoint_id, "drop the host replica of")
        if not ck.on_host:
            raise ProgramError(f"checkpoint {checkpoint_id} has no host replica")
        self._release_host(ck)
        return self._changed(ck)

    def retire(self, checkpoint_id: int) -> None:
        ck = self._unleased(checkpoint_id, "retire")
        if ck.on_device:
            self._release_device(ck)
        if ck.on_host:
            self._release_host(ck)
        del self.records[checkpoint_id]

    def _release_device(self, ck: Checkpoint) -> None:
        self.images.free(ck.slot)
        self.kv.drop_prefix(ck.prefix)
        ck.slot, ck.prefix = None, None

    def _release_host(self, ck: Checkpoint) -> None:
        ck.host_image = ck.host_kv = None
        self.host_bytes_used -= self.host_bytes(len(ck.tokens))

    def _changed(self, ck: Checkpoint) -> CheckpointInfo | None:
        if not (ck.on_device or ck.on_host):
            del self.records[ck.id]
            return None
        ck.generation = next(self._generations)
        return self.info(ck)

    def _unleased(self, checkpoint_id: int, action: str) -> Checkpoint:
        ck = self.get(checkpoint_id)
        if ck.leases:
            raise ProgramError(f"cannot {action} checkpoint {checkpoint_id}: {ck.leases} reader lease(s) held")
        return ck
