"""Engine lifecycle on the ledger Program and token Frontend (ninfer.testing.ledger): event order, outputs equal
to running alone, forced preemption, rejections, deadlines, failures, closing and metrics. Scheduling under
pressure, cancellation and speculative counters are in the test_engine_core_*.py beside it; end-to-end tests
through the real Qwen3.5 Program live in tests/test_engine_*.py.
"""

from __future__ import annotations

import random

import attrs
import pytest

from ninfer.contract.events import FinishReason, GenerationResult, GenerationStart, OutputDelta, ToolCall
from ninfer.contract.model import Preview
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.errors import (
    EngineClosed,
    EngineFailed,
    InputTooLong,
    Overloaded,
    QueueTimeout,
    Unrepresentable,
)
from ninfer.testing.ledger import (
    PAGE_BYTES,
    TokenSession,
    drained,
    long_engine,
    make_engine,
    prompts,
    reference_tokens,
    req,
    wait_until,
)
from ninfer.testing.scheduling import submit_together


def test_single_request_event_order_and_settlement():
    with make_engine() as eng:
        h = eng.submit(req([5, 6, 7], max_tokens=6))
        events = list(h)
        assert isinstance(events[0], GenerationStart) and events[0].prompt_tokens == 3
        assert isinstance(events[-1], GenerationResult)
        assert all(not isinstance(e, (GenerationStart, GenerationResult)) for e in events[1:-1])
        res = events[-1]
        expect = reference_tokens([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))
        assert list(res.token_ids) == expect
        assert [t for e in events[1:-1] for t in e.token_ids] == expect
        assert res.usage.completion_tokens == len(expect) and res.usage.prompt_tokens == 3
        assert res.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert res.timings.end_to_end_s >= res.timings.time_to_first_token_s >= 0  # structure, not speed
        drained(eng)


class ToolCallSession(TokenSession):
    """Streams one tool call as fragments: the first names the call, later ones append argument text."""

    def commit(self, preview: Preview) -> OutputDelta:
        delta = super().commit(preview)
        frags = tuple(ToolCall(index=0, id="call_0" if len(self.committed) == n + 1 else "",
                               name="lookup" if len(self.committed) == n + 1 else "", arguments=f"{t},")
                      for n, t in zip(range(len(self.committed) - len(delta.token_ids), len(self.committed)),
                                      delta.token_ids, strict=True))
        return attrs.evolve(delta, tool_calls=frags)


def test_final_result_merges_streamed_tool_call_fragments():
    with make_engine() as eng:
        eng.frontend.open_session = lambda prompt, sampling, constraint=None, cancel=None: ToolCallSession(sampling)
        h = eng.submit(req([5, 6, 7], max_tokens=6))
        events = list(h)
        res = events[-1]
        frags = [c for e in events[1:-1] for c in e.tool_calls]
        assert len(frags) == len(res.token_ids) > 1
        assert res.tool_calls == (ToolCall(index=0, id="call_0", name="lookup",
                                           arguments="".join(f"{t}," for t in res.token_ids)),)
        drained(eng)


@pytest.mark.parametrize("concurrency", [1, 2, 8])
def test_concurrent_residents_match_running_alone(concurrency):
    rng = random.Random(concurrency)
    ps = prompts(concurrency * 2, rng, 1, 40)
    with make_engine(max_concurrency=concurrency) as eng:
        handles = [eng.submit(req(p, max_tokens=rng.randint(1, 20))) for p in ps]
        results = [h.result(timeout=30) for h in handles]
        for p, h, r in zip(ps, handles, results, strict=True):
            sp = SamplingParams(max_tokens=r.usage.completion_tokens, temperature=0.0)
            assert list(r.token_ids) == reference_tokens(p, sp)[:len(r.token_ids)], h.request_id
            assert r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        drained(eng)


def _run_workload(eng, ps, sampling_list):
    handles = submit_together(eng, [req(p, **s) for p, s in zip(ps, sampling_list, strict=True)])
    return [h.result(timeout=60) for h in handles]


