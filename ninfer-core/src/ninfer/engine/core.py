"""EngineCore: the one worker that owns request state, the Scheduler and the Program.

Ingress (``submit``), consumers (handles) and the gateway only touch the inbox, cancellation flags
and response channels; every request-state change and every Program call happens on the worker.

One worker cycle (design document, "worker cycle"):
1. take new submissions; settle cancellations, deadlines and queue timeouts at this stable boundary;
2. on a capacity event, try the oldest paused request's full resume (one protected recovery at a time);
3. unit permits per resident row, protected recovery first, then ticket order; pressure pauses the
   youngest resident (Snapshot when host room allows, possibly after revoking cheaper paused
   Snapshots, else Replay);
4. fresh admission in submission order with what is left (bounded bypass of paused requests);
5. one compact decode batch of the actual B, then one prefill/Replay chunk.
Every PendingBatch is consumed whole: Frontend preview -> Program.commit -> accounting ->
OutputSession.commit -> publish.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Literal

import attrs

from ninfer.contract.batch import LaunchedUnit, PendingBatch, RowDecision
from ninfer.contract.events import (
    FinishReason,
    GenerationResult,
    GenerationStart,
    OutputDelta,
    Timings,
    TokenLogprob,
    Usage,
    merge_tool_call_fragments,
)
from ninfer.contract.model import Frontend, PipelinedDecode, Preview, Program, SnapshotCost
from ninfer.engine import exit_hook
from ninfer.engine.errors import (
    CapacityExhausted,
    EngineClosed,
    EngineError,
    EngineFailed,
    Overloaded,
    QueueTimeout,
    RequestFailed,
    Unrepresentable,
)
from ninfer.engine.metrics import EngineMetrics, MetricsRecorder
from ninfer.engine.request import RequestRecord, RequestState
from ninfer.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

PauseChoice = Literal["auto", "snapshot", "replay"]


class InvariantBroken(RuntimeError):
    """Engine-internal state contradicts itself; the engine fails (never a cache miss)."""


class EngineCore:
    def __init__(self, program: Program, frontend: Frontend, *, max_concurrency: int, max_queue: int,
                 max_model_len: int, prefill_chunk: int = 512, bypass_limit: int | None = None,
                 pause_mode: PauseChoice = "auto", device: str | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if pause_mode not in ("auto", "snapshot", "replay"):
            raise ValueError(f"pause_mode must be auto, snapshot or replay, got {pause_mode!r}")
        self.program = program
        self.frontend = frontend
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.pause_mode = pause_mode
        self.device = device
        self.token_text = _token_text_fn(frontend)
        self.scheduler = Scheduler(max_concurrency=max_concurrency,
                                   bypass_limit=max_concurrency if bypass_limit is None else bypass_limit)
        self.metrics = MetricsRecorder()
        # Shared with ingress/consumers: guarded by ``cond``.
        self.cond = threading.Condition()
        self.inbox: list[RequestRecord] = []
        self.outstanding = 0
        self.outstanding_limit = max_queue + max_concurrency
        self.next_ticket = 0
        self.failed: BaseException | None = None
        self.closing = False
        self.drain = False
        self.wake = False
        # Worker-only state.
        self.by_seq: dict[int, RequestRecord] = {}
        self.capacity_event = False
        self.admission_event = False
        self.inflight: PendingBatch | None = None
        # A decode step launched but not collected, with its rows (PipelinedDecode Programs only).
        self.ahead: tuple[LaunchedUnit, list[RequestRecord]] | None = None
        self.pipelined = isinstance(program, PipelinedDecode)
        self.changed = False
        self.stopped = False
        self.calls: list[tuple] = []
        self.kv_pages = self._kv_pages()
        self.thread = threading.Thread(target=self._run, name="ninfer-engine-worker", daemon=True)
        exit_hook.track(self)  # interpreter exit closes it: a daemon worker frozen inside torch aborts the exit
        self.thread.start()

    # == ingress side (any thread) ===================================================================
    def check_open(self) -> None:
        with self.cond:
            if self.failed is not None:
                raise EngineFailed(f"engine failed: {self.failed}") from self.failed
            if self.closing:
                raise EngineClosed("engine is closed")

    def enqueue(self, make_record) -> RequestRecord:
        """Take an outstanding place, assign the ticket (submission order) and hand the record to the worker."""
        with self.cond:
            if self.failed is not None:
                raise EngineFailed(f"engine failed: {self.failed}") from self.failed
            if self.closing:
                raise EngineClosed("engine is closed")
            if self.outstanding >= self.outstanding_limit:
                self.metrics.rejected_request(Overloaded.kind)
                raise Overloaded(f"engine overloaded: {self.outstanding} outstanding requests "
                                 f"(limit {self.outstanding_limit}); retry later")
            rec = make_record(self.next_ticket)
            self.next_ticket += 1
            self.outstanding += 1
            self.inbox.append(rec)
            self.wake = True
            self.cond.notify_all()
        return rec

    def notify(self) -> None:
        with self.cond:
            self.wake = True
            self.cond.notify_all()

    def release_outstanding(self) -> None:
        """Called exactly once per request, after both response_done and consumer_released."""
        with self.cond:
            if self.outstanding <= 0:
                raise InvariantBroken("outstanding capacity released twice")
            self.outstanding -= 1
            self.cond.notify_all()

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        with self.cond:
            self.closing = True
            self.drain = drain
            self.wake = True
            self.cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def on_worker(self, fn, timeout: float | None = 30.0):
        """Run ``fn()`` on the worker between cycles (the Program is worker-only) and return its result."""
        with self.cond:
            alive = not self.stopped and threading.current_thread() is not self.thread
            if alive:
                box: list = []
                done = threading.Event()
                self.calls.append((fn, box, done))
                self.wake = True
                self.cond.notify_all()
        if not alive:  # the worker has stopped: nothing else touches the Program now
            return fn()
        if not done.wait(timeout):
            raise TimeoutError("engine worker did not answer")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _serve_calls(self) -> None:
        with self.cond:
            calls, self.calls = self.calls, []
        for fn, box, done in calls:
            try:
                box.append(fn())
            except BaseException as exc:
                box.append(exc)
            done.set()

    def snapshot_metrics(self) -> EngineMetrics:
        s = self.scheduler
        used, total = self.kv_pages  # as of the worker's last cycle: /metrics never waits for a unit
        with self.cond:
            inbox, outstanding, failed = len(self.inbox), self.outstanding, self.failed is not None
        return self.metrics.snapshot(queue_depth=len(s.waiting) + inbox, running=len(s.residents),
                                     paused=len(s.paused), outstanding=outstanding, kv_pages_used=used,
                                     kv_pages_total=total, failed=failed)

    # == worker ======================================================================================
    def _run(self) -> None:
        try:
            bind_device(self.device)
            while True:
                with self.cond:
                    new, self.inbox = self.inbox, []
                    closing, drain = self.closing, self.drain
                    self.wake = False
                self._serve_calls()
                for rec in new:
                    self.scheduler.enqueue(rec)
                    self.admission_event = True
                if closing and not drain:
                    self._drop_ahead()
                    self._settle_all(EngineClosed("engine closed before the request finished"))
                    return
                progressed = self._cycle()
                self.kv_pages = self._kv_pages()
                if closing and not self._busy():
                    return
                if not progressed:
                    self._idle_wait()
        except BaseException as exc:  # device error or broken invariant: fail every response, refuse new work
            log.exception("engine worker failed")
            self._fail(exc)
        finally:
            with self.cond:
                self.stopped = True
            self._serve_calls()

    def _kv_pages(self) -> tuple[int, int]:
        u = self.program.usage()
        return u.kv_pages_used, u.kv_pages_total

    def _busy(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.residents or s.paused or self.ahead)

    def _idle_wait(self) -> None:
        timeout = self._next_timer()
        with self.cond:
            if not self.wake:
                self.cond.wait(timeout)

    def _next_timer(self) -> float | None:
        now, best = time.monotonic(), None
        s = self.scheduler
        for rec in [*s.waiting, *s.residents.values(), *s.paused.values()]:
            for t in (rec.deadline_at, rec.queue_deadline_at if rec.state is RequestState.WAITING else None):
                if t is not None and (best is None or t < best):
                    best = t
        if best is None:
            return 1.0
        return max(0.0, min(1.0, best - now))

    def _cycle(self) -> bool:
        self.changed = False
        if self.ahead is not None:
            self._advance_pipeline()
            return True
        self._settle_cancellations()
        self._try_resume()
        decode_rows = self._grant_decode_permits()
        self._admit_fresh()
        prefill_rec = self._grant_prefill_permit()
        decode_rows = [r for r in decode_rows if r.state is RequestState.DECODE_READY and r.sequence_id is not None]
        progressed = False
        if decode_rows:
            ids = [r.sequence_id for r in decode_rows]
            if self.pipelined:  # collected next cycle (after this cycle's prefill chunk is queued behind it)
                self.ahead = (self.program.launch_decode(ids), decode_rows)
            else:
                self._run_unit(self.program.decode(ids), decode_rows)
            progressed = True
        if prefill_rec is not None and prefill_rec.resident:
            self._run_prefill(prefill_rec)
            progressed = True
        return progressed or self.changed

    # -- 1. cancellations, deadlines, queue timeouts ------------------------------------------------
    def _settle_cancellations(self) -> None:
        now = time.monotonic()
        s = self.scheduler
        for rec in [*s.waiting, *s.residents.values(), *s.paused.values()]:
            if rec.channel.cancel_requested:
                self._finish(rec, FinishReason.CANCELLED)
            elif rec.deadline_at is not None and now >= rec.deadline_at:
                self._finish(rec, FinishReason.DEADLINE)
            elif rec.state is RequestState.WAITING and rec.queue_deadline_at is not None \
                    and now >= rec.queue_deadline_at:
                self._finish(rec, FinishReason.ERROR, QueueTimeout(
                    f"request {rec.request_id} waited {now - rec.submitted_at:.3f} s without admission "
                    f"(queue timeout {rec.request.queue_timeout_s} s)"))

    # -- 2. resume ---------------------------------------------------------------------------------
    def _try_resume(self) -> None:
        s = self.scheduler
        if s.protected is not None or not s.paused:
            return
        if not (self.capacity_event or not s.residents):
            return
        self.capacity_event = False
        rec = s.oldest_paused()
        while True:
            seq = self.program.resume(rec.resume_state) if s.free_lanes > 0 else None
            if seq is not None:
                break
            # Does not fit. Older residents will free capacity; otherwise this is the oldest request
            # and may take room from the youngest borrower.
            if s.has_older_resident(rec):
                return
            victim = s.victim_for(rec)
            if victim is None:
                if not s.residents:
                    self._finish(rec, FinishReason.ERROR, CapacityExhausted(
                        f"request {rec.request_id} cannot be resumed: its history exceeds the Program's capacity"))
                return
            self._pause(victim)
        rec.resume_state = rec.snapshot = None
        self._bind(rec, seq)
        s.protected = rec
        self.admission_event = True

    def _bind(self, rec: RequestRecord, seq: int) -> None:
        if seq in self.by_seq:
            raise InvariantBroken(f"Program returned sequence id {seq} that is already bound")
        rec.sequence_id = seq
        self.by_seq[seq] = rec
        self.scheduler.make_resident(rec)
        self.changed = True
        self._set_input_state(rec)

    def _set_input_state(self, rec: RequestRecord) -> None:
        if self.program.input_remaining(rec.sequence_id) == 0:
            rec.state = RequestState.DECODE_READY
        else:
            rec.state = RequestState.REPLAY if rec.token_ids else RequestState.PREFILL

    # -- 3. unit permits and pressure ------------------------------------------------------------------
    def _grant_decode_permits(self) -> list[RequestRecord]:
        granted = []
        for rec in self.scheduler.decode_candidates():
            if rec.resident and self._reserve(rec, 1):
                granted.append(rec)
        return granted

    def _grant_prefill_permit(self) -> RequestRecord | None:
        while True:
            rec = self.scheduler.pick_prefill(self.scheduler.prefill_candidates())
            if rec is None:
                return None
            n = min(self.prefill_chunk, self.program.input_remaining(rec.sequence_id))
            if n <= 0:
                raise InvariantBroken(f"request {rec.request_id} in {rec.state.value} with no input remaining")
            if self._reserve(rec, n):
                return rec

    def _reserve(self, rec: RequestRecord, tokens: int) -> bool:
        """Reserve one unit for ``rec``, pausing younger residents under pressure; False if ``rec`` cannot run."""
        s = self.scheduler
        while True:
            if self.program.reserve_units(rec.sequence_id, tokens):
                return True
            victim = s.victim_for(rec)
            if victim is not None:
                self._pause(victim)
                continue
            if len(s.residents) > 1:
                self._pause(rec)  # it is the youngest: it waits for the older ones to free capacity
            else:
                self._finish(rec, FinishReason.ERROR, CapacityExhausted(
                    f"request {rec.request_id} alone needs more KV/state than the Program has "
                    f"({tokens} more positions did not fit)"))
            return False

    def _pause(self, rec: RequestRecord) -> None:
        seq = rec.sequence_id
        mode = self.pause_mode
        cost = None if mode == "replay" else self.program.snapshot_cost(seq)
        if mode == "auto":
            if not self.program.can_snapshot(seq):
                self._revoke_snapshots(cost)
            mode = "snapshot" if self.program.can_snapshot(seq) else "replay"
        rec.resume_state = self.program.pause(seq, mode)
        rec.snapshot = cost if mode == "snapshot" else None
        del self.by_seq[seq]
        rec.sequence_id = None
        rec.state = RequestState.PAUSED
        rec.preemptions += 1
        self.scheduler.make_paused(rec)
        self._check_host_bytes()
        self.metrics.preempted(mode)
        self.capacity_event = self.changed = True
        self.admission_event = False  # the room just freed belongs to the row under pressure

    def _revoke_snapshots(self, need: SnapshotCost) -> None:
        """Host pressure on a pause: demote paused Snapshots to Replay when the Scheduler's rule says the
        new Snapshot is worth more than what they save (their device side is already free)."""
        u = self.program.usage()
        shortfall = u.host_bytes_used + need.host_bytes - u.host_bytes_total
        for victim in self.scheduler.revocations_for(shortfall, need.replay_positions):
            victim.resume_state = self.program.demote(victim.resume_state)
            victim.snapshot = None
            self.metrics.snapshot_revoked()

    def _check_host_bytes(self) -> None:
        """The Program's host bytes are exactly the Snapshots the paused requests hold."""
        held = sum(r.snapshot.host_bytes for r in self.scheduler.paused.values() if r.snapshot is not None)
        used = self.program.usage().host_bytes_used
        if used != held:
            raise InvariantBroken(f"Program holds {used} host bytes, paused Snapshots account for {held}")

    # -- 4. fresh admission ----------------------------------------------------------------------
    def _admit_fresh(self) -> None:
        s = self.scheduler
        if not self.admission_event:
            return
        self.admission_event = False
        while s.waiting and s.free_lanes > 0 and s.fresh_admission_open():
            rec = s.waiting[0]
            try:
                seq = self.program.open_sequence(rec.prompt, rec.sampling)
            except ValueError as exc:  # the Program validates before binding: a request-level rejection
                self._finish(rec, FinishReason.ERROR, Unrepresentable(f"request cannot be represented: {exc}"))
                continue
            if not self.program.reserve_units(seq, min(self.prefill_chunk, len(rec.prompt))):
                self.program.release(seq)
                if not s.residents:  # the whole device is free and the first chunk still does not fit
                    self._finish(rec, FinishReason.ERROR, CapacityExhausted(
                        f"request {rec.request_id}: its first prefill chunk does not fit the Program's capacity"))
                    continue
                return
            s.waiting.popleft()
            now = time.monotonic()
            rec.admitted_at = now
            self._bind(rec, seq)
            if s.paused:
                s.note_fresh_admission()
            rec.started = True
            self.metrics.admitted(len(rec.prompt), now - rec.submitted_at)
            rec.channel.publish(GenerationStart(request_id=rec.request_id, prompt_tokens=len(rec.prompt)))

    # -- 5. execution and PendingBatch consumption --------------------------------------------------
    def _advance_pipeline(self) -> None:
        """Collect the launched decode step; when the decode phase is steady, first queue the next step
        behind it on its device-resident tokens, so the device runs while the host settles this one."""
        unit, rows = self.ahead
        self.ahead = None
        # Cancellations, deadlines and queue timeouts settle every cycle, pipelined or not (a resident ended
        # here is released; its launched row is left out when the unit is collected).
        self._settle_cancellations()
        nxt = self.program.launch_decode(unit.sequence_ids, after=unit) if self._steady(rows) else None
        if nxt is not None:
            self.ahead = (nxt, rows)
        batch = self.program.collect(unit)
        self._run_unit(batch, [self.by_seq[i] for i in batch.sequence_ids()])

    def _steady(self, rows: list[RequestRecord]) -> bool:
        """Whether the next cycle would decode exactly these rows again, assuming none of them ends now.

        Anything else that could happen (an arrival, an admission into a free lane, a resume after a
        capacity event, a prefill, a cancellation or deadline, the last token of a row's budget, a full KV
        pool, a worker call, closing) lets the pipeline drain first. Requests waiting for a lane, or paused
        with no capacity event since, do not: the next cycle could not start them either.
        """
        s = self.scheduler
        if self.inbox or self.closing or self.calls or len(s.residents) != len(rows):
            return False
        if (s.waiting and s.free_lanes > 0) or (s.paused and (self.capacity_event or s.protected is not None)):
            return False
        for rec in rows:
            if rec.state is not RequestState.DECODE_READY or self._cancel_reason(rec) is not None \
                    or self._room(rec) < 2:  # room still counts the launched token
                return False
        # Reservations for the chained positions (atomic per row; a refusal leaves the rest to settle).
        return all(self.program.reserve_units(rec.sequence_id, 1) for rec in rows)

    def _run_prefill(self, rec: RequestRecord) -> None:
        n = min(self.prefill_chunk, self.program.input_remaining(rec.sequence_id))
        batch = self.program.prefill(rec.sequence_id, n)
        if batch is not None:
            self._run_unit(batch, [rec])
        if batch is None and rec.resident:
            if self.program.input_remaining(rec.sequence_id) == 0 and not rec.token_ids:
                raise InvariantBroken(f"request {rec.request_id}: prompt complete but no first token sampled")
            self._set_input_state(rec)

    def _run_unit(self, batch: PendingBatch, expected: Sequence[RequestRecord]) -> None:
        self.inflight = batch
        ids = batch.sequence_ids()
        if sorted(ids) != sorted(r.sequence_id for r in expected) or len(set(ids)) != len(ids):
            raise InvariantBroken(f"PendingBatch membership {ids} differs from the scheduled rows "
                                  f"{[r.sequence_id for r in expected]}")
        recs = [self.by_seq[i] for i in ids]
        previews: list[Preview | None] = []
        decisions: list[RowDecision] = []
        reasons: list[FinishReason | None] = []
        for rec, row in zip(recs, batch.rows, strict=True):
            cancel = self._cancel_reason(rec)
            if cancel is not None:
                previews.append(None)
                decisions.append(RowDecision(accepted=0, cancelled=True))
                reasons.append(cancel)
                continue
            room = self._room(rec)
            tokens = row.tokens[:room]
            at_limit = len(tokens) >= room
            try:
                pv = rec.session.preview(tokens, at_length_limit=at_limit)
            except Exception as exc:  # this request's output cannot be interpreted; its neighbours go on
                log.exception("OutputSession.preview failed for %s", rec.request_id)
                rec.frontend_error = exc
                previews.append(None)
                decisions.append(RowDecision(accepted=0, cancelled=True))
                reasons.append(FinishReason.ERROR)
                continue
            if not 1 <= pv.accepted <= len(tokens):
                raise InvariantBroken(f"Frontend preview accepted {pv.accepted} of {len(tokens)} tokens")
            reason = pv.finish_reason
            if reason is None and at_limit and pv.accepted == len(tokens):
                reason = FinishReason.LENGTH
            if reason is None and pv.accepted != row.produced:
                raise InvariantBroken(f"non-terminal preview accepted {pv.accepted} of {row.produced}")
            previews.append(pv)
            decisions.append(RowDecision(accepted=pv.accepted, terminal=reason is not None, boundary=pv.boundary))
            reasons.append(reason)
        self.program.commit(batch, decisions)  # a failure here fails the engine: state is not stable
        if not batch.consumed:
            raise InvariantBroken(f"Program.commit left the {batch.kind} PendingBatch unconsumed")
        self.inflight = None
        now = time.monotonic()
        for rec, row, pv, d, reason in zip(recs, batch.rows, previews, decisions, reasons, strict=True):
            if pv is None:
                self._finish(rec, reason, _frontend_error(rec))
                continue
            accepted = row.tokens[:d.accepted]
            # Budget and scheduling accounting, then the OutputSession commit, then publication.
            first = rec.first_token_at is None
            rec.generated += d.accepted
            self.metrics.tokens(d.accepted, first_token_s=(now - rec.submitted_at) if first else None,
                                gap_s=None if first else now - rec.last_token_at)
            if first:
                rec.first_token_at = now
            rec.last_token_at = now
            if rec is self.scheduler.protected:
                self.scheduler.protected = None  # real new progress ends the protected recovery
                self.capacity_event = True
            try:
                delta = rec.session.commit(pv)
            except Exception as exc:  # model state is committed; only this request's output is lost
                log.exception("OutputSession.commit failed for %s", rec.request_id)
                rec.frontend_error = exc
                self._finish(rec, FinishReason.ERROR, _frontend_error(rec))
                continue
            rec.token_ids.extend(accepted)
            if row.logprobs is not None:
                delta = attrs.evolve(delta, logprobs=delta.logprobs + self._logprobs(row, d.accepted))
            self._publish_delta(rec, delta)
            if reason is not None:
                self._finish(rec, reason)
            else:
                # The Program may drop a row's physical frontier (e.g. after a partial accept); it then
                # reports the accepted history as input to rebuild, and the row replays before decoding.
                self._set_input_state(rec)

    def _logprobs(self, row, accepted: int) -> tuple[TokenLogprob, ...]:
        """The Program's per-token logprobs of the accepted tokens, with token text for the gateway."""
        text = self.token_text
        top = row.top_logprobs
        return tuple(TokenLogprob(token_id=t, token=text(t), logprob=row.logprobs[k],
                                  top=tuple((i, text(i), lp) for i, lp in top[k]) if top else ())
                     for k, t in enumerate(row.tokens[:accepted]))

    def _room(self, rec: RequestRecord) -> int:
        room = self.max_model_len - len(rec.prompt) - rec.generated
        if rec.max_tokens is not None:
            room = min(room, rec.max_tokens - rec.generated)
        if room < 1:
            raise InvariantBroken(f"request {rec.request_id} ran a unit with no generation room left")
        return room

    def _cancel_reason(self, rec: RequestRecord) -> FinishReason | None:
        if rec.channel.cancel_requested:
            return FinishReason.CANCELLED
        if rec.deadline_at is not None and time.monotonic() >= rec.deadline_at:
            return FinishReason.DEADLINE
        return None

    def _publish_delta(self, rec: RequestRecord, delta: OutputDelta) -> None:
        if not (delta.content or delta.reasoning or delta.token_ids or delta.tool_calls or delta.logprobs):
            return
        rec.content.append(delta.content)
        rec.reasoning.append(delta.reasoning)
        rec.tool_calls.extend(delta.tool_calls)
        rec.channel.publish(delta)

    # -- terminal settlement ------------------------------------------------------------------------
    def _finish(self, rec: RequestRecord, reason: FinishReason, error: BaseException | None = None) -> None:
        """Release the request's resources, then complete its response (exactly once)."""
        if rec.state is RequestState.FINISHED:
            raise InvariantBroken(f"request {rec.request_id} settled twice")
        if rec.resident:
            seq = rec.sequence_id
            self.program.release(seq)
            del self.by_seq[seq]
            rec.sequence_id = None
        elif rec.state is RequestState.PAUSED:
            self.program.discard(rec.resume_state)
            rec.resume_state = rec.snapshot = None
        was_admitted = rec.state is not RequestState.WAITING
        self.scheduler.remove(rec)
        rec.state = RequestState.FINISHED
        self.capacity_event = self.admission_event = self.changed = True
        if rec.session is not None and was_admitted and error is None:
            try:
                self._publish_delta(rec, rec.session.finish(reason))
            except Exception as exc:
                log.exception("OutputSession.finish failed for %s", rec.request_id)
                rec.frontend_error = exc
                error = _frontend_error(rec)
        self._complete(rec, reason, error)

    def _complete(self, rec: RequestRecord, reason: FinishReason, error: BaseException | None) -> None:
        now = time.monotonic()
        if error is not None:
            reason = FinishReason.ERROR
            rec.channel.error = error
        result = GenerationResult(
            request_id=rec.request_id, finish_reason=reason,
            usage=Usage(prompt_tokens=len(rec.prompt), completion_tokens=rec.generated),
            timings=Timings(queued_s=((rec.admitted_at or now) - rec.submitted_at),
                            time_to_first_token_s=None if rec.first_token_at is None
                            else rec.first_token_at - rec.submitted_at,
                            end_to_end_s=now - rec.submitted_at, preemptions=rec.preemptions),
            content="".join(rec.content), reasoning="".join(rec.reasoning), token_ids=tuple(rec.token_ids),
            tool_calls=merge_tool_call_fragments(rec.tool_calls), error=None if error is None else str(error),
            extra={} if error is None else {"error_kind": getattr(error, "kind", "internal")})
        self.metrics.finished_request(reason.value, now - rec.submitted_at)
        rec.channel.publish(result)

    def _drop_ahead(self) -> None:
        """Abandon a launched step (shutdown): its rows return to their committed frontier."""
        if self.ahead is not None:
            unit, _ = self.ahead
            self.ahead = None
            self.program.abort_pending(self.program.collect(unit))

    def _settle_all(self, error: EngineError) -> None:
        """Clean shutdown: end every request with ``error`` after releasing what it holds."""
        s = self.scheduler
        for rec in sorted([*s.waiting, *s.residents.values(), *s.paused.values()], key=lambda r: r.ticket):
            self._finish(rec, FinishReason.ERROR, error)

    def _fail(self, exc: BaseException) -> None:
        """Engine failure: refuse new work, end pending model work, release resources, complete every response."""
        with self.cond:
            self.failed = exc
            new, self.inbox = self.inbox, []
        err = EngineFailed(f"engine failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        if self.inflight is not None and not self.inflight.consumed:
            _quietly(self.program.abort_pending, self.inflight)
        self.inflight = None
        if self.ahead is not None and not self.ahead[0].collected:
            _quietly(lambda unit: self.program.abort_pending(self.program.collect(unit)), self.ahead[0])
        self.ahead = None
        s = self.scheduler
        recs = sorted([*new, *s.waiting, *s.residents.values(), *s.paused.values()], key=lambda r: r.ticket)
        for rec in recs:
            if rec.state in (RequestState.PREFILL, RequestState.REPLAY, RequestState.DECODE_READY):
                _quietly(self.program.release, rec.sequence_id)
            elif rec.state is RequestState.PAUSED:
                _quietly(self.program.discard, rec.resume_state)
        for rec in recs:
            rec.state = RequestState.FINISHED
            if not rec.channel.response_done:
                _quietly(self._complete, rec, FinishReason.ERROR, err)
        s.waiting.clear()
        s.residents.clear()
        s.paused.clear()
        s.protected = None
        self.by_seq.clear()


def bind_device(device) -> None:
    """The worker binds its CUDA device before executing ("cuda" alone keeps the current device)."""
    if device is None or not str(device).startswith("cuda"):
        return
    import torch

    dev = torch.device(device)
    if dev.index is not None:
        torch.cuda.set_device(dev)


def _token_text_fn(frontend: Frontend):
    """Token text for logprob reports: ``frontend.token_text`` if offered, else its tokenizer's decode."""
    fn = getattr(frontend, "token_text", None)
    if callable(fn):
        return fn
    decode = getattr(getattr(frontend, "tokenizer", None), "decode", None)
    if callable(decode):
        return lambda t: decode([t])
    return str


def _frontend_error(rec: RequestRecord) -> BaseException | None:
    exc = rec.frontend_error
    if exc is None:
        return None
    err = RequestFailed(f"request {rec.request_id}: the Frontend could not interpret the output: "
                        f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # cleanup after a failure must reach every response
        log.exception("cleanup step %s failed", getattr(fn, "__name__", fn))
