"""Settlement: every request ends exactly once, after releasing what it holds.

``finish`` releases the request's sequence (or its paused ResumeState), flushes its OutputSession and
completes the response with the final ``GenerationResult``. Cancellations, deadlines and queue
timeouts are settled here at the worker's stable boundary; ``settle_all`` ends everything at a clean
shutdown, ``fail`` after an engine failure (pending model work aborted first, every response completed).
``recover`` ends only the requests a failed step concerned (docs/engine.md, "Failure"): their unit's
pending work is aborted, they end with a request-level error naming the step, and the Program's ledger
is checked against what the engine still holds; the engine goes on.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

from ninfer.contract.batch import LaunchedUnit
from ninfer.contract.events import FinishReason, GenerationResult, Timings, Usage, merge_tool_call_fragments
from ninfer.engine.errors import (
    EngineError,
    EngineFailed,
    InvariantBroken,
    QueueTimeout,
    is_fatal,
    request_failure,
)
from ninfer.engine.request import RequestRecord, RequestState
from ninfer.engine.worker_state import WorkerState

log = logging.getLogger(__name__)


class Settlement:
    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def settle_interrupted(self) -> None:
        """End cancelled requests, passed deadlines and queue timeouts (any state)."""
        now = time.monotonic()
        for rec in self.state.live():
            reason = rec.interrupted(now)
            if reason is not None:
                self.finish(rec, reason)
            elif rec.state is RequestState.WAITING and rec.queue_deadline_at is not None \
                    and now >= rec.queue_deadline_at:
                self.finish(rec, FinishReason.ERROR, QueueTimeout(
                    f"request {rec.request_id} waited {now - rec.submitted_at:.3f} s without admission "
                    f"(queue timeout {rec.request.queue_timeout_s} s)"))

    def finish(self, rec: RequestRecord, reason: FinishReason, error: BaseException | None = None) -> None:
        """Release the request's resources, then complete its response (exactly once)."""
        st = self.state
        if rec.state is RequestState.FINISHED:
            raise InvariantBroken(f"request {rec.request_id} settled twice")
        if rec.resident:
            if error is None and rec.frontend_error is None:
                self._keep(rec, reason)  # its continuation, before the sequence goes
            _freeing(st.program.release, rec.sequence_id, rec)
            st.unbind(rec)
        elif rec.state is RequestState.PAUSED:
            _freeing(st.program.discard, rec.resume_state, rec)
            rec.resume_state = rec.snapshot = None
        was_admitted = rec.state is not RequestState.WAITING
        st.scheduler.remove(rec)
        rec.state = RequestState.FINISHED
        st.capacity_event = st.admission_event = st.changed = True
        if rec.session is not None and was_admitted and error is None:
            try:
                rec.publish_output(rec.session.finish(reason), final=True)
            except Exception as exc:  # the session's own failure: this request alone
                log.exception("OutputSession.finish failed for %s", rec.request_id)
                rec.frontend_error = exc
                error = request_failure(rec.request_id, "OutputSession.finish", exc)
        self.complete(rec, reason, error)

    def _keep(self, rec: RequestRecord, reason: FinishReason) -> None:
        """The context cache keeps the continuation of a successful finish. It is optional: a failure to keep
        it is logged and the request still finishes with its complete output."""
        try:
            self.state.reuse.keep(rec, reason)
        except Exception as exc:
            if is_fatal(exc):
                raise
            log.exception("the context cache could not keep %s's continuation; it finishes without", rec.request_id)

    def complete(self, rec: RequestRecord, reason: FinishReason, error: BaseException | None) -> None:
        """Publish the final result: what was committed, usage and timings (an error makes it ERROR). If that
        result cannot be made or published, a bare error result (no output) still ends the response."""
        now = time.monotonic()
        if error is not None:
            reason = FinishReason.ERROR
            rec.channel.error = error
        try:
            result = self._result(rec, reason, error, now)
            self.state.metrics.finished_request(result.finish_reason.value, now - rec.submitted_at)
            rec.channel.publish(result)
        except Exception as exc:
            if is_fatal(exc) or rec.channel.response_done:
                raise
            log.exception("the final result of %s could not be published", rec.request_id)
            error = request_failure(rec.request_id, "publication", exc)
            rec.channel.error = error
            rec.channel.publish(GenerationResult(
                request_id=rec.request_id, finish_reason=FinishReason.ERROR,
                usage=Usage(prompt_tokens=len(rec.prompt), completion_tokens=rec.generated), timings=Timings(),
                error=str(error), extra={"error_kind": error.kind}))

    @staticmethod
    def _result(rec: RequestRecord, reason: FinishReason, error: BaseException | None, now: float
                ) -> GenerationResult:
        return GenerationResult(
            request_id=rec.request_id, finish_reason=reason,
            usage=Usage(prompt_tokens=len(rec.prompt), completion_tokens=rec.generated,
                        cached_tokens=rec.cached_tokens),
            timings=Timings(queued_s=((rec.admitted_at or now) - rec.submitted_at),
                            time_to_first_token_s=None if rec.first_token_at is None
                            else rec.first_token_at - rec.submitted_at,
                            end_to_end_s=now - rec.submitted_at, preemptions=rec.preemptions),
            content="".join(rec.content), reasoning="".join(rec.reasoning), token_ids=tuple(rec.token_ids),
            tool_calls=merge_tool_call_fragments(rec.tool_calls), error=None if error is None else str(error),
            extra={} if error is None else {"error_kind": error.kind if isinstance(error, EngineError)
                                            else "internal"})

    # -- a failed step ----------------------------------------------------------------------------------
    def recover(self, stage: str, recs: Sequence[RequestRecord], exc: BaseException, *,
                launched: LaunchedUnit | None = None) -> None:
        """``stage`` raised ``exc`` while serving ``recs``: re-raise it if it is fatal (the engine fails), else
        end ``recs`` alone. First the unit's pending work is aborted: the batch being consumed, ``launched``
        (a unit the failed step was to collect) and the launched step ahead when every row of it ends here.
        A failure of that rollback, or a Program ledger that disagrees afterwards, fails the engine."""
        if is_fatal(exc):
            raise exc
        st = self.state
        log.error("%s failed for %s: %s: %s; they end, the engine goes on", stage,
                  ", ".join(r.request_id for r in recs), type(exc).__name__, exc, exc_info=exc)
        ending = {r.sequence_id for r in recs if r.resident}
        try:
            if st.inflight is not None and not st.inflight.consumed:
                st.program.abort_pending(st.inflight)
            st.inflight = None
            units = [launched] if launched is not None else []
            if st.ahead is not None and set(st.ahead[0].sequence_ids) <= ending:
                units.append(st.ahead[0])
                st.ahead = None
            for unit in units:  # in launch order: a chained step is collected after the step it follows
                if not unit.collected:
                    st.program.abort_pending(st.program.collect(unit))
            for rec in recs:
                if rec.state is not RequestState.FINISHED:
                    self.finish(rec, FinishReason.ERROR, request_failure(rec.request_id, stage, exc))
            check_device(st.device)
            self.check_ledger()
        except Exception as cleanup:
            if is_fatal(cleanup):
                raise
            raise InvariantBroken(f"the requests of a failed {stage} could not be ended: "
                                  f"{type(cleanup).__name__}: {cleanup}") from cleanup
        st.changed = True

    def check_ledger(self) -> None:
        """The Program holds a sequence per resident request, exactly the paused Snapshots' host bytes, and
        nothing but the context cache's pages when no request is resident or paused (after a recovery)."""
        st, s = self.state, self.state.scheduler
        u = st.program.usage()
        held = sum(r.snapshot.host_bytes for r in s.paused.values() if r.snapshot is not None)
        if u.state_slots_used != len(st.by_seq) or u.host_bytes_used != held:
            raise InvariantBroken(f"the Program holds {u.state_slots_used} sequences and {u.host_bytes_used} host "
                                  f"bytes; the engine accounts for {len(st.by_seq)} and {held}")
        if not (s.residents or s.paused or st.ahead) and not u.idle:
            raise InvariantBroken(f"no request holds anything, yet the Program's ledger is not idle: {u}")

    def settle_all(self, error: EngineError) -> None:
        """Clean shutdown: end every request with ``error`` after releasing what it holds."""
        for rec in sorted(self.state.live(), key=lambda r: r.ticket):
            self.finish(rec, FinishReason.ERROR, error)

    def fail(self, exc: BaseException, unadmitted: list[RequestRecord]) -> None:
        """Engine failure: end pending model work, release resources, complete every response
        (``unadmitted``: records that never reached the worker)."""
        st = self.state
        err = EngineFailed(f"engine failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        if st.inflight is not None and not st.inflight.consumed:
            _quietly(st.program.abort_pending, st.inflight)
        st.inflight = None
        if st.ahead is not None and not st.ahead[0].collected:
            _quietly(lambda unit: st.program.abort_pending(st.program.collect(unit)), st.ahead[0])
        st.ahead = None
        recs = sorted([*unadmitted, *st.live()], key=lambda r: r.ticket)
        for rec in recs:
            if rec.resident:
                _quietly(st.program.release, rec.sequence_id)
            elif rec.state is RequestState.PAUSED:
                _quietly(st.program.discard, rec.resume_state)
        for rec in recs:
            rec.state = RequestState.FINISHED
            if not rec.channel.response_done:
                _quietly(self.complete, rec, FinishReason.ERROR, err)
        s = st.scheduler
        s.waiting.clear()
        s.residents.clear()
        s.paused.clear()
        s.protected = None
        st.by_seq.clear()


def check_device(device: str | None) -> None:
    """After a recovered failure on a CUDA device: a device error the step left behind raises here (fatal)."""
    torch = sys.modules.get("torch")
    if device is not None and device.startswith("cuda") and torch is not None:
        torch.cuda.synchronize(torch.device(device))


def _freeing(fn, what, rec: RequestRecord) -> None:
    """Release or discard what ``rec`` holds; if the Program cannot, its ledger cannot be trusted."""
    try:
        fn(what)
    except Exception as exc:
        if is_fatal(exc):
            raise
        raise InvariantBroken(f"the Program could not free what request {rec.request_id} holds "
                              f"({getattr(fn, '__name__', fn)}): {type(exc).__name__}: {exc}") from exc


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # cleanup after a failure must reach every response
        log.exception("cleanup step %s failed", getattr(fn, "__name__", fn))
