"""TaskPool: fixed worker threads and a bounded FIFO of independent tasks.

Frontend media preparation and the HTTP gateway each own instances (they never share a queue).
An immediate submit that is refused consumes nothing: the caller still holds an unsubmitted task. A
blocking submit waits for room while the caller's ``cancelled`` check can end the wait. Each ``Task``
carries its own result and exception; the pool creates no future. ``shutdown`` first refuses new
submissions, then drains the accepted tasks and joins the threads.

A task may name an ``owner`` (the gateway uses the client's address). A pool made with ``max_per_owner``
refuses an owner's task while that owner already holds that many places (queued and running together),
and a free thread takes the oldest task of the owners running fewest tasks, so one owner's backlog cannot
keep every thread from the others. Tasks without an owner share one (``None``): plain FIFO.

A task is awaited from asyncio with ``await task.wait()``. A waiter that is cancelled abandons the task:
a task not yet started never runs, and one already running hands its result to ``on_abandon`` (for
example to close what it opened), so nothing it produced is lost unowned.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class PoolClosed(RuntimeError):
    """The pool is shut down (or shutting down) and accepts no new task."""


class OwnerAtLimit(RuntimeError):
    """The task's owner already holds ``max_per_owner`` places in the pool (queued and running)."""


class TaskCancelled(Exception):
    """The task was cancelled before it started; it never ran."""


