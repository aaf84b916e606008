"""Scheduler policy on plain records (hypothesis): permit order, victims, prefill rotation, bypass bound."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.contract.model import SnapshotCost
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


def resident(ts: list[int], state: RequestState) -> tuple[Scheduler, list[RequestRecord]]:
    """A scheduler (8 places, bypass limit 2) holding one resident record in ``state`` per ticket."""
    s = Scheduler(max_concurrency=8, bypass_limit=2)
    recs = [record(t, state) for t in ts]
    for r in recs:
        s.make_resident(r)
    return s, recs


@given(tickets, st.data())
def test_permit_order_is_protected_first_then_oldest(ts, data):
    s, recs = resident(ts, RequestState.DECODE_READY)
    s.protected = data.draw(st.sampled_from([None, *recs]))
    order = s.permit_order()
    rest = [r for r in order if r is not s.protected]
    assert [r.ticket for r in rest] == sorted(r.ticket for r in rest)
    if s.protected is not None:
        assert order[0] is s.protected


@given(tickets, st.data())
def test_victim_is_the_youngest_younger_resident_never_the_protected(ts, data):
    s, recs = resident(ts, RequestState.DECODE_READY)
    s.protected = data.draw(st.sampled_from([None, *recs]))
    needy = data.draw(st.sampled_from(recs))
    victim = s.victim_for(needy)
    allowed = [r for r in recs if r.ticket > needy.ticket and r is not s.protected]
    assert victim is (max(allowed, key=lambda r: r.ticket) if allowed else None)


@settings(max_examples=50)
@given(tickets, st.integers(1, 30))
def test_prefill_rotation_serves_every_candidate_within_one_round(ts, rounds):
    s, recs = resident(ts, RequestState.PREFILL)
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


def paused_snapshots(s: Scheduler, costs) -> list[RequestRecord]:
    """Paused records (tickets 0..) holding Snapshots of (host_bytes, replay_positions); None: a Replay pause."""
    recs = []
    for t, cost in enumerate(costs):
        rec = record(t, RequestState.DECODE_READY)
        s.make_resident(rec)
        s.make_paused(rec)
        rec.snapshot = None if cost is None else SnapshotCost(host_bytes=cost[0], replay_positions=cost[1])
        recs.append(rec)
    return recs


def test_revocation_takes_the_shortest_replays_first_and_only_when_it_gains():
    s = Scheduler(max_concurrency=8, bypass_limit=2)
    a, b, c, d, e = paused_snapshots(s, [(130, 30), (60, 10), None, (60, 10), (80, 20)])
    assert s.revocations_for(50, saves=40) == [d]              # equal replay: the youngest goes
    assert s.revocations_for(100, saves=40) == [d, b]          # then the next shortest
    assert s.revocations_for(150, saves=41) == [d, b, e]       # loses 40 < 41
    assert s.revocations_for(150, saves=40) == []              # would lose 40 to save 40: keep them
    assert s.revocations_for(400, saves=10**6) == []           # all of them cannot make room
    assert s.revocations_for(0, saves=10**6) == []             # nothing short: nothing to revoke
    assert c not in s.revocations_for(330, saves=10**6) and len(s.revocations_for(330, saves=10**6)) == 4


@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(1, 500), st.integers(0, 100))), max_size=8),
       st.integers(-50, 2000), st.integers(0, 300))
def test_revocation_rule_properties(costs, shortfall, saves):
    s = Scheduler(max_concurrency=8, bypass_limit=2)
    recs = paused_snapshots(s, costs)
    held = [r for r in recs if r.snapshot is not None]
    chosen = s.revocations_for(shortfall, saves)
    if not chosen:
        return
    assert all(r.snapshot is not None for r in chosen) and len(set(map(id, chosen))) == len(chosen)
    freed = sum(r.snapshot.host_bytes for r in chosen)
    assert freed >= shortfall > 0                                         # it makes room
    assert freed - chosen[-1].snapshot.host_bytes < shortfall             # and no more than needed
    assert sum(r.snapshot.replay_positions for r in chosen) < saves       # and gains replay work
    longest = max(r.snapshot.replay_positions for r in chosen)
    assert all(r.snapshot.replay_positions >= longest for r in held if r not in chosen)

