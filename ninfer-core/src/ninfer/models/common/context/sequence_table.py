"""The resident sequences of one Program: records by id, their StateImage slots and KV block tables.

Opening binds a slot (no pages yet: a unit's reservation takes them); forking copies the source's
StateImage whole and adopts the pages covering its frontier as a read-only prefix (``KVHistoryStore``); settling a unit appends the accepted
tokens to each ledger and frees what the unit held beyond the committed frontier. A row that
accepts fewer tokens than it consumed keeps its accepted ledger but drops its physical frontier to
zero (rollback by Replay: ``input_remaining`` then reports the accepted history to re-run).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ninfer.contract.batch import PendingRow, RowDecision
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.core.kv_pool import PoolExhausted
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.context.errors import ProgramError
from ninfer.models.common.context.kv_history import KVHistoryStore
from ninfer.models.common.context.prompt_media import PromptMedia, VisionSpec, prompt_media
from ninfer.models.common.context.sequence import RowSampling, SequenceRecord

NO_VISION = "this model was started without the vision feature: the prompt carries images or videos"


class SequenceTable:
    """Sequences bound to ``states`` slots and ``pages`` block tables, with their accepted ledgers.

    ``vision``: the media prompts the Program's encoder takes (None: text only, and ``no_vision`` says why)."""

    def __init__(self, states: StateImageStorage, kv: KVHistoryStore, *, max_model_len: int, vocab_size: int,
                 sampling_defaults: SamplingParams | None = None) -> None:
        self.states = states
        self.kv = kv
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.sampling_defaults = sampling_defaults
        self.records: dict[int, SequenceRecord] = {}
        self._ids = itertools.count(1)
        self.vision: VisionSpec | None = None
        self.no_vision = NO_VISION

    def new_id(self) -> int:
        return next(self._ids)

    def open(self, prompt: PreparedPrompt, sampling: SamplingParams) -> int:
        """Bind a StateImage slot for a new sequence (no KV pages yet)."""
        media = self.validate(prompt)
        slot = self._allocate_slot("for a new sequence")
        return self.bind(SequenceRecord(id=self.new_id(), slot=slot, prompt_len=len(prompt),
                                        ledger=list(prompt.token_ids), media=media,
                                        sampling=RowSampling.resolve(sampling, self.sampling_defaults)))

    def validate(self, prompt: PreparedPrompt) -> PromptMedia | None:
        """ValueError naming what this Program cannot run in ``prompt`` (a request-level rejection); the prompt's
        media as the sequence keeps it (None: text only)."""
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len {self.max_model_len}")
        bad = [t for t in prompt.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the model vocabulary 0..{self.vocab_size - 1}")
        return prompt_media(prompt, self.vision, self.no_vision)

    def fork(self, sequence_id: int, sampling: SamplingParams | None = None) -> int:
        """A new sequence continuing from this one's committed state: the StateImage is copied whole,
        the KV pages covering the frontier are shared (copy-on-write on the first write to a shared page)."""
        src = self.get(sequence_id)
        self.check_idle(src)
        slot = self._allocate_slot(f"to fork sequence {sequence_id}")
        self.states.copy_slot(src.slot, slot)
        resolved = src.sampling if sampling is None else RowSampling.resolve(sampling, self.sampling_defaults)
        seq = SequenceRecord(id=self.new_id(), slot=slot, prompt_len=src.prompt_len, ledger=list(src.ledger),
                             sampling=resolved, first_by_decode=src.first_by_decode, media=src.media)
        if src.computed:
            ref = self.kv.save_prefix(src, src.computed)
            self.kv.adopt(seq, ref)
            self.kv.drop_prefix(ref)
        return self.bind(seq)

    def _allocate_slot(self, purpose: str) -> int:
        try:
            return self.states.allocate()
        except PoolExhausted as exc:
            raise ProgramError(f"no free StateImage slot {purpose}: {exc}") from None

    def bind(self, seq: SequenceRecord) -> int:
        self.records[seq.id] = seq
        return seq.id

    def get(self, sequence_id: int) -> SequenceRecord:
        try:
            return self.records[sequence_id]
        except KeyError:
            raise ProgramError(f"unknown sequence id {sequence_id}") from None

    @staticmethod
    def check_idle(seq: SequenceRecord) -> None:
        if seq.pending or seq.launched:
            raise ProgramError(f"sequence {seq.id} has an unconsumed PendingBatch or LaunchedUnit row")

    def release(self, sequence_id: int) -> None:
        """Free the sequence's pages and slot and forget it."""
        seq = self.get(sequence_id)
        if seq.pending:
            raise ProgramError(f"sequence {sequence_id} has an unconsumed PendingBatch row; commit or abort it first")
        # A launched (uncollected) row may still be in flight: its writes to this slot and these pages are
        # queued before any later use of them on the same stream, and collect leaves the row out.
        self.kv.release(seq)
        self.states.free(seq.slot)
        del self.records[sequence_id]

    def reserve(self, sequence_id: int, tokens: int) -> bool:
        """Hold the pages positions computed..computed+tokens need; False (nothing taken) when they do not fit."""
        seq = self.get(sequence_id)
        if tokens < 1:
            raise ValueError(f"reserve_units needs at least one token, got {tokens}")
        end = seq.computed + tokens
        if end > self.max_model_len:
            raise ValueError(f"sequence {sequence_id}: {end} positions exceed max_model_len {self.max_model_len}")
        return self.kv.hold(seq, end)

    def commit(self, seqs: Sequence[SequenceRecord], rows: Sequence[PendingRow],
               decisions: Sequence[RowDecision]) -> None:
        """Append accepted tokens to each ledger; rows that accept nothing (or less than they consumed) roll back."""
        for seq, row, d in zip(seqs, rows, decisions, strict=True):
            seq.pending = False
            if seq.launched and (d.accepted < row.produced or d.terminal):
                seq.void_ahead = True  # the chained row's input is not (or is the last) accepted token
            if d.accepted == 0:
                self.rollback(seq)
                continue
            seq.ledger.extend(row.tokens[:d.accepted])
            # The unit consumed inputs up to the last produced token; each accepted token but the last
            # is an input the state already holds. Fewer accepted than produced (terminal, several
            # tokens) leaves state past the accepted prefix: roll back physically.
            if d.accepted < row.produced:
                self.rollback(seq)
            self.kv.settle(seq)

    def abort(self, seqs: Sequence[SequenceRecord]) -> None:
        """Drop the rows' provisional tokens: ledgers stay at the pre-unit frontier; state is rebuilt by Replay."""
        for seq in seqs:
            seq.pending = False
            seq.void_ahead = seq.launched > 0
            self.rollback(seq)

    def rollback(self, seq: SequenceRecord) -> None:
        seq.computed = 0
        self.kv.settle(seq)

    def reserved_pages(self) -> int:
        return self.kv.reserved(self.records.values())
