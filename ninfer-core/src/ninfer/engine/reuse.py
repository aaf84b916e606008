"""Reuse: what the engine worker does with the context cache.

At admission a request restores the longest usable checkpoint (its session's latest continuation first,
then the shared prefix index) under a reader lease, and its prefill gets save points: a grid inside a
long prompt and the prompt's end. A request whose prompt a resident's pending save point would cover
further waits for that save instead of computing the same prefix again, which is how ``n > 1`` (or any
burst of one prompt) prefills once and forks. A successful finish keeps the sequence's committed state
as a continuation and binds the request's session key to it. Under device pressure the cache is
reclaimed (demoted to host replicas, or dropped) before any resident request is paused. Policy lives in
the ResourceManager (``ninfer.engine.context_cache``); the Program's stores hold every byte.

A request sees only its own cache scope (``GenerationRequest.cache_salt``): it restores, skips save points,
waits for pending saves and continues sessions only within it, and what it saves enters it. A prefill unit
runs one sequence, so what the store publishes during it is that request's.
"""

from __future__ import annotations

import enum
import logging

from ninfer.contract.context import CheckpointInfo, ContextStore, MediaRun, TurnBoundary, media_runs
from ninfer.contract.events import FinishReason
from ninfer.contract.model import Program
from ninfer.engine.context_cache import ResourceManager
from ninfer.engine.context_cache.prefix_index import common_prefix
from ninfer.engine.errors import Unrepresentable, is_fatal
from ninfer.engine.metrics import MetricsRecorder
from ninfer.engine.request import RequestRecord, RequestState

log = logging.getLogger(__name__)

KEPT_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS)


class Admission(enum.Enum):
    WAIT = "wait"  # a resident's pending save point will cover more of this prompt: admit after it


