"""Settlement: every request ends exactly once, after releasing what it holds.

``finish`` releases the request's sequence (or its paused ResumeState), flushes its OutputSession and
completes the response with the final ``GenerationResult``. Cancellations, deadlines and queue
timeouts are settled here at the worker's stable boundary; ``settle_all`` ends everything at a clean
shutdown, ``fail`` after an engine failure (pending model work aborted first, every response completed).
"""

from __future__ import annotations

import logging
import time

from ninfer.contract.events import FinishReason, GenerationResult, Timings, Usage, merge_tool_call_fragments
from ninfer.engine.errors import EngineError, EngineFailed, InvariantBroken, QueueTimeout, RequestFailed
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
                st.reuse.keep(rec, reason)  # its continuation, before the sequence goes
            st.program.release(rec.sequence_id)
            st.unbind(rec)
        elif rec.state is RequestState.PAUSED:
            st.program.discard(rec.resume_state)
            rec.resume_state = rec.snapshot = None
        was_admitted = rec.state is not RequestState.WAITING
        st.scheduler.remove(rec)
        rec.state = RequestState.FINISHED
        st.capacity_event = st.admission_event = st.changed = True
        if rec.session is not None and was_admitted and error is None:
            try:
                rec.publish_output(rec.session.finish(reason))
            except Exception as exc:
                log.exception("OutputSession.finish failed for %s", rec.request_id)
                rec.frontend_error = exc
                error = frontend_failure(rec)
        self.complete(rec, reason, error)

    def complete(self, rec: RequestRecord, reason: FinishReason, error: BaseException | None) -> None:
        """Publish the final result: what was committed, usage and timings (an error makes it ERROR)."""
        now = time.monotonic()
        if error is not None:
            reason = FinishReason.ERROR
            rec.channel.error = error
        result = GenerationResult(
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
        self.state.metrics.finished_request(reason.value, now - rec.submitted_at)
        rec.channel.publish(result)

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


def frontend_failure(rec: RequestRecord) -> BaseException | None:
    """The request-level error for an OutputSession that failed on this request's output (None if it did not)."""
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
