"""BatchCommit: consume one PendingBatch whole, in the design's commit order.

For every row, the request's OutputSession previews the provisional tokens (how many it keeps, whether
they end the output); then ``Program.commit`` takes all the rows' decisions at once; then, row by row,
the speculative counters (drafts the Program's verification accepted), generation budget, timing and
scheduling accounting, ``OutputSession.commit`` of the preview, and publication of the delta on the
request's stream. Nothing is published before the Program committed,
and a row whose request was cancelled (or passed its deadline) accepts zero tokens.

A failure of one request's steps ends that request alone (its row accepts zero tokens, or, after the
Program's commit, the request ends with what it published); a failed ``Program.commit`` ends every row
of the batch (``Settlement.recover``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import attrs

from ninfer.contract.batch import PendingBatch, PendingRow, RowDecision
from ninfer.contract.events import FinishReason, TokenLogprob
from ninfer.contract.model import Preview
from ninfer.engine.errors import InvariantBroken, request_failure
from ninfer.engine.request import RequestRecord
from ninfer.engine.settlement import Settlement
from ninfer.engine.worker_state import WorkerState

log = logging.getLogger(__name__)


@attrs.frozen
class _RowOutcome:
    """One row's preview and decision (``preview`` None: the row accepts nothing and ends with ``reason``,
    and ``error`` when its request failed)."""

    preview: Preview | None
    decision: RowDecision
    reason: FinishReason | None
    error: BaseException | None = None


class BatchCommit:
    def __init__(self, state: WorkerState, settlement: Settlement, *, max_model_len: int,
                 token_text: Callable[[int], str]) -> None:
        self.state = state
        self.settlement = settlement
        self.max_model_len = max_model_len
        self.token_text = token_text

    def consume(self, batch: PendingBatch, expected: Sequence[RequestRecord]) -> None:
        """Preview every row, commit the batch in the Program, then account, commit and publish each row."""
        st = self.state
        st.inflight = batch
        ids = batch.sequence_ids()
        if sorted(ids) != sorted(r.sequence_id for r in expected) or len(set(ids)) != len(ids):
            raise InvariantBroken(f"PendingBatch membership {ids} differs from the scheduled rows "
                                  f"{[r.sequence_id for r in expected]}")
        recs = [st.by_seq[i] for i in ids]
        outcomes = [self._preview(rec, row) for rec, row in zip(recs, batch.rows, strict=True)]
        try:
            st.program.commit(batch, [o.decision for o in outcomes])
        except Exception as exc:  # which row's state it could not commit is unknown: the batch's rows end
            self.settlement.recover("Program.commit", recs, exc)
            return
        if not batch.consumed:
            raise InvariantBroken(f"Program.commit left the {batch.kind} PendingBatch unconsumed")
        st.inflight = None
        now = time.monotonic()
        for rec, row, outcome in zip(recs, batch.rows, outcomes, strict=True):
            try:
                self._publish(rec, row, outcome, now)
            except Exception as exc:  # the Program committed: this request ends with what it published
                self.settlement.recover("publication", [rec], exc)

    def _preview(self, rec: RequestRecord, row: PendingRow) -> _RowOutcome:
        """The row's decision from the OutputSession's preview (nothing changes yet)."""
        cancel = rec.interrupted(time.monotonic())
        if cancel is not None:
            return _RowOutcome(None, RowDecision(accepted=0, cancelled=True), cancel)
        if rec.frontend_error is not None:  # its token mask could not be made: the row's token is not kept
            return self._failed(rec, "token mask fill", rec.frontend_error)
        room = rec.generation_room(self.max_model_len)
        tokens = row.tokens[:room]
        at_limit = len(tokens) >= room
        try:
            pv = rec.session.preview(tokens, at_length_limit=at_limit)
        except Exception as exc:  # this request's output cannot be interpreted; its neighbours go on
            log.exception("OutputSession.preview failed for %s", rec.request_id)
            rec.frontend_error = exc
            return self._failed(rec, "OutputSession.preview", exc)
        if pv.accepted == 0 and pv.finish_reason is not None:  # the constraint refuses the first token
            return _RowOutcome(None, RowDecision(accepted=0, cancelled=True), pv.finish_reason)
        if not 1 <= pv.accepted <= len(tokens):
            raise InvariantBroken(f"Frontend preview accepted {pv.accepted} of {len(tokens)} tokens")
        reason = pv.finish_reason
        if reason is None and at_limit and pv.accepted == len(tokens):
            reason = FinishReason.LENGTH
        if reason is None and pv.accepted != row.produced:
            raise InvariantBroken(f"non-terminal preview accepted {pv.accepted} of {row.produced}")
        return _RowOutcome(pv, RowDecision(accepted=pv.accepted, terminal=reason is not None,
                                           boundary=pv.boundary), reason)

    @staticmethod
    def _failed(rec: RequestRecord, stage: str, exc: BaseException) -> _RowOutcome:
        """The row accepts nothing; its request ends with the error of ``stage``."""
        return _RowOutcome(None, RowDecision(accepted=0, cancelled=True), FinishReason.ERROR,
                           request_failure(rec.request_id, stage, exc))

    def _publish(self, rec: RequestRecord, row: PendingRow, outcome: _RowOutcome, now: float) -> None:
        """After the Program's commit: accounting, then the OutputSession commit, then publication."""
        pv, accepted = outcome.preview, outcome.decision.accepted
        if pv is None:
            self.settlement.finish(rec, outcome.reason, outcome.error)
            return
        if row.drafted:  # what verification accepted, even past a stop the OutputSession found inside it
            self.state.metrics.drafts_verified(row.drafted, row.produced - 1)
        self._account(rec, accepted, now)
        try:
            delta = rec.session.commit(pv)
        except Exception as exc:  # model state is committed; only this request's output is lost
            log.exception("OutputSession.commit failed for %s", rec.request_id)
            rec.frontend_error = exc
            self.settlement.finish(rec, FinishReason.ERROR, request_failure(rec.request_id, "OutputSession.commit",
                                                                            exc))
            return
        first = len(rec.token_ids)
        rec.token_ids.extend(row.tokens[:accepted])
        rec.boundary = outcome.decision.boundary
        if row.logprobs is not None:
            entries = self._logprobs(row, accepted)
            if delta.token_spans is None:
                delta = attrs.evolve(delta, logprobs=delta.logprobs + entries)
            else:  # they go out with the text they produce (RequestRecord.publish_output)
                rec.held_logprobs.update(zip(range(first, first + accepted), entries, strict=True))
        rec.publish_output(delta)
        if outcome.reason is not None:
            self.settlement.finish(rec, outcome.reason)
        else:
            # The Program may drop a row's physical frontier (e.g. after a partial accept); it then
            # reports the accepted history as input to rebuild, and the row replays before decoding.
            self.state.set_input_state(rec)

    def _account(self, rec: RequestRecord, accepted: int, now: float) -> None:
        """Generation budget, token timings, and the end of a protected recovery at its first new token."""
        st = self.state
        first = rec.first_token_at is None
        rec.generated += accepted
        st.metrics.tokens(accepted, first_token_s=(now - rec.submitted_at) if first else None,
                          gap_s=None if first else now - rec.last_token_at)
        if first:
            rec.first_token_at = now
        rec.last_token_at = now
        if rec is st.scheduler.protected:
            st.scheduler.protected = None  # real new progress ends the protected recovery
            st.capacity_event = True

    def _logprobs(self, row: PendingRow, accepted: int) -> tuple[TokenLogprob, ...]:
        """The Program's per-token logprobs of the accepted tokens, with the Frontend's token text."""
        text = self.token_text
        top = row.top_logprobs
        return tuple(TokenLogprob(token_id=t, token=text(t), logprob=row.logprobs[k],
                                  top=tuple((i, text(i), lp) for i, lp in top[k]) if top else ())
                     for k, t in enumerate(row.tokens[:accepted]))
