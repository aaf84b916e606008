"""ResourceManager: the context cache's policy over a Program's ContextStore.

It chooses which checkpoint a request restores (longest exact prefix, the session's hint first), where a
prefill saves, which session continues from which checkpoint, and what pressure reclaims first. It keeps
no physical ledger: slots, pages, host bytes and leases live in the store, and every info it holds is
one the store returned. It forgets a checkpoint as soon as the store (or the engine) says it is gone.

Every checkpoint enters in the cache scope of the request that saved it (its ``cache_salt``; None: the
shared scope), and lookups, save points and sessions see only their own scope's checkpoints. Eviction ranks
every scope together: the store's capacity is one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import attrs

from ninfer.contract.context import CheckpointInfo, ContextStore, MediaRun, clip_runs
from ninfer.engine.context_cache.prefix_index import PrefixIndex
from ninfer.engine.context_cache.retention import (
    CostModel,
    Recency,
    device_priority,
    host_priority,
    worth_host_replica,
)
from ninfer.engine.context_cache.sessions import SessionHints

EVICTION_OUTCOMES = ("host", "dropped")


@attrs.frozen(kw_only=True)
class CacheStats:
    """The store's occupancy now, and evictions by outcome since the manager started."""

    checkpoints: int
    device_bytes: int
    host_bytes: int
    evictions: dict[str, int]


