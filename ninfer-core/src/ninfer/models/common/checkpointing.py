"""The ContextStore half of PagedProgram: save points, checkpoints of sequences, restores from them.

``plan_saves`` gives a sequence the frontier positions where its prefill ends a unit and saves a
checkpoint (``PagedProgram.prefill`` honours them); a save point at the prompt's last token makes that
token the first decode input, so the prompt-end checkpoint (state after every prompt token but the
last) is exactly what an identical or extended prompt restores. ``save_continuation`` keeps a finished
sequence's state the same way. ``open_cached`` binds a new sequence restored from a leased checkpoint:
its StateImage copied, its KV prefix adopted (shared pages, copy-on-write on a conflicting write), or,
from a host replica, both copied into a fresh slot and pages. The physical ledger is ``CheckpointStore``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ninfer.contract.context import CacheUsage, CheckpointInfo, CheckpointKind, clip_runs
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.models.common.context.checkpoints import CheckpointStore
from ninfer.models.common.context.errors import ProgramError
from ninfer.models.common.context.sequence import RowSampling, SequenceRecord
from ninfer.models.common.context.sequence_table import SequenceTable


class Checkpointing:
    """Implements ``ninfer.contract.context.ContextStore`` over ``self.sequences`` and ``self.checkpoints``."""

    sequences: SequenceTable
    checkpoints: CheckpointStore

    def plan_saves(self, sequence_id: int, positions: Sequence[int]) -> None:
        seq = self.sequences.get(sequence_id)
        points = list(positions)
        limit = seq.prompt_len - 1
        if seq.generated or any(b <= a for a, b in zip(points, points[1:], strict=False)) \
                or (points and not seq.computed < points[0] <= points[-1] <= limit):
            raise ProgramError(f"sequence {sequence_id}: save points {points[:8]} must ascend inside "
                               f"({seq.computed}, {limit}] before the first token")
        seq.save_points = points
        seq.first_by_decode = seq.first_by_decode or (bool(points) and points[-1] == limit)

    def save_point_reached(self, seq: SequenceRecord) -> None:
        """After a prefill unit: checkpoint the sequence when its frontier is its next save point."""
        if seq.save_points and seq.computed == seq.save_points[0]:
            seq.save_points.pop(0)
            self.checkpoints.save(seq, "prompt" if seq.computed == seq.prompt_len - 1 else "grid")

    def published(self) -> list[CheckpointInfo]:
        return self.checkpoints.drain()

    def lease(self, checkpoint_id: int) -> CheckpointInfo | None:
        return self.checkpoints.lease(checkpoint_id)

    def unlease(self, checkpoint_id: int) -> None:
        self.checkpoints.unlease(checkpoint_id)

    def open_cached(self, prompt: PreparedPrompt, sampling: SamplingParams, checkpoint_id: int) -> int | None:
        ck = self.checkpoints.get(checkpoint_id)
        n = len(ck.tokens)
        media = self.sequences.validate(prompt)
        runs = clip_runs(media.runs, n) if media is not None else ()
        if not (n < len(prompt) and tuple(prompt.token_ids[:n]) == ck.tokens and runs == ck.media):
            raise ProgramError(f"checkpoint {checkpoint_id} ({n} tokens) is not a proper prefix of the prompt (token "
                               f"ids and media)")
        table = self.sequences
        if table.states.num_free == 0 or self.checkpoints.pages_to_restore(ck) > table.kv.pool.allocator.num_free:
            return None
        seq = SequenceRecord(id=table.new_id(), slot=table.states.allocate(), prompt_len=len(prompt),
                             ledger=list(prompt.token_ids), first_by_decode=n == len(prompt) - 1, media=media,
                             sampling=RowSampling.resolve(sampling, table.sampling_defaults))
        try:
            self.checkpoints.restore(ck, seq)
        except BaseException:
            table.kv.release(seq)
            table.states.free(seq.slot)
            raise
        return table.bind(seq)

    def save_continuation(self, sequence_id: int, kind: CheckpointKind) -> CheckpointInfo | None:
        seq = self.sequences.get(sequence_id)
        if seq.pending:
            raise ProgramError(f"sequence {sequence_id} has an unconsumed PendingBatch row; commit or abort it first")
        # A launched (pipelined) row's input is the row's last accepted token (a terminal commit voids only its
        # output), so the state it writes is committed state: the copies queue behind it on the stream.
        return self.checkpoints.save(seq, kind, publish=False)  # the caller adopts it

    def checkpoint(self, checkpoint_id: int) -> CheckpointInfo:
        return self.checkpoints.info(self.checkpoints.get(checkpoint_id))

    def evict(self, checkpoint_id: int, *, to_host: bool) -> CheckpointInfo | None:
        return self.checkpoints.evict(checkpoint_id, to_host=to_host)

    def drop_host(self, checkpoint_id: int) -> CheckpointInfo | None:
        return self.checkpoints.drop_host(checkpoint_id)

    def retire(self, checkpoint_id: int) -> None:
        self.checkpoints.retire(checkpoint_id)

    def cache_usage(self) -> CacheUsage:
        return self.checkpoints.usage()
