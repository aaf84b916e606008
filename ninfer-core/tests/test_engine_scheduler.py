"""Scheduler policy on plain records (hypothesis): permit order, victims, prefill rotation, bypass bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.handle import ResponseChannel
from ninfer.engine.request import RequestRecord, RequestState
from ninfer.engine.scheduler import Scheduler


def record(ticket: int, state: RequestState = RequestState.WAITING) -> RequestRecord:
    prompt = PreparedPrompt(token_ids=(1,))
    rec = RequestRecord(ticket=ticket, request=GenerationRequest(input=prompt), prompt=prompt,
                        sampling=SamplingParams(), channel=ResponseChannel(f"r{ticket}", lambda: None, lambda: None))
    rec.state = state
    return rec


tickets = st.lists(st.integers(0, 1000), min_size=1, max_size=8, unique=True)


@given(tickets, st.data())
def test_permit_order_is_protected_first_then_oldest(ts, data):
    s = Scheduler(max_concurrency=8, bypass_limit=2)
    recs = [record(t, RequestState.DECODE_READY) for t in ts]
    for r in recs:
        s.make_resident(r)
    s.protected = data.draw(st.sampled_from([None, *recs]))
    order = s.permit_order()
    rest = [r for r in order if r is not s.protected]
    assert [r.ticket for r in rest] == sorted(r.ticket for r in rest)
    if s.protected is not None:
        assert order[0] is s.protected


@given(tickets, st.data())
def test_victim_is_the_youngest_younger_resident_never_the_protected(ts, data):
    s = Scheduler(max_concurrency=8, bypass_limit=2)
    recs = [record(t, RequestState.DECODE_READY) for t in ts]
    for r in recs:
        s.make_resident(r)
    s.protected = data.draw(st.sampled_from([None, *recs]))
    needy = data.draw(st.sampled_from(recs))
    victim = s.victim_for(needy)
    allowed = [r for r in recs if r.ticket > needy.ticket and r is not s.protected]
    assert victim is (max(allowed, key=lambda r: r.ticket) if allowed else None)


@settings(max_examples=50)
@given(tickets, st.integers(1, 30))
def test_prefill_rotation_serves_every_candidate_within_one_round(ts, rounds):
    s = Scheduler(max_concurrency=8, bypass_limit=2)
    recs = [record(t, RequestState.PREFILL) for t in ts]
    for r in recs:
        s.make_resident(r)
    picks = [s.pick_prefill(s.prefill_candidates()).ticket for _ in range(rounds * len(recs))]
    for i in range(0, len(picks), len(recs)):
        window = picks[i:i + len(recs)]
        if len(window) == len(recs):
            assert sorted(window) == sorted(ts)  # round robin: each once per round


@given(st.integers(0, 4), st.integers(1, 12))
def test_fresh_admission_closes_at_the_bypass_bound(limit, fresh):
    s = Scheduler(max_concurrency=8, bypass_limit=limit)
    paused = record(0, RequestState.DECODE_READY)
    s.make_resident(paused)
    s.make_paused(paused)
    admitted = 0
    for _ in range(fresh):
        if not s.fresh_admission_open():
            break
        s.note_fresh_admission()
        admitted += 1
    assert admitted == min(limit, fresh) and paused.bypassed == admitted <= limit
    s.make_resident(paused)  # resuming reopens admission; the next pause counts afresh
    s.make_paused(paused)
    assert paused.bypassed == 0 and s.fresh_admission_open() == (limit > 0)


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="max_concurrency"):
        Scheduler(max_concurrency=9, bypass_limit=1)
    with pytest.raises(ValueError, match="bypass_limit"):
        Scheduler(max_concurrency=2, bypass_limit=-1)