class Reuse:
    def __init__(self, program: Program, metrics: MetricsRecorder, *, enabled: bool, grid: int) -> None:
        self.program = program
        self.metrics = metrics
        self.store: ContextStore | None = program if enabled and isinstance(program, ContextStore) else None
        block = program.kv_pools[0].page_size if program.kv_pools else 16
        self.manager = ResourceManager(self.store, block=block, grid=grid) if self.store is not None else None
        self.block = block
        self.min_wait_gain = block  # waiting for another's save must save at least one block of prefill
        # sequence -> (prompt, media, save points, cache salt)
        self.planned: dict[int, tuple[tuple[int, ...], tuple[MediaRun, ...], list[int], str | None]] = {}
        self.waiting_on_save = False
        self._publishing: str | None = None  # the scope of the request whose prefill unit runs now

    def applies(self, rec: RequestRecord) -> bool:
        return self.manager is not None and rec.request.context_cache

    # -- admission -----------------------------------------------------------------------------------
    def open(self, rec: RequestRecord, residents: list[RequestRecord]) -> int | Admission:
        """Bind ``rec``'s sequence: restored from the best checkpoint, or fresh when the restore does not fit
        (a host replica needs free pages). WAIT: a resident's pending save point is worth waiting for.
        Unrepresentable: the Program cannot represent the prompt (a ValueError of its validation; one raised
        later, by the save points, is a failure of the server's, not a rejection)."""
        program = self.program
        if not self.applies(rec):
            return _validated(program.open_sequence, rec.prompt, rec.sampling)
        tokens, media = rec.prompt.token_ids, media_runs(rec.prompt)  # media: which image each placeholder is
        salt = rec.request.cache_salt
        hit = self.manager.lookup(tokens, rec.request.session_key, media=media, salt=salt)
        have = hit.length if hit is not None else 0
        if self._pending_save(tokens, media, salt, residents) >= have + self.min_wait_gain:
            self.waiting_on_save = True
            return Admission.WAIT
        seq = None
        try:  # all or nothing: what a failure leaves bound would outlive the request that raised
            if hit is not None and self.manager.lease(hit.id) is not None:
                try:
                    seq = _validated(self.store.open_cached, rec.prompt, rec.sampling, hit.id)
                finally:
                    self.manager.unlease(hit.id)
            if seq is None:
                have = 0
                seq = _validated(program.open_sequence, rec.prompt, rec.sampling)
            named = () if rec.prompt.history_boundary is None else (rec.prompt.history_boundary,)
            points = self.manager.save_points(tokens, have, named, media=media, salt=salt)
            self.store.plan_saves(seq, points)
            if points:
                self.planned[seq] = (tuple(tokens), media, points, salt)
        except BaseException:
            if seq is not None:
                self.planned.pop(seq, None)
                program.release(seq)
            raise
        rec.cached_tokens = have
        return seq

    def admitted(self, rec: RequestRecord) -> None:
        """Count the lookup of a request that was admitted (a refused admission looks up again later)."""
        if self.applies(rec):
            self.metrics.prefix_cache_lookup(len(rec.prompt), rec.cached_tokens)

    def _pending_save(self, tokens: tuple[int, ...], media: tuple[MediaRun, ...], salt: str | None,
                      residents: list[RequestRecord]) -> int:
        """The furthest save point a prefilling resident of the scope ``salt`` has still to reach inside
        ``tokens[:-1]`` (another scope's save is none of this request's business, nor its timing)."""
        best = 0
        for r in residents:
            plan = self.planned.get(r.sequence_id) if r.state is RequestState.PREFILL else None
            if plan is None or plan[3] != salt:
                continue
            prompt, prompt_media, points, _ = plan
            frontier = len(prompt) - 1 - self.program.input_remaining(r.sequence_id)
            common = common_prefix(tokens, media, prompt, prompt_media)
            reach = [p for p in points if frontier < p <= min(common, len(tokens) - 1)]
            if reach:
                best = max(best, reach[-1])
        return best

    # -- units ---------------------------------------------------------------------------------------
    def before_prefill(self, rec: RequestRecord) -> None:
        """A prefill unit may end at a save point: keep a checkpoint slot free for it, and note whose unit
        it is (its saves enter that request's scope)."""
        if self.manager is None:
            return
        try:  # saves of an earlier unit that failed before their adoption (of no known scope)
            self.manager.retire_unadopted()
        except Exception as exc:  # that unit's leftovers: kept for the next call, this request goes on
            if is_fatal(exc):
                raise
            log.warning("retiring the unadopted checkpoints of a failed prefill unit failed (%s: %s); retried "
                        "at the next prefill", type(exc).__name__, exc)
        self._publishing = rec.request.cache_salt
        if rec.sequence_id in self.planned:
            self._ensure_free_slot()

    def after_prefill(self) -> bool:
        """Adopt what the Program published (the saves of the unit ``before_prefill`` announced); True when a
        waiting admission should look again."""
        if self.manager is None:
            return False
        infos = self.store.published()
        if infos:
            try:
                self.manager.adopt(infos, salt=self._publishing)
            except BaseException:
                self._drop(infos)
                raise
        again = self.waiting_on_save
        self.waiting_on_save = False
        return again

    def forget_sequence(self, sequence_id: int) -> None:
        self.planned.pop(sequence_id, None)

    # -- finish ------------------------------------------------------------------------------------
    def keep(self, rec: RequestRecord, reason: FinishReason) -> None:
        """Before release: keep a successful request's continuation and bind its session key to it."""
        if not self.applies(rec) or reason not in KEPT_REASONS or not rec.resident:
            return
        boundary = rec.boundary
        if isinstance(boundary, TurnBoundary) and boundary.exact is False:
            return  # the next turn re-renders differently: its prompt-end checkpoint is what it can reuse
        history, media = (*rec.prompt.token_ids, *rec.token_ids), media_runs(rec.prompt)
        salt = rec.request.cache_salt
        if self.manager.known(history[:-1], media=media, salt=salt) \
                or self.manager.known(history, media=media, salt=salt):
            return  # an identical continuation is kept already (the same prompt, the same answer)
        if not self._ensure_free_slot():
            return
        info = self.store.save_continuation(rec.sequence_id, "turn" if isinstance(boundary, TurnBoundary)
                                            else "final")
        if info is None:
            return
        try:
            if rec.request.session_key is None:
                self.manager.adopt([info], salt=salt)
            else:  # binding adopts it
                self.manager.bind_session(rec.request.session_key, rec.ticket, info, salt=salt)
        except BaseException:
            self._drop([info])
            raise

    def _drop(self, infos: list[CheckpointInfo]) -> None:
        """Retire checkpoints whose adoption failed (perhaps half done): the store published them to no one
        else, and a checkpoint the manager does not know would hold its slot and pages for good."""
        for info in infos:
            self.manager.forget(info.id)
            self.store.retire(info.id)

    # -- pressure and observation -----------------------------------------------------------------------
    def reclaim(self, tokens: int = 1) -> bool:
        """Give KV pages back for a unit of ``tokens`` positions by evicting the least valuable checkpoints
        (as many as that takes, ranked once); False when none could go."""
        if self.manager is None:
            return False
        gone = self.manager.evict(for_pages=True, pages=-(-tokens // self.block))
        self._count_evictions()
        return gone > 0

    def _ensure_free_slot(self) -> bool:
        free = self.manager.ensure_free_slot()
        self._count_evictions()
        return free

    def _count_evictions(self) -> None:
        self.metrics.cache_evictions(self.manager.evictions)

    def clear(self) -> None:
        if self.manager is not None:
            self.manager.clear()

    def record_stats(self) -> None:
        if self.manager is not None:
            self.metrics.cache_state(self.manager.stats())


def _validated(bind, *args) -> int | None:
    """A binding call whose ValueError (the Program's validation, before it binds anything) rejects the request."""
    try:
        return bind(*args)
    except ValueError as exc:
        raise Unrepresentable(f"request cannot be represented: {exc}") from exc
