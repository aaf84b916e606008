"""WorkerState: what the engine worker's parts share, and only the worker touches.

The cycle policy, the batch commit and settlement all read and change it: the Program and the
Scheduler, which request holds which Program sequence id, the units in flight, and the events that
decide what the next cycle tries (a resume after a capacity event, an admission scan after an arrival).
"""

from __future__ import annotations

import attrs

from ninfer.contract.batch import LaunchedUnit, PendingBatch
from ninfer.contract.model import Program
from ninfer.engine.errors import InvariantBroken
from ninfer.engine.metrics import MetricsRecorder
from ninfer.engine.request import RequestRecord, RequestState
from ninfer.engine.reuse import Reuse
from ninfer.engine.scheduler import Scheduler


@attrs.define(eq=False, kw_only=True)
class WorkerState:
    program: Program
    scheduler: Scheduler
    metrics: MetricsRecorder
    reuse: Reuse
    device: str | None = None  # where the Program runs (a recovered failure checks a CUDA device is sound)
    by_seq: dict[int, RequestRecord] = attrs.Factory(dict)  # Program sequence id -> resident request
    capacity_event: bool = False   # a finish, a pause or the end of a protected recovery: try a resume
    admission_event: bool = False  # an arrival or freed room: scan fresh admission once
    changed: bool = False          # this cycle changed some request's state (the worker must not sleep)
    inflight: PendingBatch | None = None  # the batch being consumed (aborted if the engine fails)
    # A decode step launched but not collected, with its rows (PipelinedDecode Programs only).
    ahead: tuple[LaunchedUnit, list[RequestRecord]] | None = None

    def bind(self, rec: RequestRecord, seq: int) -> None:
        """Make ``rec`` resident on the Program's sequence ``seq``."""
        if seq in self.by_seq:
            raise InvariantBroken(f"Program returned sequence id {seq} that is already bound")
        rec.sequence_id = seq
        self.by_seq[seq] = rec
        self.scheduler.make_resident(rec)
        self.changed = True
        self.set_input_state(rec)

    def unbind(self, rec: RequestRecord) -> int:
        """Forget ``rec``'s sequence id (the caller releases or pauses it in the Program) and return it."""
        seq = rec.sequence_id
        del self.by_seq[seq]
        rec.sequence_id = None
        self.reuse.forget_sequence(seq)
        return seq

    def set_input_state(self, rec: RequestRecord) -> None:
        """PREFILL / REPLAY while the Program has input positions left to run, then DECODE_READY."""
        if self.program.input_remaining(rec.sequence_id) == 0:
            rec.state = RequestState.DECODE_READY
        else:
            rec.state = RequestState.REPLAY if rec.token_ids else RequestState.PREFILL

    def live(self) -> list[RequestRecord]:
        """Every request the worker holds: waiting, resident and paused."""
        s = self.scheduler
        return [*s.waiting, *s.residents.values(), *s.paused.values()]

    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.residents or s.paused or self.ahead)
