"""CyclePolicy: who runs in this worker cycle, and what it may hold.

It applies the Scheduler's rules to the Program's real capacity: the oldest paused request's full
resume after a capacity event; unit permits per resident row (``Program.reserve_units``), where a row
that does not fit pauses the youngest resident younger than itself (Snapshot when host room allows,
perhaps after revoking cheaper paused Snapshots, else Replay); fresh admission in submission order
with what is left; and whether a pipelined decode phase is steady enough to chain its next step.
A step that raises ends only the request it serves (``Settlement.recover``): the one being admitted,
resumed, reserved for or paused; a pause by Snapshot that fails is retried once by Replay.
"""

from __future__ import annotations

import logging
import time

from ninfer.contract.config import PauseChoice
from ninfer.contract.events import FinishReason, GenerationStart
from ninfer.contract.model import SnapshotCost
from ninfer.engine.errors import CapacityExhausted, InvariantBroken, Unrepresentable, is_fatal
from ninfer.engine.ingress import Ingress
from ninfer.engine.request import RequestRecord, RequestState
from ninfer.engine.reuse import Admission
from ninfer.engine.settlement import Settlement
from ninfer.engine.worker_state import WorkerState

log = logging.getLogger(__name__)


class CyclePolicy:
    def __init__(self, state: WorkerState, settlement: Settlement, ingress: Ingress, *, prefill_chunk: int,
                 pause_mode: PauseChoice, max_model_len: int) -> None:
        self.state = state
        self.settlement = settlement
        self.ingress = ingress
        self.prefill_chunk = prefill_chunk
        self.pause_mode = pause_mode
        self.max_model_len = max_model_len

    # -- resume ----------------------------------------------------------------------------------------
    def try_resume(self) -> None:
        """On a capacity event (or with no residents), rebind the oldest paused request if it fits."""
        st, s = self.state, self.state.scheduler
        if s.protected is not None or not s.paused:
            return
        if not (st.capacity_event or not s.residents):
            return
        st.capacity_event = False
        rec = s.oldest_paused()
        try:
            self._resume(rec)
        except Exception as exc:
            self.settlement.recover("resume", [rec], exc)

    def _resume(self, rec: RequestRecord) -> None:
        st, s = self.state, self.state.scheduler
        while True:
            seq = st.program.resume(rec.resume_state) if s.free_lanes > 0 else None
            if seq is not None:
                break
            if s.free_lanes > 0 and st.reuse.reclaim():  # the optional cache goes before any resident
                continue
            # Does not fit. Older residents will free capacity; otherwise this is the oldest request
            # and may take room from the youngest borrower.
            if s.has_older_resident(rec):
                return
            victim = s.victim_for(rec)
            if victim is None:
                if not s.residents:
                    self.settlement.finish(rec, FinishReason.ERROR, CapacityExhausted(
                        f"request {rec.request_id} cannot be resumed: its history exceeds the Program's capacity"))
                return
            self.pause(victim)
        rec.resume_state = rec.snapshot = None
        st.bind(rec, seq)
        s.protected = rec
        st.admission_event = True

    # -- unit permits and pressure ---------------------------------------------------------------------
    def grant_decode_permits(self) -> list[RequestRecord]:
        """Decode rows that hold the reservation of one decode unit, in permit order."""
        granted = []
        for rec in self.state.scheduler.decode_candidates():
            if rec.resident and self._reserved(rec, lambda r=rec: self.decode_positions(r)):
                granted.append(rec)
        return granted

    def decode_positions(self, rec: RequestRecord) -> int:
        """Positions ``rec``'s decode unit writes: the Program's ``decode_span`` (1, or more with speculative
        drafts), no further than max_model_len (the next input sits at position len(history) - 1)."""
        return max(1, min(self.state.program.decode_span, self.max_model_len - len(rec.prompt) - rec.generated + 1))

    def grant_prefill_permit(self) -> RequestRecord | None:
        """The one Prefill/Replay row of this cycle, its chunk reserved."""
        s = self.state.scheduler
        while True:
            rec = s.pick_prefill(s.prefill_candidates())
            if rec is None:
                return None
            if self._reserved(rec, lambda r=rec: self.chunk(r)):
                return rec

    def chunk(self, rec: RequestRecord) -> int:
        """Input positions ``rec``'s next prefill/Replay unit runs."""
        return min(self.prefill_chunk, self.state.program.input_remaining(rec.sequence_id))

    def _reserved(self, rec: RequestRecord, positions) -> bool:
        """``reserve`` for the ``positions()`` of ``rec``'s next unit; a failure ends ``rec`` alone (False)."""
        try:
            n = positions()
            if n <= 0:
                raise InvariantBroken(f"request {rec.request_id} in {rec.state.value} with no input remaining")
            return self.reserve(rec, n)
        except Exception as exc:
            self.settlement.recover("unit reservation", [rec], exc)
            return False

    def reserve(self, rec: RequestRecord, tokens: int) -> bool:
        """Reserve one unit for ``rec``, pausing younger residents under pressure; False if ``rec`` cannot run."""
        st, s = self.state, self.state.scheduler
        while True:
            if st.program.reserve_units(rec.sequence_id, tokens):
                return True
            if st.reuse.reclaim(tokens):  # the optional cache goes before any resident is paused
                continue
            victim = s.victim_for(rec)
            if victim is not None:
                self.pause(victim)
                continue
            if len(s.residents) > 1:
                self.pause(rec)  # it is the youngest: it waits for the older ones to free capacity
            else:
                self.settlement.finish(rec, FinishReason.ERROR, CapacityExhausted(
                    f"request {rec.request_id} alone needs more KV/state than the Program has "
                    f"({tokens} more positions did not fit)"))
            return False

    def pause(self, rec: RequestRecord) -> None:
        """Pause a resident at its committed boundary: Snapshot if host room allows (auto), else Replay. If the
        Program cannot pause it by Snapshot (its host copy failed), it pauses by Replay; if not at all, it ends."""
        try:
            self._pause(rec)
        except Exception as exc:
            self.settlement.recover("pause", [rec], exc)

    def _pause(self, rec: RequestRecord) -> None:
        st = self.state
        seq = rec.sequence_id
        mode = self.pause_mode
        cost = None if mode == "replay" else st.program.snapshot_cost(seq)
        if mode == "auto":
            if not st.program.can_snapshot(seq):
                self.revoke_snapshots(cost)
            mode = "snapshot" if st.program.can_snapshot(seq) else "replay"
        try:
            rec.resume_state = st.program.pause(seq, mode)
        except Exception as exc:
            if mode != "snapshot" or is_fatal(exc):
                raise
            log.warning("pausing %s by Snapshot failed (%s: %s); it pauses by Replay", rec.request_id,
                        type(exc).__name__, exc)
            mode = "replay"
            rec.resume_state = st.program.pause(seq, mode)
        rec.snapshot = cost if mode == "snapshot" else None
        st.unbind(rec)
        rec.state = RequestState.PAUSED
        rec.preemptions += 1
        st.scheduler.make_paused(rec)
        self.check_host_bytes()
        st.metrics.preempted(mode)
        st.capacity_event = st.changed = True
        st.admission_event = False  # the room just freed belongs to the row under pressure

    def revoke_snapshots(self, need: SnapshotCost) -> None:
        """Host pressure on a pause: demote paused Snapshots to Replay when the Scheduler's rule says the
        new Snapshot is worth more than what they save (their device side is already free)."""
        st = self.state
        u = st.program.usage()
        shortfall = u.host_bytes_used + need.host_bytes - u.host_bytes_total
        for victim in st.scheduler.revocations_for(shortfall, need.replay_positions):
            try:
                victim.resume_state = st.program.demote(victim.resume_state)
            except Exception as exc:  # the paused request whose Snapshot it is ends (its host bytes go)
                self.settlement.recover("Snapshot revocation", [victim], exc)
                continue
            victim.snapshot = None
            st.metrics.snapshot_revoked()

    def check_host_bytes(self) -> None:
        """The Program's host bytes are exactly the Snapshots the paused requests hold."""
        held = sum(r.snapshot.host_bytes for r in self.state.scheduler.paused.values() if r.snapshot is not None)
        used = self.state.program.usage().host_bytes_used
        if used != held:
            raise InvariantBroken(f"Program holds {used} host bytes, paused Snapshots account for {held}")

    # -- fresh admission -------------------------------------------------------------------------------
    def admit_fresh(self) -> None:
        """After an arrival or capacity event: bind waiting requests in submission order while they fit."""
        st, s = self.state, self.state.scheduler
        if not st.admission_event:
            return
        st.admission_event = False
        while s.waiting and s.free_lanes > 0 and s.fresh_admission_open():
            rec = s.waiting[0]
            try:
                seq = st.reuse.open(rec, list(s.residents.values()))
            except Unrepresentable as exc:  # the Program's validation, before binding: a request-level rejection
                self.settlement.finish(rec, FinishReason.ERROR, exc)
                continue
            except Exception as exc:  # binding or the context cache's restore failed: this request ends
                self.settlement.recover("admission", [rec], exc)  # (a sequence it left bound fails the engine)
                continue
            if seq is Admission.WAIT:
                return  # a resident's pending save will cover this prompt; its landing wakes admission
            try:
                fits = self._reserve_first_unit(seq)
            except Exception as exc:
                st.reuse.forget_sequence(seq)
                st.program.release(seq)
                self.settlement.recover("admission", [rec], exc)
                continue
            if not fits:
                st.reuse.forget_sequence(seq)
                st.program.release(seq)
                if not s.residents:  # the whole device is free and the first chunk still does not fit
                    self.settlement.finish(rec, FinishReason.ERROR, CapacityExhausted(
                        f"request {rec.request_id}: its first prefill chunk does not fit the Program's capacity"))
                    continue
                return
            s.waiting.popleft()
            self._admitted(rec, seq)

    def _reserve_first_unit(self, seq: int) -> bool:
        """The first unit of a just-bound sequence: a prefill chunk, or one decode position when it restored the
        whole prompt but its last token. The optional cache is reclaimed first when the pool is short."""
        st = self.state
        tokens = min(self.prefill_chunk, st.program.input_remaining(seq) or 1)
        while not st.program.reserve_units(seq, tokens):
            if not st.reuse.reclaim(tokens):
                return False
        return True

    def _admitted(self, rec: RequestRecord, seq: int) -> None:
        st, s = self.state, self.state.scheduler
        now = time.monotonic()
        rec.admitted_at = now
        st.bind(rec, seq)
        if s.paused:
            s.note_fresh_admission()
        st.metrics.admitted(len(rec.prompt), now - rec.submitted_at)
        st.reuse.admitted(rec)
        rec.channel.publish(GenerationStart(request_id=rec.request_id, prompt_tokens=len(rec.prompt),
                                            cached_tokens=rec.cached_tokens))

    # -- pipelined decode ------------------------------------------------------------------------------
    def steady(self, rows: list[RequestRecord]) -> bool:
        """Whether the next cycle would decode exactly these rows again, assuming none of them ends now.

        Anything else that could happen (an arrival, an admission into a free lane, a resume after a
        capacity event, a prefill, a cancellation or deadline, the last token of a row's budget, a full KV
        pool, a worker call, closing) lets the pipeline drain first. Requests waiting for a lane, or paused
        with no capacity event since, do not: the next cycle could not start them either.
        """
        st, s = self.state, self.state.scheduler
        if st.program.decode_span > 1:  # a speculative unit's positions follow its acceptance: no chaining
            return False
        if self.ingress.pending() or len(s.residents) != len(rows):
            return False
        if (s.waiting and s.free_lanes > 0) or (s.paused and (st.capacity_event or s.protected is not None)):
            return False
        for rec in rows:
            if rec.state is not RequestState.DECODE_READY or rec.interrupted(time.monotonic()) is not None \
                    or rec.generation_room(self.max_model_len) < 2:  # room still counts the launched token
                return False
        # Reservations for the chained positions (atomic per row; a refusal leaves the rest to settle).
        return all(st.program.reserve_units(rec.sequence_id, 1) for rec in rows)
