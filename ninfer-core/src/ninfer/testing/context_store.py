"""An in-memory ContextStore for the context cache's policy tests: device checkpoint slots, a host budget and reader
leases over plain records (``MemoryStore``), and ``serve``, one request as the engine runs it against a
ResourceManager (look up, restore or start fresh, save, finish, hand over)."""

from __future__ import annotations

from collections import Counter

import attrs

from ninfer.contract.context import CacheUsage, CheckpointInfo, CheckpointKind, ContextStore
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.engine.context_cache import ResourceManager

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