class _State(enum.Enum):
    NEW = "new"  # not submitted (or refused): the caller may submit it again
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Task(Generic[T]):
    """One call of ``fn()`` in a pool thread, with its own result and exception channel."""

    def __init__(self, fn: Callable[[], T], *, on_abandon: Callable[[T], None] | None = None) -> None:
        self._fn = fn
        self._on_abandon = on_abandon
        self._cond = threading.Condition()
        self._state = _State.NEW
        self._result: T | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._unqueue: Callable[[Task], None] | None = None  # set by the pool while the task is queued
        self._owner: Hashable = None  # set by the pool when it accepts the task

    # -- state --------------------------------------------------------------------------------------
    def done(self) -> bool:
        """Finished (with a result or an exception) or cancelled."""
        with self._cond:
            return self._state in (_State.DONE, _State.CANCELLED)

    def cancelled(self) -> bool:
        with self._cond:
            return self._state is _State.CANCELLED

    def cancel(self) -> bool:
        """Cancel the task unless it has started; True when it will never run."""
        with self._cond:
            if self._state is _State.CANCELLED:
                return True
            if self._state not in (_State.NEW, _State.QUEUED):
                return False
            self._state = _State.CANCELLED
            unqueue, self._unqueue = self._unqueue, None
            self._notify_locked()
        if unqueue is not None:
            unqueue(self)  # frees its queue place at once
        return True

    def abandon(self) -> None:
        """The owner no longer wants the result: cancel it if it has not started, otherwise hand its
        result to ``on_abandon`` once it is there (at most once)."""
        if self.cancel():
            return
        with self._cond:
            if self._abandoned:
                return
            self._abandoned = True
            finished = self._state is _State.DONE
        if finished:
            self._discard()

    # -- results ------------------------------------------------------------------------------------
    def result(self, timeout: float | None = None) -> T:
        """The return value of ``fn``; re-raises its exception; TaskCancelled if it never ran;
        TimeoutError if it has not finished within ``timeout`` seconds."""
        self._wait(timeout)
        if self._state is _State.CANCELLED:
            raise TaskCancelled("the task was cancelled before it started")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        if self._state is _State.CANCELLED:
            raise TaskCancelled("the task was cancelled before it started")
        return self._error

    def _wait(self, timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._state in (_State.DONE, _State.CANCELLED), timeout):
                raise TimeoutError(f"the task did not finish within {timeout} s")

    async def wait(self) -> T:
        """Await the result from asyncio without blocking the event loop. Cancelling the awaiting
        coroutine abandons the task (see ``abandon``)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self._state in (_State.DONE, _State.CANCELLED):
                fut.set_result(None)
            else:
                self._waiters.append((loop, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abandon()
            raise
        return self.result(timeout=0)

    # -- pool side ----------------------------------------------------------------------------------
    def _enqueue(self, unqueue: Callable[[Task], None]) -> None:
        """Called by the pool under its lock when it accepts the task."""
        with self._cond:
            if self._state is not _State.NEW:
                raise RuntimeError(f"a task can be submitted once, this one is {self._state.value}")
            self._state = _State.QUEUED
            self._unqueue = unqueue

    def _check_new(self) -> None:
        with self._cond:
            if self._state is not _State.NEW:
                raise RuntimeError(f"a task can be submitted once, this one is {self._state.value}")

    def _run(self) -> None:
        """Run ``fn`` in the calling (pool) thread unless the task was cancelled meanwhile."""
        with self._cond:
            if self._state is not _State.QUEUED:
                return
            self._state = _State.RUNNING
            self._unqueue = None
        result: T | None = None
        error: BaseException | None = None
        try:
            result = self._fn()
        except BaseException as exc:  # the task's channel carries it; the worker thread lives on
            error = exc
        with self._cond:
            self._result, self._error = result, error
            self._state = _State.DONE
            abandoned = self._abandoned
            self._notify_locked()
        if abandoned:
            self._discard()

    def _discard(self) -> None:
        if self._on_abandon is None or self._error is not None:
            return
        try:
            self._on_abandon(self._result)  # type: ignore[arg-type]
        except Exception:  # a cleanup failure must not kill a pool thread or the abandoning caller
            log.exception("on_abandon of an abandoned task failed")

    def _notify_locked(self) -> None:
        self._cond.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that event loop is closed: nobody waits there any more
                pass


class TaskPool:
    """``threads`` worker threads taking tasks from a queue of at most ``max_queued``: FIFO, except that the
    owners running fewest tasks go first; ``max_per_owner`` (None: no cap) bounds each owner's places, and
    ``max_running_per_owner`` (None: no cap) how many of an owner's tasks run at once (its others wait
    queued even while a thread is free, which keeps that thread for another owner's next task)."""

    def __init__(self, name: str, *, threads: int, max_queued: int, max_per_owner: int | None = None,
                 max_running_per_owner: int | None = None) -> None:
        if threads < 1:
            raise ValueError(f"a TaskPool needs at least one thread, got {threads}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        if max_per_owner is not None and max_per_owner < 1:
            raise ValueError(f"max_per_owner must be >= 1 (or None), got {max_per_owner}")
        if max_running_per_owner is not None and max_running_per_owner < 1:
            raise ValueError(f"max_running_per_owner must be >= 1 (or None), got {max_running_per_owner}")
        self.name = name
        self.threads = threads
        self.max_queued = max_queued
        self.max_per_owner = max_per_owner
        self.max_running_per_owner = max_running_per_owner
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a task was queued, or the pool closed
        self._room = threading.Condition(self._lock)  # a queue place was freed, or the pool closed
        self._queue: collections.deque[Task] = collections.deque()
        self._running = 0
        self._held: collections.Counter[Hashable] = collections.Counter()  # queued + running, by owner
        self._running_by: collections.Counter[Hashable] = collections.Counter()
        self._closed = False
        self._workers = [threading.Thread(target=self._worker, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    @property
    def queued(self) -> int:
        """Tasks accepted and waiting for a thread."""
        with self._lock:
            return len(self._queue)

    @property
    def running(self) -> int:
        """Tasks a thread is running now."""
        with self._lock:
            return self._running

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def held(self, owner: Hashable) -> int:
        """Places ``owner`` holds now: its tasks queued and running."""
        with self._lock:
            return self._held[owner]

    def try_submit(self, task: Task, *, owner: Hashable = None) -> bool:
        """Queue ``task`` if there is room; False (the task stays unsubmitted) when the queue is full.
        Raises OwnerAtLimit when ``owner`` holds ``max_per_owner`` places, PoolClosed after ``shutdown``
        has begun (the task stays unsubmitted in both cases)."""
        task._check_new()
        with self._lock:
            if self._closed:
                raise PoolClosed(f"task pool {self.name} is shut down")
            if self._owner_full_locked(owner):
                raise OwnerAtLimit(f"task pool {self.name}: this owner holds {self.max_per_owner} places")
            if len(self._queue) >= self.max_queued and not self._idle_thread_locked():
                return False
            self._accept_locked(task, owner)
            return True

    def submit(self, task: Task, *, owner: Hashable = None, cancelled: Callable[[], bool] | None = None,
               timeout: float | None = None, check_interval_s: float = 0.05) -> bool:
        """Queue ``task``, waiting for room (and for ``owner`` to be under its cap). Returns False (the task
        stays unsubmitted) when ``cancelled()`` turns true or ``timeout`` seconds pass first; raises PoolClosed
        once ``shutdown`` has begun."""
        task._check_new()
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._closed:
                    raise PoolClosed(f"task pool {self.name} is shut down")
                if not self._owner_full_locked(owner) and (len(self._queue) < self.max_queued
                                                           or self._idle_thread_locked()):
                    self._accept_locked(task, owner)
                    return True
                if cancelled is not None and cancelled():
                    return False
                wait = check_interval_s if cancelled is not None else None
                if end is not None:
                    left = end - time.monotonic()
                    if left <= 0:
                        return False
                    wait = left if wait is None else min(wait, left)
                self._room.wait(wait)

    def shutdown(self, *, timeout: float | None = None) -> None:
        """Refuse new tasks, run every accepted one, and join the threads (all of them within ``timeout``;
        a thread still busy then runs on as a daemon)."""
        with self._lock:
            self._closed = True
            self._work.notify_all()
            self._room.notify_all()
        me = threading.current_thread()
        end = None if timeout is None else time.monotonic() + timeout
        for w in self._workers:
            if w is not me:
                w.join(None if end is None else max(0.0, end - time.monotonic()))

    def __enter__(self) -> TaskPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ----------------------------------------------------------------------------------
    def _idle_thread_locked(self) -> bool:
        """A thread is free to take a task at once (so a zero-length queue still accepts work)."""
        return self._running + len(self._queue) < self.threads

    def _owner_full_locked(self, owner: Hashable) -> bool:
        return self.max_per_owner is not None and self._held[owner] >= self.max_per_owner

    def _accept_locked(self, task: Task, owner: Hashable) -> None:
        task._enqueue(self._unqueue)
        task._owner = owner
        self._held[owner] += 1
        self._queue.append(task)
        self._work.notify()

    def _release_locked(self, owner: Hashable) -> None:
        self._held[owner] -= 1
        if not self._held[owner]:
            del self._held[owner]

    def _unqueue(self, task: Task) -> None:
        with self._lock:
            try:
                self._queue.remove(task)
            except ValueError:  # a worker took it already; it will see the cancellation and skip it
                return
            self._release_locked(task._owner)
            self._room.notify_all()

    def _may_run_locked(self, task: Task) -> bool:
        """Whether the task's owner is under its running cap (tasks without an owner are never held back)."""
        cap = self.max_running_per_owner
        return cap is None or task._owner is None or self._running_by[task._owner] < cap

    def _next_locked(self) -> Task | None:
        """The oldest queued task among the owners running fewest tasks (plain FIFO with one owner), leaving
        out owners at their running cap; None when every queued task's owner is at it."""
        runnable = [t for t in self._queue if self._may_run_locked(t)]
        if not runnable:
            return None
        fewest = min(self._running_by[t._owner] for t in runnable)
        for task in runnable:
            if self._running_by[task._owner] == fewest:
                self._queue.remove(task)
                return task
        raise AssertionError("unreachable: some runnable task has the fewest running")

    def _worker(self) -> None:
        while True:
            with self._lock:
                task = None
                while self._queue or not self._closed:
                    task = self._next_locked() if self._queue else None
                    if task is not None:
                        break
                    self._work.wait()  # a task queued, a capped owner's task finished, or the pool closed
                if task is None:  # closed and drained
                    return
                self._running += 1
                self._running_by[task._owner] += 1
                self._room.notify_all()
            try:
                task._run()
            finally:
                with self._lock:
                    self._running -= 1
                    self._running_by[task._owner] -= 1
                    if not self._running_by[task._owner]:
                        del self._running_by[task._owner]
                    self._release_locked(task._owner)
                    self._room.notify_all()
                    if self.max_running_per_owner is not None:
                        self._work.notify_all()  # the owner's next task may run now
            del task  # an idle worker must not keep the last task's input and result alive
