"""Ingress: the only part of the engine that other threads touch.

Submitters, consumers (handles), the gateway and ``close`` reach the worker through it: new records
go to the inbox, a cancellation or a call wakes the worker, and the outstanding places are counted
here. Everything is guarded by one Condition; the worker takes what arrived at the top of each cycle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ninfer.engine.errors import EngineClosed, EngineFailed, InvariantBroken, Overloaded
from ninfer.engine.metrics import MetricsRecorder
from ninfer.engine.request import RequestRecord


class Ingress:
    def __init__(self, *, outstanding_limit: int, metrics: MetricsRecorder) -> None:
        self.metrics = metrics
        self.cond = threading.Condition()
        self.inbox: list[RequestRecord] = []
        self.outstanding = 0
        self.outstanding_limit = outstanding_limit
        self.next_ticket = 0
        self.failed: BaseException | None = None
        self.closing = False
        self.drain = False
        self.wake = False
        self.stopped = False  # the worker has ended: nothing else touches the Program
        self.calls: list[tuple[Callable[[], Any], list, threading.Event]] = []
        self.worker: threading.Thread | None = None

    # -- any thread ----------------------------------------------------------------------------------
    def check_open(self) -> None:
        with self.cond:
            self._check_open()

    def _check_open(self) -> None:
        if self.failed is not None:
            raise EngineFailed(f"engine failed: {self.failed}") from self.failed
        if self.closing:
            raise EngineClosed("engine is closed")

    def enqueue(self, make_record: Callable[[int], RequestRecord]) -> RequestRecord:
        """Take an outstanding place, assign the ticket (submission order) and hand the record to the worker."""
        with self.cond:
            self._check_open()
            if self.outstanding >= self.outstanding_limit:
                self.metrics.rejected_request(Overloaded.kind)
                raise Overloaded(f"engine overloaded: {self.outstanding} outstanding requests "
                                 f"(limit {self.outstanding_limit}); retry later")
            rec = make_record(self.next_ticket)
            self.next_ticket += 1
            self.outstanding += 1
            self.inbox.append(rec)
            self.wake = True
            self.cond.notify_all()
        return rec

    def notify(self) -> None:
        with self.cond:
            self.wake = True
            self.cond.notify_all()

    def release_outstanding(self) -> None:
        """Called exactly once per request, after both response_done and consumer_released."""
        with self.cond:
            if self.outstanding <= 0:
                raise InvariantBroken("outstanding capacity released twice")
            self.outstanding -= 1
            self.cond.notify_all()

    def request_close(self, *, drain: bool) -> None:
        with self.cond:
            self.closing = True
            self.drain = drain
            self.wake = True
            self.cond.notify_all()

    def on_worker(self, fn: Callable[[], Any], timeout: float | None = 30.0) -> Any:
        """Run ``fn()`` on the worker between cycles (the Program is worker-only) and return its result."""
        with self.cond:
            alive = not self.stopped and threading.current_thread() is not self.worker
            if alive:
                box: list = []
                done = threading.Event()
                self.calls.append((fn, box, done))
                self.wake = True
                self.cond.notify_all()
        if not alive:  # the worker has stopped (or this is the worker): nothing else touches the Program now
            return fn()
        if not done.wait(timeout):
            raise TimeoutError("engine worker did not answer")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def counts(self) -> tuple[int, int, bool]:
        """Inbox length, outstanding requests and whether the engine failed (for metrics)."""
        with self.cond:
            return len(self.inbox), self.outstanding, self.failed is not None

    # -- the worker ----------------------------------------------------------------------------------
    def take(self) -> tuple[list[RequestRecord], bool, bool]:
        """The records that arrived since the last cycle, and whether to close (and drain)."""
        with self.cond:
            new, self.inbox = self.inbox, []
            self.wake = False
            return new, self.closing, self.drain

    def serve_calls(self) -> None:
        with self.cond:
            calls, self.calls = self.calls, []
        for fn, box, done in calls:
            try:
                box.append(fn())
            except BaseException as exc:
                box.append(exc)
            done.set()

    def pending(self) -> bool:
        """Whether something waits for the worker's attention (an arrival, a call, closing).

        Read without the lock: a hint for pipelining, which the next cycle checks again."""
        return bool(self.inbox or self.closing or self.calls)

    def idle_wait(self, timeout: float | None) -> None:
        with self.cond:
            if not self.wake:
                self.cond.wait(timeout)

    def fail(self, exc: BaseException) -> list[RequestRecord]:
        """Refuse new work from now on; returns the records that never reached the worker."""
        with self.cond:
            self.failed = exc
            new, self.inbox = self.inbox, []
        return new

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
        self.serve_calls()
