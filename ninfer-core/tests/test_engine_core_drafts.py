"""The engine's speculative counters on a drafting ledger Program (ninfer.testing.ledger): verify steps, drafted
and accepted tokens, drafts past a stop, cancelled rows, and the per-position recorder."""

from __future__ import annotations

from collections.abc import Sequence

from ninfer.contract import EngineConfig
from ninfer.contract.batch import PendingBatch, PendingRow, RowDecision
from ninfer.contract.events import FinishReason
from ninfer.contract.request import SamplingParams
from ninfer.engine.engine import Engine
from ninfer.testing.ledger import (
    LedgerProgram,
    drained,
    ledger_instance,
    next_token,
    reference_tokens,
    req,
)


# -- speculative decoding's counters ------------------------------------------------------------------
class DraftingLedger(LedgerProgram):
    """Decodes like a speculative Program: each decode row verifies ``DRAFTS`` draft tokens and yields the
    next ``accept(position) + 1`` tokens of the reference chain, so the output is the reference and only the
    tokens per step vary. It writes one position per decode (``decode_span`` 1) and reports the other
    accepted tokens as input to rebuild. ``verified`` logs (drafted, produced) of every row it committed
    uncancelled: the Program's own account the engine's counters must match."""

    DRAFTS = 2

    def __init__(self, *, accept=lambda position: position % 3, **kw) -> None:
        super().__init__(**kw)
        self.accept = accept
        self.verified: list[tuple[int, int]] = []

    def decode(self, sequence_ids: Sequence[int], *, masks=None) -> PendingBatch:
        batch = super().decode(sequence_ids, masks=masks)
        rows = []
        for row in batch.rows:
            s = self.seqs[row.sequence_id]
            history, tokens = [*s.inputs, *row.tokens], list(row.tokens)
            for _ in range(self.accept(len(s.inputs))):
                tokens.append(next_token(history, s.sampling, self.vocab))
                history.append(tokens[-1])
            rows.append(PendingRow(sequence_id=row.sequence_id, tokens=tuple(tokens), drafted=self.DRAFTS))
        return PendingBatch(kind="decode", rows=rows, native=batch.native)

    def commit(self, batch: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        self.verified += [(row.drafted, row.produced) for row, d in zip(batch.rows, decisions, strict=True)
                          if row.drafted and not d.cancelled]
        super().commit(batch, decisions)


def drafting_engine(**program_kw) -> Engine:
    program = DraftingLedger(slots=4, **program_kw)
    return Engine.from_instance(ledger_instance(program), EngineConfig(max_concurrency=4, max_model_len=program.max_model_len,
                                                   prefill_chunk=8, device="cpu"))


def expected_speculative(verified: list[tuple[int, int]]):
    from ninfer.contract.config import MAX_DRAFT_TOKENS
    from ninfer.engine.metrics import SpeculativeStats

    accepted = [produced - 1 for _, produced in verified]
    return SpeculativeStats(drafts=len(verified), draft_tokens=sum(d for d, _ in verified),
                            accepted_tokens=sum(accepted),
                            accepted_per_position=tuple(sum(a > i for a in accepted) for i in range(MAX_DRAFT_TOKENS)))


def test_drafted_rows_count_as_verify_steps_and_accepted_drafts():
    with drafting_engine() as eng:
        handles = [eng.submit(req(p, max_tokens=20)) for p in ([5, 6, 7], [9, 3], [11])]
        for p, h in zip(([5, 6, 7], [9, 3], [11]), handles, strict=True):
            assert list(h.result(timeout=60).token_ids) == reference_tokens(
                p, SamplingParams(max_tokens=20, temperature=0.0))
        verified = eng.instance.program.verified
        assert {p - 1 for _, p in verified} == {0, 1, 2}  # rejections, partial and full acceptance all occur
        spec = eng.metrics().speculative
        assert spec == expected_speculative(verified)
        assert spec.mean_acceptance_length == 1 + spec.accepted_tokens / spec.drafts
        assert spec.acceptance_rate == spec.accepted_tokens / spec.draft_tokens
        drained(eng)


def test_drafts_accepted_past_a_stop_still_count():
    """Verification accepted both drafts; the stop inside the span ends the request, the counters keep both."""
    sampling = SamplingParams(max_tokens=20, temperature=0.0)
    ref = reference_tokens([5, 6, 7], sampling)
    assert ref[2] not in ref[:2]
    with drafting_engine(accept=lambda position: 2) as eng:
        result = eng.generate(req([5, 6, 7], max_tokens=20, stop_token_ids=(ref[2],)), timeout=60)
        assert result.finish_reason is FinishReason.STOP and list(result.token_ids) == ref[:3]
        assert eng.instance.program.verified == [(2, 3)]  # one verify row: 3 tokens, of which the stop keeps 2
        assert eng.metrics().speculative == expected_speculative([(2, 3)])
        assert eng.metrics().speculative.accepted_per_position == (1, 1, 0)
        drained(eng)


def test_a_cancelled_drafted_row_is_not_counted():
    with drafting_engine(accept=lambda position: 2) as eng:
        prog = eng.instance.program
        prog.gate.clear()  # hold the first decode until the request is cancelled
        h = eng.submit(req([1, 2], max_tokens=50, ignore_eos=True))
        assert prog.in_unit.wait(10)
        h.cancel()
        prog.gate.set()
        assert h.result(timeout=10).finish_reason is FinishReason.CANCELLED
        assert prog.cancelled_rows == 1 and prog.verified == []
        assert eng.metrics().speculative == expected_speculative([])
        drained(eng)


def test_the_recorder_counts_each_position_a_row_accepted():
    from ninfer.engine.metrics import MetricsRecorder

    rec = MetricsRecorder()
    assert rec.snapshot(queue_depth=0, running=0, paused=0, outstanding=0, kv_pages_used=0, kv_pages_total=1,
                        failed=False).speculative.mean_acceptance_length is None
    for drafted, accepted in ((3, 3), (3, 0), (2, 1), (1, 1)):
        rec.drafts_verified(drafted, accepted)
    spec = rec.snapshot(queue_depth=0, running=0, paused=0, outstanding=0, kv_pages_used=0, kv_pages_total=1,
                        failed=False).speculative
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens, spec.accepted_per_position) == (4, 9, 5, (3, 1, 1))
    assert spec.mean_acceptance_length == 1 + 5 / 4 and spec.acceptance_rate == 5 / 9
    rec.drafts_verified(5, 5)  # a drafter longer than the per-position series: its first positions are counted
    spec = rec.snapshot(queue_depth=0, running=0, paused=0, outstanding=0, kv_pages_used=0, kv_pages_total=1,
                        failed=False).speculative
    assert spec.accepted_per_position == (4, 2, 2) and spec.accepted_tokens == 10