@pytest.mark.parametrize("mode", ["snapshot", "replay", "auto"])
@pytest.mark.parametrize("seeded", [False, True])
def test_forced_preemption_gives_identical_outputs(mode, seeded):
    rng = random.Random(7)
    ps = prompts(8, rng, 3, 20)
    samp = [dict(max_tokens=rng.randint(10, 30), ignore_eos=True, **(
        dict(temperature=0.8, seed=rng.randrange(1000)) if seeded else {})) for _ in ps]
    with make_engine(max_concurrency=4, pages=400) as eng:
        calm = _run_workload(eng, ps, samp)
        assert eng.metrics().preemptions == 0
        drained(eng)
    # 14 pages of 4 positions cannot hold 4 residents of up to 50 positions: pauses are forced.
    host = 1 << 30 if mode != "auto" else 3 * PAGE_BYTES * 6
    with make_engine(max_concurrency=4, pages=14, pause_mode=mode, host_bytes=host) as eng:
        tight = _run_workload(eng, ps, samp)
        m = eng.metrics()
        drained(eng)
    assert m.preemptions > 0
    if mode == "snapshot":
        assert m.preemptions_snapshot == m.preemptions
    if mode == "replay":
        assert m.preemptions_replay == m.preemptions
    for a, b in zip(calm, tight, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert b.usage.completion_tokens == len(b.token_ids)
    assert sum(r.timings.preemptions for r in tight) == m.preemptions


def test_rejections_name_the_problem():
    with make_engine(max_concurrency=1) as eng:
        with pytest.raises(InputTooLong, match="context limit"):
            eng.submit(req(list(range(1, 50)) * 6))
        assert eng.metrics().requests_rejected == {"too_long": 1}
    with long_engine(max_concurrency=1, max_queue=0) as eng:
        with pytest.raises(Unrepresentable, match="token ids only"):
            eng.submit(GenerationRequest(input=TextInput(text="hello")))
        with pytest.raises(Unrepresentable, match="GenerationRequest"):
            eng.submit("hello")
        h = eng.submit(req([1, 2, 3], max_tokens=10**6, ignore_eos=True))  # ends when cancelled
        with pytest.raises(Overloaded) as info:
            eng.submit(req([1, 2]))
        assert info.value.kind == "overload" and info.value.http_status == 429
        h.cancel()
        assert h.result(timeout=10).finish_reason is FinishReason.CANCELLED
        m = eng.metrics()
        assert m.requests_rejected == {"invalid": 2, "overload": 1}
        drained(eng)


def test_queue_timeout_ends_the_handle_with_an_error():
    with long_engine(max_concurrency=1) as eng:
        blocker = eng.submit(req([1, 2, 3], max_tokens=10**6, ignore_eos=True))  # ends when cancelled
        late = eng.submit(GenerationRequest(input=TextInput(token_ids=(4, 5)), queue_timeout_s=0.05))
        res = late.result(timeout=10)
        assert res.finish_reason is FinishReason.ERROR and res.extra["error_kind"] == "queue_timeout"
        assert isinstance(late.exception(), QueueTimeout)
        assert res.usage.completion_tokens == 0
        blocker.cancel()
        assert blocker.result(timeout=10).finish_reason is FinishReason.CANCELLED
        drained(eng)


def test_deadline_stops_a_running_request_and_keeps_its_output():
    with long_engine(max_concurrency=2) as eng:
        h = eng.submit(GenerationRequest(input=TextInput(token_ids=(1, 2, 3)), deadline_s=0.2,
                                         sampling=SamplingParams(max_tokens=10**6, ignore_eos=True)))
        events = list(h)
        res = events[-1]
        assert res.finish_reason is FinishReason.DEADLINE and res.error is None
        published = [t for e in events[1:-1] for t in e.token_ids]
        assert list(res.token_ids) == published and len(published) == res.usage.completion_tokens
        drained(eng)


def test_abandoned_handle_cancels_and_releases_capacity():
    with long_engine(max_concurrency=1, max_queue=1) as eng:
        h = eng.submit(req([1, 2, 3], max_tokens=10**5, ignore_eos=True))
        assert eng.metrics().outstanding == 1
        del h  # abandonment: cancellation + consumer released
        drained(eng)
        # A handle whose response is done but never read still holds its place until released.
        h2 = eng.submit(req([1, 2], max_tokens=2))
        wait_until(lambda: h2.done)
        assert eng.metrics().outstanding == 1
        h2.close()
        assert eng.metrics().outstanding == 0
        drained(eng)


def test_async_iteration():
    import asyncio

    async def main(eng):
        h = eng.submit(req([9, 8, 7], max_tokens=5))
        evs = [ev async for ev in h]
        return evs

    with make_engine() as eng:
        evs = asyncio.run(main(eng))
        assert isinstance(evs[0], GenerationStart) and isinstance(evs[-1], GenerationResult)
        assert list(evs[-1].token_ids) == reference_tokens([9, 8, 7], SamplingParams(max_tokens=5, temperature=0.0))
        drained(eng)


@pytest.mark.parametrize("where", ["decode", "commit", "prefill"])
def test_engine_failure_completes_every_response_and_refuses_work(where):
    eng = long_engine(max_concurrency=3)
    handles = [eng.submit(req([1, 2, 3 + i], max_tokens=10**6, ignore_eos=True)) for i in range(2)]
    assert isinstance(handles[0].next_event(timeout=10), GenerationStart)  # the engine is running
    eng.instance.program.fail_on = where
    for i in range(2, 5):
        try:
            handles.append(eng.submit(req([1, 2, 3 + i], max_tokens=10**6, ignore_eos=True)))
        except EngineFailed:  # the failure may already have happened: new work is refused
            break
    results = [h.result(timeout=10) for h in handles]
    assert all(r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "engine_failed" for r in results)
    assert all(isinstance(h.exception(), EngineFailed) for h in handles)
    with pytest.raises(EngineFailed):
        eng.submit(req([1]))
    assert eng.failed and eng.metrics().failed and eng.metrics().outstanding == 0
    eng.instance.program.fail_on = None
    assert eng.usage().all_free  # cleanup released what the residents held
    eng.close()


def test_close_ends_in_flight_requests_and_waits_for_the_worker():
    eng = long_engine(max_concurrency=1)
    running = eng.submit(req([1, 2], max_tokens=10**5, ignore_eos=True))
    waiting = eng.submit(req([3, 4], max_tokens=3))
    eng.close()
    assert not eng._core.thread.is_alive()
    for h in (running, waiting):
        r = h.result(timeout=1)
        assert r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "closed"
    with pytest.raises(EngineClosed):
        eng.submit(req([1]))
    assert eng.usage().all_free


def test_close_with_drain_finishes_work():
    eng = make_engine(max_concurrency=2)
    hs = [eng.submit(req([i + 1, 2], max_tokens=5)) for i in range(5)]
    eng.close(drain=True)
    assert all(h.result(timeout=1).finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for h in hs)
    assert eng.usage().all_free


def test_metrics_count_tokens_and_latencies():
    with make_engine(max_concurrency=2) as eng:
        rs = [eng.generate(req([1 + i, 2, 3], max_tokens=4, ignore_eos=True), timeout=10) for i in range(3)]
        m = eng.metrics()
        assert m.prompt_tokens == 9 and m.generated_tokens == sum(r.usage.completion_tokens for r in rs) == 12
        assert m.ttft.count == 3 and m.end_to_end.count == 3 and m.queue_time.count == 3
        assert m.inter_token.count == 9
        assert m.requests_finished == {"length": 3}
        assert m.queue_depth == 0 and m.running == 0 and m.paused == 0 and m.kv_pages_total == 256
        drained(eng)
