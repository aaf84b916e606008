"""Pause and resume: owning ResumeStates (Snapshot: host copies; Replay: ledger only) and their store.

``PausedStates`` is a Program's record of the ResumeStates it handed out and has not taken back,
and of the host bytes they hold against its host budget. Pausing copies a sequence's StateImage and
the KV pages covering its frontier to the host (Snapshot) or keeps only its accepted ledger
(Replay); resuming binds a fresh slot and pages and restores the copies, or leaves the frontier at
zero for the engine to re-run the ledger through prefill (exact: every draw depends only on the
seed and the token index). ``demote`` revokes a Snapshot to a Replay of the same ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ninfer.contract.model import PauseMode
from ninfer.core.kv_pool import HostPages, pages_for
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.context.errors import ProgramError
from ninfer.models.common.context.kv_history import KVHistoryStore
from ninfer.models.common.context.sequence import RowSampling, SequenceRecord

if TYPE_CHECKING:
    from ninfer.models.common.context.prompt_media import PromptMedia


@attrs.frozen(kw_only=True, eq=False)
class ReplayResume:
    """Enough to rebuild the sequence by re-executing its accepted history.

    The sampling seed and the ledger length fix every future draw, so the continuation is the same.
    ``frontier`` is the physical frontier at pause time (what resume reserves to rebuild).
    """

    program_id: int
    ledger: tuple[int, ...]
    prompt_len: int
    sampling: RowSampling
    frontier: int
    first_by_decode: bool = False  # the prompt's last token is the first decode input (``SequenceRecord``)
    drafts: tuple[int, ...] = ()  # a speculative Program's drafts (Replay makes them again as it rebuilds)
    media: PromptMedia | None = None  # the prompt's images and videos (the encoder runs again when reached)

    @property
    def host_bytes(self) -> int:
        return 0

    def as_replay(self) -> ReplayResume:
        """The same accepted history without host copies (what a revoked Snapshot becomes)."""
        return ReplayResume(program_id=self.program_id, ledger=self.ledger, prompt_len=self.prompt_len,
                            sampling=self.sampling, frontier=self.frontier, first_by_decode=self.first_by_decode,
                            drafts=self.drafts, media=self.media)


@attrs.frozen(kw_only=True, eq=False)
class SnapshotResume(ReplayResume):
    """Replay data plus host copies of the StateImage and the KV pages covering ``frontier`` positions."""

    state_image: torch.Tensor = attrs.field(repr=False)
    kv_pages: HostPages = attrs.field(repr=False)  # the pages' K/V and aux fields

    @property
    def host_bytes(self) -> int:
        return self.state_image.numel() * self.state_image.element_size() + self.kv_pages.nbytes


class PausedStates:
    """The ResumeStates one Program handed out and has not taken back, and the host bytes they hold."""

    def __init__(self, program_id: int, states: StateImageStorage, kv: KVHistoryStore, host_budget_bytes: int) -> None:
        self.program_id = program_id
        self.states = states
        self.kv = kv
        self.pool = kv.pool
        self.host_budget_bytes = host_budget_bytes
        self.host_bytes_used = 0
        self._held: dict[int, ReplayResume] = {}

    def snapshot_bytes(self, seq: SequenceRecord) -> int:
        """Host bytes a Snapshot of ``seq`` would hold now: its StateImage and the pages covering its frontier."""
        return self.states.image_bytes + pages_for(seq.computed, self.pool.page_size) * self.pool.nbytes_per_page

    def can_snapshot(self, seq: SequenceRecord) -> bool:
        return self.host_bytes_used + self.snapshot_bytes(seq) <= self.host_budget_bytes

    def pause(self, seq: SequenceRecord, mode: PauseMode, *,
              release: Callable[[], None] | None = None) -> ReplayResume:
        """An owning ResumeState of ``seq`` at its committed boundary. ``release`` frees ``seq`` once its copies
        are made (else the caller does): the state is held only if that succeeds, so a failed release hands out
        nothing and holds nothing."""
        common = dict(program_id=self.program_id, ledger=tuple(seq.ledger), prompt_len=seq.prompt_len,
                      sampling=seq.sampling, frontier=seq.computed, first_by_decode=seq.first_by_decode,
                      drafts=seq.drafts, media=seq.media)
        if mode == "snapshot":
            if not self.can_snapshot(seq):
                raise ProgramError(f"sequence {seq.id}: snapshot needs {self.snapshot_bytes(seq)} host bytes, "
                                   f"{self.host_budget_bytes - self.host_bytes_used} of the budget left")
            kv = self.pool.read_to_host(seq.pages[:pages_for(seq.computed, self.pool.page_size)])
            state = SnapshotResume(**common, state_image=self.states.save(seq.slot), kv_pages=kv)
        elif mode == "replay":
            state = ReplayResume(**common)
        else:
            raise ValueError(f"pause mode must be 'snapshot' or 'replay', got {mode!r}")
        if release is not None:
            release()
        self._hold(state)
        return state

    def resume(self, resume_state: Any, new_id: Callable[[], int]) -> SequenceRecord | None:
        """A record bound to a fresh slot and the pages of the rebuild up to the old frontier plus the first
        new unit (a Snapshot restored into them); None, keeping the state, when they are not free now. If the
        restore raises, the state is kept (the caller discards it) and nothing else is held."""
        state = self._get(resume_state)
        positions = min(state.frontier + 1, len(state.ledger))
        need = pages_for(positions, self.pool.page_size)
        if self.states.num_free == 0 or need > self.pool.allocator.num_free:
            return None
        slot, seq = self.states.allocate(), None
        try:  # all or nothing: a restore that fails frees what it bound and keeps the state (still discardable)
            seq = SequenceRecord(id=new_id(), slot=slot, prompt_len=state.prompt_len, ledger=list(state.ledger),
                                 sampling=state.sampling, first_by_decode=state.first_by_decode,
                                 drafts=state.drafts, media=state.media)
            self.kv.append_fresh(seq, need)
            if isinstance(state, SnapshotResume):
                self.states.restore(seq.slot, state.state_image)
                self.pool.write_pages(seq.pages[:state.kv_pages.num_pages], state.kv_pages)
                seq.computed = state.frontier
        except BaseException:
            if seq is not None:
                self.kv.release(seq)
            self.states.free(slot)
            raise
        self._drop(state)
        return seq

    def discard(self, resume_state: Any) -> None:
        self._drop(self._get(resume_state))

    def demote(self, resume_state: Any) -> ReplayResume:
        """Revoke a Snapshot: drop its host copies, keep the ledger and frontier (Replay rebuilds them exactly)."""
        state = self._get(resume_state)
        if not isinstance(state, SnapshotResume):
            raise ProgramError("ResumeState holds no Snapshot to revoke (it already resumes by Replay)")
        replay = state.as_replay()  # before the drop: a failure leaves the Snapshot held, still discardable
        self._drop(state)
        self._hold(replay)
        return replay

    def _hold(self, state: ReplayResume) -> None:
        self._held[id(state)] = state
        self.host_bytes_used += state.host_bytes

    def _drop(self, state: ReplayResume) -> None:
        del self._held[id(state)]
        self.host_bytes_used -= state.host_bytes

    def _get(self, resume_state: Any) -> ReplayResume:
        if not isinstance(resume_state, ReplayResume) or resume_state.program_id != self.program_id:
            raise ProgramError("ResumeState was not produced by this Program")
        if id(resume_state) not in self._held:
            raise ProgramError("ResumeState was already resumed or discarded")
        return resume_state
