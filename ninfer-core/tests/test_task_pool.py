"""TaskPool: fixed threads, bounded FIFO, refused submits consume nothing, cancellable blocking submit,
per-task result/exception channel, asyncio waiting with abandonment, drain-then-join shutdown (bounded when
asked), and per-owner caps with the owners running fewest tasks served first.
Every wait is on an event the test controls; timeouts are hang guards only."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ninfer.core.task_pool import OwnerAtLimit, PoolClosed, Task, TaskCancelled, TaskPool

GUARD_S = 30.0  # hang guard: no test waits this long unless it is broken


def blocker() -> tuple[threading.Event, threading.Event, Task]:
    """A task that signals it started and then holds its thread until released."""
    started, release = threading.Event(), threading.Event()

    def run() -> str:
        started.set()
        assert release.wait(GUARD_S)
        return "blocker"
    return started, release, Task(run)


@pytest.fixture
def pool():
    p = TaskPool("test", threads=1, max_queued=2)
    yield p
    p.shutdown(timeout=GUARD_S)


def test_fifo_order_results_and_exceptions(pool):
    started, release, first = blocker()
    assert pool.try_submit(first) and started.wait(GUARD_S)
    order: list[int] = []
    ok = Task(lambda: order.append(1) or "one")

    def boom() -> None:
        order.append(2)
        raise ValueError("bad input")
    bad = Task(boom)
    assert pool.try_submit(ok) and pool.try_submit(bad)
    assert pool.queued == 2 and pool.running == 1
    release.set()
    assert first.result(GUARD_S) == "blocker"
    assert ok.result(GUARD_S) == "one"
    with pytest.raises(ValueError, match="bad input"):
        bad.result(GUARD_S)
    assert isinstance(bad.exception(GUARD_S), ValueError)
    assert order == [1, 2]
    after = Task(lambda: "still serving")  # the thread survived the exception
    assert pool.try_submit(after) and after.result(GUARD_S) == "still serving"


def test_refused_immediate_submit_consumes_no_task(pool):
    started, release, first = blocker()
    assert pool.try_submit(first) and started.wait(GUARD_S)
    queued = [Task(lambda i=i: i) for i in range(2)]
    assert all(pool.try_submit(t) for t in queued)
    refused = Task(lambda: "later")
    assert pool.try_submit(refused) is False
    assert not refused.done() and pool.queued == 2
    release.set()
    assert [t.result(GUARD_S) for t in queued] == [0, 1]
    assert pool.try_submit(refused)  # the same task, submitted again once there is room
    assert refused.result(GUARD_S) == "later"
    with pytest.raises(RuntimeError, match="submitted once"):
        pool.try_submit(refused)


def test_zero_length_queue_still_feeds_an_idle_thread():
    with TaskPool("direct", threads=1, max_queued=0) as p:
        started, release, first = blocker()
        assert p.try_submit(first) and started.wait(GUARD_S)
        assert p.try_submit(Task(lambda: None)) is False
        release.set()
        assert first.result(GUARD_S) == "blocker"


def test_blocking_submit_waits_for_room_and_honours_cancellation(pool):
    started, release, first = blocker()
    assert pool.try_submit(first) and started.wait(GUARD_S)
    fill = [Task(lambda: None) for _ in range(2)]
    assert all(pool.try_submit(t) for t in fill)

    stop = threading.Event()
    waiting = Task(lambda: "never")
    checks = threading.Event()

    def cancelled() -> bool:
        checks.set()
        return stop.is_set()
    outcome: list[bool] = []
    t = threading.Thread(target=lambda: outcome.append(pool.submit(waiting, cancelled=cancelled)))
    t.start()
    assert checks.wait(GUARD_S)  # it is waiting and checking
    stop.set()
    t.join(GUARD_S)
    assert outcome == [False] and not waiting.done()  # cancelled while waiting: nothing was consumed

    admitted = Task(lambda: "admitted")
    t = threading.Thread(target=lambda: outcome.append(pool.submit(admitted)))
    t.start()
    release.set()  # frees the thread, then the queue drains and room appears
    t.join(GUARD_S)
    assert outcome == [False, True] and admitted.result(GUARD_S) == "admitted"
    assert pool.submit(Task(lambda: None), timeout=GUARD_S)


def test_blocking_submit_timeout_leaves_the_task_unsubmitted(pool):
    started, release, first = blocker()
    assert pool.try_submit(first) and started.wait(GUARD_S)
    assert all(pool.try_submit(Task(lambda: None)) for _ in range(2))
    late = Task(lambda: None)
    assert pool.submit(late, timeout=0.01) is False and not late.done()
    release.set()


def test_cancel_before_start_frees_the_place_and_never_runs(pool):
    started, release, first = blocker()
    assert pool.try_submit(first) and started.wait(GUARD_S)
    ran = threading.Event()
    victim = Task(ran.set)
    assert pool.try_submit(victim) and pool.queued == 1
    assert victim.cancel() and victim.cancelled() and pool.queued == 0
    with pytest.raises(TaskCancelled):
        victim.result(0)
    assert first.cancel() is False  # already running
    release.set()
    tail = Task(lambda: "tail")
    assert pool.try_submit(tail) and tail.result(GUARD_S) == "tail"
    assert not ran.is_set()


def test_shutdown_refuses_new_work_drains_accepted_and_joins():
    p = TaskPool("drain", threads=2, max_queued=8)
    started, release, first = blocker()
    assert p.try_submit(first) and started.wait(GUARD_S)
    accepted = [Task(lambda i=i: i) for i in range(6)]
    assert all(p.try_submit(t) for t in accepted)
    closer = threading.Thread(target=p.shutdown)
    closer.start()
    # once shutdown has begun nothing new is accepted, while the accepted tasks still run
    ready = threading.Event()

    def refused_after_close() -> None:
        end = time.monotonic() + GUARD_S
        while not p.closed and time.monotonic() < end:
            ready.wait(0.001)
        with pytest.raises(PoolClosed):
            p.try_submit(Task(lambda: None))
        with pytest.raises(PoolClosed):
            p.submit(Task(lambda: None))
        ready.set()
    checker = threading.Thread(target=refused_after_close)
    checker.start()
    checker.join(GUARD_S)
    assert ready.is_set()
    release.set()
    closer.join(GUARD_S)
    assert not closer.is_alive()
    assert [t.result(0) for t in accepted] == list(range(6))
    assert not any(w.is_alive() for w in p._workers)


def test_shutdown_wakes_a_blocked_submitter():
    p = TaskPool("wake", threads=1, max_queued=0)
    started, release, first = blocker()
    assert p.try_submit(first) and started.wait(GUARD_S)
    errors: list[BaseException] = []
    waiting = threading.Event()

    def submit() -> None:
        try:
            p.submit(Task(lambda: None), cancelled=lambda: waiting.set() or False)
        except PoolClosed as exc:
            errors.append(exc)
    t = threading.Thread(target=submit)
    t.start()
    assert waiting.wait(GUARD_S)  # blocked: the only thread is busy and there is no queue
    closer = threading.Thread(target=p.shutdown)
    closer.start()
    t.join(GUARD_S)
    assert not t.is_alive() and len(errors) == 1
    release.set()
    closer.join(GUARD_S)
    assert not closer.is_alive() and first.result(0) == "blocker"


def test_asyncio_wait_returns_results_and_raises_errors(pool):
    async def main():
        ok, bad = Task(lambda: 42), Task(lambda: 1 / 0)
        assert pool.try_submit(ok) and pool.try_submit(bad)
        assert await ok.wait() == 42
        with pytest.raises(ZeroDivisionError):
            await bad.wait()
        assert await ok.wait() == 42  # a finished task answers at once
    asyncio.run(main())


def test_cancelled_awaiter_abandons_the_task(pool):
    """A queued task whose awaiter is cancelled never runs; a running one hands its result to on_abandon."""
    started, release, first = blocker()
    discarded: list[str] = []
    first = Task(first._fn, on_abandon=discarded.append)
    ran = threading.Event()
    queued = Task(ran.set)

    async def main():
        assert pool.try_submit(first) and pool.try_submit(queued)
        waits = [asyncio.ensure_future(first.wait()), asyncio.ensure_future(queued.wait())]
        await asyncio.get_running_loop().run_in_executor(None, started.wait, GUARD_S)
        for w in waits:
            w.cancel()
        for w in waits:
            with pytest.raises(asyncio.CancelledError):
                await w
    asyncio.run(main())
    assert queued.cancelled() and pool.queued == 0
    assert discarded == []  # still running: abandoned, not yet finished
    release.set()
    assert first.result(GUARD_S) == "blocker"
    assert discarded == ["blocker"]
    first.abandon()  # at most once
    assert discarded == ["blocker"] and not ran.is_set()


def test_abandoning_a_finished_task_discards_its_result_once():
    with TaskPool("fin", threads=1, max_queued=1) as p:
        got: list[int] = []
        t = Task(lambda: 7, on_abandon=got.append)
        assert p.try_submit(t) and t.result(GUARD_S) == 7
        t.abandon()
        t.abandon()
        assert got == [7]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least one thread"):
        TaskPool("x", threads=0, max_queued=1)
    with pytest.raises(ValueError, match="max_queued"):
        TaskPool("x", threads=1, max_queued=-1)


def test_an_owner_holds_at_most_max_per_owner_places():
    """Queued and running tasks count against their owner; a refused submit consumes nothing; a place comes
    back when a task ends or is cancelled while queued; other owners are not affected."""
    with TaskPool("owned", threads=1, max_queued=8, max_per_owner=2) as p:
        started, release, first = blocker()
        assert p.try_submit(first, owner="a") and started.wait(GUARD_S)
        queued = Task(lambda: "queued")
        assert p.try_submit(queued, owner="a")
        assert p.held("a") == 2
        refused = Task(lambda: "refused")
        with pytest.raises(OwnerAtLimit):
            p.try_submit(refused, owner="a")
        assert not refused.done() and p.queued == 1
        other = Task(lambda: "other")
        assert p.try_submit(other, owner="b") and p.held("b") == 1
        assert queued.cancel() and p.held("a") == 1  # a cancelled queued task gives its place back
        assert p.try_submit(refused, owner="a")  # the same task, once there is room for its owner
        release.set()
        assert first.result(GUARD_S) == "blocker"
        assert refused.result(GUARD_S) == "refused" and other.result(GUARD_S) == "other"
        end = time.monotonic() + GUARD_S
        while p.held("a") or p.held("b"):  # the worker gives the places back right after each task
            assert time.monotonic() < end
            time.sleep(0.001)


def test_a_free_thread_takes_the_owner_running_fewest_first():
    """Two threads are busy with owner a's tasks; a's next task was queued before b's. The first thread to
    come free takes b's task: one owner's backlog does not keep every thread from the others."""
    order: list[str] = []
    with TaskPool("fair", threads=2, max_queued=8) as p:
        (s1, r1, t1), (s2, r2, t2) = blocker(), blocker()
        assert p.try_submit(t1, owner="a") and p.try_submit(t2, owner="a")
        assert s1.wait(GUARD_S) and s2.wait(GUARD_S)
        a3, b1 = Task(lambda: order.append("a3")), Task(lambda: order.append("b1"))
        assert p.try_submit(a3, owner="a") and p.try_submit(b1, owner="b")
        r1.set()
        b1.result(GUARD_S)
        a3.result(GUARD_S)
        r2.set()
    assert order == ["b1", "a3"]


def test_an_owner_runs_at_most_max_running_per_owner_tasks_and_a_thread_stays_for_the_others():
    """With two threads and a running cap of one, owner a's second task waits queued while a thread is free, so
    owner b's task, queued after it, starts at once; a's task runs when its first ends; tasks without an owner
    are never held back; at shutdown the held-back tasks still run."""
    with TaskPool("capped", threads=2, max_queued=8, max_running_per_owner=1) as p:
        (s1, r1, a1) = blocker()
        assert p.try_submit(a1, owner="a") and s1.wait(GUARD_S)
        a2_started = threading.Event()
        a2 = Task(lambda: a2_started.set())
        assert p.try_submit(a2, owner="a")
        (s2, r2, b1) = blocker()
        assert p.try_submit(b1, owner="b") and s2.wait(GUARD_S)  # the free thread was kept for b
        assert not a2_started.is_set() and p.queued == 1
        r2.set()
        assert b1.result(GUARD_S) == "blocker"
        anonymous = [Task(lambda: "free") for _ in range(2)]
        for t in anonymous:
            assert p.try_submit(t)
        assert [t.result(GUARD_S) for t in anonymous] == ["free", "free"]
        assert not a2_started.is_set()  # still held back while a1 runs
        r1.set()
        assert a1.result(GUARD_S) == "blocker"
        assert a2_started.wait(GUARD_S)
    p = TaskPool("capped-drain", threads=1, max_queued=8, max_running_per_owner=1)
    done = [Task(lambda i=i: i) for i in range(3)]
    for t in done:
        assert p.try_submit(t, owner="a")
    p.shutdown()
    assert [t.result(0) for t in done] == [0, 1, 2]


def test_a_bounded_shutdown_returns_while_a_task_is_stuck():
    p = TaskPool("stuck", threads=2, max_queued=1)
    started, release, first = blocker()
    assert p.try_submit(first) and started.wait(GUARD_S)
    p.shutdown(timeout=0.05)  # returns with the stuck thread still running (a daemon)
    assert p.closed and any(w.is_alive() for w in p._workers)
    release.set()
    assert first.result(GUARD_S) == "blocker"