class ResourceManager:
    def __init__(self, store: ContextStore, *, block: int, grid: int, cost: CostModel = CostModel(),
                 max_sessions: int = 4096) -> None:
        if grid < 1:
            raise ValueError(f"the checkpoint grid must be at least one token, got {grid}")
        self.store = store
        self.grid = grid
        self.cost = cost
        self._index = PrefixIndex(block)
        self._sessions = SessionHints(max_sessions)
        self._recency = Recency()
        self._leases: Counter[int] = Counter()
        self._hits: Counter[int] = Counter()  # restores per checkpoint: the demand evidence a host copy needs
        self._restore: dict[int, tuple[int, int | None]] = {}  # id -> (restore length, the checkpoint giving it)
        self._evictions = dict.fromkeys(EVICTION_OUTCOMES, 0)
        self._unadopted: dict[int, CheckpointInfo] = {}  # published, adopted by no one, not retired yet

    # -- publication -----------------------------------------------------------------------------------
    def adopt(self, infos: Iterable[CheckpointInfo], *, salt: str | None = None) -> None:
        """Take the store's newest infos (saved, or placement changed); a publication is a use. A checkpoint
        not known yet enters the scope of ``salt`` (the request that saved it)."""
        for info in infos:
            self._recency.tick()
            if self._update(info, salt=salt, new=True):
                self._recency.use(info.id)

    def bind_session(self, key: str, order: int, info: CheckpointInfo, *, salt: str | None = None) -> None:
        """Make ``info`` (as the store just returned it) the continuation of the session ``key`` of the scope
        ``salt``, unless a request of a higher ``order`` bound that session already."""
        self.adopt([info], salt=salt)
        if info.id in self._index:
            self._sessions.bind((salt, key), order, info.id)

    def forget(self, checkpoint_id: int) -> None:
        """The checkpoint is gone from the store: drop every trace of it."""
        if checkpoint_id in self._index:
            self._index.remove(checkpoint_id)
        self._sessions.forget_checkpoint(checkpoint_id)
        self._recency.forget(checkpoint_id)
        self._leases.pop(checkpoint_id, None)
        self._hits.pop(checkpoint_id, None)
        self._restore.pop(checkpoint_id, None)
        for other in [i for i, (_, via) in self._restore.items() if via == checkpoint_id]:
            del self._restore[other]

    # -- requests --------------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], session_key: str | None = None, *,
               media: Sequence[MediaRun] = (), salt: str | None = None) -> CheckpointInfo | None:
        """The longest known checkpoint of the scope ``salt`` a prompt of ``tokens`` (its placeholder tokens:
        ``media``, the prompt's ``media_runs``) can restore: an exact prefix leaving at least one token to run.
        The session's own continuation wins when it is at least as long as the best."""
        self._recency.tick()
        limit = len(tokens) - 1
        if limit < 1:
            return None
        best = self._index.longest(tokens, limit, media=media, salt=salt)
        bound_id = self._sessions.get((salt, session_key)) if session_key is not None else None
        bound = self._index.get(bound_id) if bound_id is not None else None
        if bound is not None and 0 < bound.length <= limit and (best is None or bound.length >= best.length) \
                and self._index.salt(bound.id) == salt and bound.tokens == tuple(tokens[:bound.length]) \
                and bound.media == clip_runs(media, bound.length):
            best = bound
        if best is None or best.length == 0:
            return None
        self._recency.use(best.id)
        self._hits[best.id] += 1
        return best

    def save_points(self, tokens: Sequence[int], start: int, named: Iterable[int] = (), *,
                    media: Sequence[MediaRun] = (), salt: str | None = None) -> list[int]:
        """Where a prefill beyond ``start`` should save: grid multiples inside the prompt, the ``named``
        positions (the Frontend's: where a chat's next turn stops reproducing this prompt), then its
        last-but-one position (the prompt-end recovery point); positions already covered (in the scope
        ``salt``) are left out."""
        last = len(tokens) - 1
        if last <= start:
            return []
        first = (start // self.grid + 1) * self.grid
        points = sorted({*range(first, last, self.grid), *(p for p in named if start < p < last), last})
        known = self._index.present(tokens, points, media=media, salt=salt)
        return [p for p in points if p not in known]

    def known(self, tokens: Sequence[int], *, media: Sequence[MediaRun] = (), salt: str | None = None) -> bool:
        """Whether a checkpoint of exactly ``tokens`` (and ``media``) is known in the scope ``salt`` (a second
        copy would hold a slot for nothing)."""
        return bool(tokens) and bool(self._index.present(tokens, [len(tokens)], media=media, salt=salt))

    def lease(self, checkpoint_id: int) -> CheckpointInfo | None:
        """Pin a checkpoint for a materialization; None (and forgotten) when the store no longer has it."""
        info = self.store.lease(checkpoint_id)
        if info is None:
            self.forget(checkpoint_id)
            return None
        try:
            self._update(info)
        except BaseException:  # the caller unleases only what it was given: give this lease back here
            self.store.unlease(checkpoint_id)
            raise
        self._leases[checkpoint_id] += 1
        return info

    def unlease(self, checkpoint_id: int) -> None:
        self.store.unlease(checkpoint_id)
        if self._leases[checkpoint_id] <= 1:
            self._leases.pop(checkpoint_id, None)
        else:
            self._leases[checkpoint_id] -= 1

    # -- pressure --------------------------------------------------------------------------------------
    def ensure_free_slot(self) -> bool:
        """Free a device checkpoint slot when every one is taken; whether one is free now."""
        usage = self.store.cache_usage()
        if usage.device_slots_total == 0:
            return False
        if usage.device_slots_used >= usage.device_slots_total:
            self.evict_one()
            usage = self.store.cache_usage()
        return usage.device_slots_used < usage.device_slots_total

    def evict_one(self, *, for_pages: bool = False) -> bool:
        """Evict the least valuable device checkpoint (see ``evict``); whether one went."""
        return self.evict(for_pages=for_pages, pages=1 if for_pages else 0) > 0

    def evict(self, *, for_pages: bool = False, pages: int = 0) -> int:
        """Drop the device copies of unleased checkpoints, least loss per byte first, until ``pages`` pages
        were given back (one checkpoint when ``pages`` is 0); keep a host replica where it is worth one and
        the host budget has (or can be given) room. Returns how many went (0: nothing could).

        ``for_pages``: the pool is short of pages, so only a checkpoint whose eviction gives pages back is a
        candidate (one whose pages a running sequence still holds frees none); when none does alone but
        checkpoints jointly hold pages, the lowest priority goes, uncovering the pages its neighbours share.
        A host replica costs a device->host copy now, so it is made only on evidence of demand: the
        checkpoint was restored before, or a session's latest continuation is bound to it. Priorities are
        ranked once per call: walking every checkpoint's tokens per victim would cost more than it saves."""
        candidates = [self._refresh(i) for i in self._index if i.on_device and i.id not in self._leases]
        if for_pages:
            freeing = [i for i in candidates if i.pages_alone > 0]
            if freeing:
                candidates = freeing
            elif self.store.cache_usage().device_pages_alone == 0:
                return 0
        restore = {i.id: self._restore_length(i) for i in candidates}
        ranked = sorted(candidates, key=lambda i: (self._device_priority(i, restore[i.id]),
                                                   -self._recency.age(i.id), i.id))
        gone = freed = 0
        for victim in ranked:
            if gone and freed >= pages:
                break
            wanted = self._hits[victim.id] > 0 or self._sessions.is_bound(victim.id)
            to_host = victim.on_host or (
                wanted and worth_host_replica(victim, prefix_length=restore[victim.id], cost=self.cost)
                and self._make_host_room(victim))
            after = self.store.evict(victim.id, to_host=to_host)
            if after is None:
                self.forget(victim.id)
            else:
                self._update(after)
            self._evictions["host" if after is not None and after.on_host else "dropped"] += 1
            gone += 1
            freed += victim.pages_alone
        return gone

    def clear(self) -> None:
        """Retire every checkpoint and forget everything (eviction counts stay: they are counters)."""
        if self._leases:
            raise RuntimeError(f"cannot clear the context cache while checkpoints {sorted(self._leases)} are "
                               "leased: unlease them first")
        self.retire_unadopted()
        for info in self._index:
            self.store.retire(info.id)
            self._index.remove(info.id)
        self._sessions.clear()
        self._recency.clear()
        self._hits.clear()
        self._restore.clear()

    def retire_unadopted(self) -> None:
        """Retire what the store published and nobody adopted (a prefill unit that failed before its saves
        were adopted): whose scope they belong to is unknown, so they never enter the index. One whose retire
        raises is kept (with the rest) for the next call: the store published it once, and only here."""
        self._unadopted.update((i.id, i) for i in self.store.published() if i.id not in self._index)
        failed: BaseException | None = None
        for checkpoint_id in list(self._unadopted):
            try:
                self.store.retire(checkpoint_id)
            except BaseException as exc:
                failed = failed or exc
                continue
            del self._unadopted[checkpoint_id]
        if failed is not None:
            raise failed

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint the manager knows, as last adopted."""
        return list(self._index)

    @property
    def evictions(self) -> dict[str, int]:
        """Evictions by outcome since the manager started (counters: kept across ``clear``)."""
        return dict(self._evictions)

    def stats(self) -> CacheStats:
        usage = self.store.cache_usage()
        return CacheStats(checkpoints=usage.checkpoints, device_bytes=usage.device_bytes,
                          host_bytes=usage.host_bytes_used, evictions=dict(self._evictions))

    # -- internals -------------------------------------------------------------------------------------
    def _update(self, info: CheckpointInfo, *, salt: str | None = None, new: bool = False) -> bool:
        """Keep ``info`` unless a newer generation of it is known; whether it was taken. Only a publication
        (``new``) brings in an unknown checkpoint, in the scope ``salt``: none enters without its scope."""
        known = self._index.get(info.id)
        if known is None and not new:
            return False
        if known is not None and known.generation > info.generation:
            return False
        if not (info.on_device or info.on_host):
            self.forget(info.id)
            return False
        self._index.add(info, salt=salt if known is None else self._index.salt(info.id))
        return True

    def _refresh(self, info: CheckpointInfo) -> CheckpointInfo:
        """The store's byte figures now (a shared page frees nothing until its last holder goes)."""
        fresh = self.store.checkpoint(info.id)
        self._update(fresh)
        return self._index.get(info.id) or fresh

    def _restore_length(self, info: CheckpointInfo) -> int:
        """What a request would restore if ``info`` were gone: the longest other checkpoint within it.

        Memoized (the walk reads every block of its tokens) until the checkpoint it names goes; one
        published later that would be longer is not looked for, so the figure errs towards keeping."""
        known = self._restore.get(info.id)
        if known is None:
            other = self._index.longest(info.tokens, info.length, exclude=info.id, media=info.media,
                                        salt=self._index.salt(info.id))
            known = (0, None) if other is None else (other.length, other.id)
            self._restore[info.id] = known
        return known[0]

    def _device_priority(self, info: CheckpointInfo, restore: int | None = None) -> float:
        restore = self._restore_length(info) if restore is None else restore
        return device_priority(info, prefix_length=restore, age=self._recency.age(info.id),
                               session_bound=self._sessions.is_bound(info.id), cost=self.cost)

    def _host_priority(self, info: CheckpointInfo) -> float:
        return host_priority(info, prefix_length=self._restore_length(info), age=self._recency.age(info.id),
                             session_bound=self._sessions.is_bound(info.id), cost=self.cost)

    def _make_host_room(self, info: CheckpointInfo) -> bool:
        """Whether the host budget can take ``info``'s replica, first dropping lower-priority unleased
        replicas when that (and only that) makes room."""
        usage = self.store.cache_usage()
        short = info.host_bytes - (usage.host_bytes_total - usage.host_bytes_used)
        if short <= 0:
            return True
        if info.host_bytes > usage.host_bytes_total:
            return False
        worth = self._host_priority(attrs.evolve(info, on_device=False))
        replicas = sorted((self._host_priority(r), r.id, r) for r in self._index
                          if r.on_host and r.id != info.id and r.id not in self._leases)
        chosen = []
        for priority, _, replica in replicas:
            if short <= 0 or priority >= worth:
                break
            chosen.append(replica)
            short -= replica.host_bytes
        if short > 0:
            return False
        for replica in chosen:
            after = self.store.drop_host(replica.id)
            if after is None:
                self.forget(replica.id)
            else:
                self._update(after)
        usage = self.store.cache_usage()
        return info.host_bytes <= usage.host_bytes_total - usage.host_bytes_used
