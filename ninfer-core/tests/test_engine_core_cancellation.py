"""Cancellation on the ledger Program (ninfer.testing.ledger): in every state of a request, while paused, from a
closed consumer loop and from many threads at once; every page, slot and byte is free after."""

from __future__ import annotations

import random

from ninfer.contract.events import FinishReason, GenerationResult
from ninfer.contract.request import SamplingParams
from ninfer.engine.errors import (
    Overloaded,
)
from ninfer.testing.ledger import (
    PAGE_BYTES,
    drained,
    long_engine,
    make_engine,
    reference_tokens,
    req,
    wait_until,
)


def test_a_closed_consumer_loop_does_not_hurt_the_engine():
    import asyncio

    with long_engine(max_concurrency=1) as eng:
        h = eng.submit(req([1, 2, 3], max_tokens=10**6, ignore_eos=True))

        async def first_then_leave():
            it = h.__aiter__()
            await it.__anext__()  # GenerationStart
            h._channel.events.clear()
            h._channel._waiters.append((asyncio.get_running_loop(), asyncio.get_running_loop().create_future()))

        asyncio.run(first_then_leave())  # the loop closes with a waiter registered
        wait_until(lambda: not h._channel._waiters)  # the worker published and woke the dead loop's waiter
        h.cancel()
        assert h.result(timeout=10).finish_reason is FinishReason.CANCELLED
        assert not eng.failed
        drained(eng)


def test_cancellation_in_every_state():
    eng = long_engine(max_concurrency=2, prefill_chunk=1)
    prog = eng.instance.program
    # Decode, cancelled while its PendingBatch is provisional: the row accepts zero tokens.
    prog.gate.clear()
    decoding = eng.submit(req([1, 2], max_tokens=10**6, ignore_eos=True))
    assert prog.in_unit.wait(10)
    prog.in_unit.clear()
    decoding.cancel()
    prog.gate.set()
    r = decoding.result(timeout=10)
    assert r.finish_reason is FinishReason.CANCELLED and prog.cancelled_rows == 1
    assert len(r.token_ids) == 1  # only the prefill's first token was committed and published
    # Waiting behind two long residents, then Prefill (held inside a chunk), then finished (no effect).
    blockers = [eng.submit(req([3, 4], max_tokens=10**6, ignore_eos=True)) for _ in range(2)]
    waiting = eng.submit(req([5, 6], max_tokens=4))
    waiting.cancel()
    r = waiting.result(timeout=10)
    assert r.finish_reason is FinishReason.CANCELLED and r.usage.completion_tokens == 0
    assert r.timings.time_to_first_token_s is None
    for b in blockers:
        b.cancel()
        assert b.result(timeout=10).finish_reason is FinishReason.CANCELLED
    prog.prefill_gate.clear()
    prefilling = eng.submit(req(list(range(1, 40)), max_tokens=4))
    assert prog.in_unit.wait(10)
    prefilling.cancel()
    prog.prefill_gate.set()
    r = prefilling.result(timeout=10)
    assert r.finish_reason is FinishReason.CANCELLED and r.usage.completion_tokens == 0
    done = eng.submit(req([7], max_tokens=2))
    assert done.result(timeout=10).finish_reason is FinishReason.LENGTH
    done.cancel()  # after the end: nothing happens
    drained(eng)
    eng.close()


def test_cancellation_while_paused_discards_the_resume_state():
    eng = make_engine(max_concurrency=4, pages=62, host_bytes=1 << 20)
    prog = eng.instance.program
    prog.gate.clear()
    prog.close_gate_on_pause = True
    a = eng.submit(req([1, 2, 3, 4], max_tokens=200, ignore_eos=True))
    b = eng.submit(req(list(range(1, 41)), max_tokens=200, ignore_eos=True))
    prog.gate.set()
    assert prog.paused_once.wait(10)  # B is paused (Snapshot: host room allows) and the worker is held
    published = b._channel.events.copy()
    b.cancel()
    prog.gate.set()
    rb, ra = b.result(timeout=10), a.result(timeout=10)
    assert rb.finish_reason is FinishReason.CANCELLED and rb.timings.preemptions == 1
    assert ra.finish_reason is FinishReason.LENGTH
    assert [t for e in published if hasattr(e, "token_ids") and not isinstance(e, GenerationResult)
            for t in e.token_ids] == list(rb.token_ids)  # nothing published after the pause
    assert prog.resumes and all(r.settled for r in prog.resumes) and prog.host_used == 0
    drained(eng)
    eng.close()


def test_many_threads_submit_consume_cancel_and_abandon():
    import concurrent.futures

    eng = make_engine(max_concurrency=3, pages=30, host_bytes=4 * PAGE_BYTES, max_queue=8)
    overloaded = []

    def client(seed):
        rng = random.Random(seed)
        outcomes = []
        for _ in range(12):
            p = [rng.randrange(1, 47) for _ in range(rng.randint(1, 12))]
            try:
                h = eng.submit(req(p, max_tokens=rng.randint(1, 20), ignore_eos=True))
            except Overloaded:
                overloaded.append(seed)
                continue
            action = rng.random()
            if action < 0.2:
                h.cancel()
                outcomes.append(h.result(timeout=30).finish_reason)
            elif action < 0.35:
                del h  # abandoned mid-flight
            else:
                evs = list(h)
                assert isinstance(evs[-1], GenerationResult)
                exp = reference_tokens(p, SamplingParams(max_tokens=evs[-1].usage.completion_tokens or 1,
                                                         ignore_eos=True, temperature=0.0))
                assert list(evs[-1].token_ids) == exp[:len(evs[-1].token_ids)]
                outcomes.append(evs[-1].finish_reason)
        return outcomes

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outcomes = [o for f in [pool.submit(client, s) for s in range(6)] for o in f.result()]
    assert FinishReason.ERROR not in outcomes
    import gc

    gc.collect()
    drained(eng)
    eng.close()
