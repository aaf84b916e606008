"""CpuExecutor: a fixed team of pinned CPU worker threads that runs synchronous collectives.

The routed MoE experts that live in host memory run on it. ``run(fn)`` publishes one piece of work to the
whole team: every worker calls ``fn(rank, size)`` once, and ``run`` returns when all of them have returned,
so everything they wrote is visible to the caller. The submitting thread does not compute. The team only
gives ranks and contiguous shares (``split``); the caller owns the data and any scratch, partitioned
before the collective. The team calls no CUDA and holds no model state or weights.

Python threads are enough because torch CPU ops release the GIL while they compute. Each worker limits
torch to one intra-op thread for itself (the setting is per thread), so an op inside a worker does not
fan out to OpenMP, and pins itself to its CPU with ``os.sched_setaffinity(0, ...)`` (on Linux that
affects the calling thread only).

Floating point: the workers compute with round-to-nearest-even, masked FP exceptions and gradual
underflow. Those are the defaults of CPython and torch threads, so nothing is set here (a thread inherits
the FP environment of the thread that creates it, so do not enable ``torch.set_flush_denormal`` before
building a team).

Wake-up: a worker that finished a collective polls briefly for the next one, then blocks on a condition.
Inside ``keep_active()`` it keeps polling (yielding the GIL on every poll) until the scope ends, which
saves the wake-up between back-to-back collectives such as the MoE layers of one decode step.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

MAX_DEFAULT_THREADS = 32
_SPIN_S = 100e-6  # a worker polls this long after a collective before it blocks


class _Work(NamedTuple):
    generation: int
    fn: Callable[[int, int], None] | None  # None between collectives, so the team keeps nothing alive


def _allowed_cpus() -> tuple[int, ...] | None:
    """The CPUs this process may run on, in order; None where the platform cannot pin threads."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    return tuple(sorted(os.sched_getaffinity(0)))


def _prepare_worker(cpu: int | None) -> None:
    """Run in the worker thread before it confirms its start."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)


def _cpu_ranges(cpus: Sequence[int]) -> str:
    """``0-3,8,10-11``: a CPU set short enough for an error message."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def default_threads() -> int:
    """The team size ``threads=None`` gives: the CPUs this process may use minus one for the control thread
    (at least 1, at most ``MAX_DEFAULT_THREADS``)."""
    allowed = _allowed_cpus()
    usable = (os.cpu_count() or 1) if allowed is None else len(allowed)
    return min(MAX_DEFAULT_THREADS, max(1, usable - 1))


def _resolve_cpus(threads: int | None, cpus: Sequence[int] | None) -> tuple[int | None, ...]:
    """The CPU of each worker (None: unpinned); its length is the team size. See ``CpuExecutor``."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
    allowed = _allowed_cpus()
    if cpus is not None:
        chosen = tuple(cpus)
        if not chosen:
            raise ValueError("cpus is empty: name one CPU per worker, or pass None for the default")
        for c in chosen:
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise ValueError(f"cpus must be OS CPU ids (non-negative integers), got {c!r}")
        if threads is not None and threads != len(chosen):
            raise ValueError(f"threads={threads} but cpus names {len(chosen)} CPUs (one per worker)")
        if allowed is None:
            raise ValueError("cpus was given but this platform cannot pin threads (no os.sched_setaffinity); "
                             "pass cpus=None")
        outside = sorted(set(chosen) - set(allowed))
        if outside:
            raise ValueError(f"cpus {_cpu_ranges(outside)} are not among the CPUs this process may use "
                             f"({_cpu_ranges(allowed)})")
        return chosen
    count = threads if threads is not None else default_threads()
    if allowed is None:
        return (None,) * count
    pool = allowed[1:] if len(allowed) > 1 else allowed  # the first allowed CPU stays with the control thread
    return tuple(pool[i % len(pool)] for i in range(count))


@contextlib.contextmanager
def single_threaded_caller() -> Iterator[None]:
    """The calling thread's torch CPU ops use one intra-op thread inside the block (restored after).

    For the thread that feeds a team: an op it runs with several intra-op threads starts an OpenMP team whose
    threads keep spinning for a while after the op, on the same cores as the pinned workers, which then compute
    several times slower (measured: docs/moe.md). The caller's own ops around a collective are small."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class CpuExecutor:
    """A fixed team of ``size`` worker threads, worker ``rank`` pinned to ``cpus[rank]``.

    ``threads``: the team size; None means the process's allowed CPUs minus one for the control thread
    (at least 1, at most 32). ``cpus``: the OS CPU of each worker, in rank order (repeats allowed); None
    means the allowed CPUs after the first one (all of them when there is only one), reused in order
    when ``threads`` asks for more workers than that. Where the platform cannot pin threads the workers
    run unpinned (``cpus`` reports None) and an explicit ``cpus`` is refused.

    The constructor returns once every worker has started, pinned itself and limited torch to one
    thread; if any worker fails to start, the others are stopped and joined and the error is raised.
    """

    def __init__(self, threads: int | None = None, *, cpus: Sequence[int] | None = None,
                 name: str = "ninfer-cpu") -> None:
        self.name = name
        self.cpus: tuple[int | None, ...] = _resolve_cpus(threads, cpus)
        self.size: int = len(self.cpus)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # work published, keep_active entered, or closing
        self._done = threading.Condition(self._lock)  # a worker reported its start, or a collective completed
        self._work = _Work(0, None)
        self._remaining = 0  # workers of the current collective that have not returned yet
        self._errors: list[BaseException | None] = []
        self._busy = False  # a collective is in progress (from publication until its caller collected it)
        self._active = False  # inside keep_active()
        self._closed = False
        self._reported = 0
        self._start_errors: dict[int, BaseException] = {}
        self._workers: list[threading.Thread] = []
        try:
            self._start_workers()
        except BaseException:
            self.close()
            raise

    # -- collectives --------------------------------------------------------------------------------
    def run(self, fn: Callable[[int, int], None]) -> None:
        """Every worker calls ``fn(rank, size)`` once; returns when all have returned.

        If workers raise, this still waits for all of them, then re-raises the exception of the lowest
        failing rank (the same object: its traceback keeps the worker's frames, and a note names the
        rank). The team stays usable. A nested call (from inside ``fn``) or a call while another thread's
        collective is in progress raises RuntimeError, as does a call after ``close()``.
        """
        with self._lock:
            self._check_can_run_locked()
            self._busy = True
            self._remaining = self.size
            self._errors = [None] * self.size
            self._work = _Work(self._work.generation + 1, fn)
            self._wake.notify_all()
        try:
            while self._active and self._remaining:  # back-to-back collectives: skip the wake-up
                time.sleep(0)
        finally:
            errors = self._collect()
        failed = [(rank, exc) for rank, exc in enumerate(errors) if exc is not None]
        if failed:
            rank, exc = failed[0]
            others = f"; {len(failed) - 1} other rank(s) failed too" if len(failed) > 1 else ""
            exc.add_note(f"raised by rank {rank} of {self.size} in CpuExecutor {self.name!r}{others}")
            raise exc

    @staticmethod
    def split(n: int, rank: int, size: int) -> range:
        """The contiguous share of ``range(n)`` for ``rank``: shares differ by at most one element, the
        larger ones first, and follow each other in rank order."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        base, extra = divmod(n, size)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (1 if rank < extra else 0))

    @contextlib.contextmanager
    def keep_active(self) -> Iterator[None]:
        """An exclusive scope in which idle workers keep polling for the next collective instead of
        sleeping. It submits no work and does not change ``run``; hold it only while collectives come
        back to back (not while a request is idle). Entering it twice is an error."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"CpuExecutor {self.name!r} is closed")
            if self._active:
                raise RuntimeError(f"keep_active() of CpuExecutor {self.name!r} is already held "
                                   "(the scope is exclusive and cannot be nested)")
            self._active = True
            self._wake.notify_all()  # sleeping workers start polling now, for the first collective too
        try:
            yield
        finally:
            with self._lock:
                self._active = False

    # -- lifetime -----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def close(self) -> None:
        """Stop and join every worker (a collective in progress completes first). Idempotent."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        me = threading.current_thread()
        for w in self._workers:
            if w is not me:
                w.join()

    def __enter__(self) -> CpuExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        for rank, cpu in enumerate(self.cpus):
            t = threading.Thread(target=self._worker, args=(rank, cpu), name=f"{self.name}-{rank}",
                                 daemon=True)
            t.start()
            self._workers.append(t)
        with self._lock:
            while self._reported < self.size:
                self._done.wait()
            failures = sorted(self._start_errors.items())
            self._start_errors = {}
        if failures:
            rank, exc = failures[0]
            where = "unpinned" if self.cpus[rank] is None else f"pinned to CPU {self.cpus[rank]}"
            raise RuntimeError(f"CpuExecutor {self.name!r}: worker {rank} ({where}) could not start: "
                               f"{exc}") from exc

    def _check_can_run_locked(self) -> None:
        if self._closed:
            raise RuntimeError(f"CpuExecutor {self.name!r} is closed")
        if not self._busy:
            return
        if threading.current_thread() in self._workers:
            raise RuntimeError(f"nested collective: fn called run() on its own CpuExecutor {self.name!r}; "
                               "a collective cannot wait for itself")
        raise RuntimeError(f"CpuExecutor {self.name!r} is running another collective; a team runs one "
                           "collective at a time (give each caller its own team)")

    def _collect(self) -> list[BaseException | None]:
        """Wait until every worker has returned, then end the collective; its per-rank errors."""
        with self._lock:
            while self._remaining:
                self._done.wait()
            errors, self._errors = self._errors, []
            self._work = _Work(self._work.generation, None)
            self._busy = False
            return errors

    def _worker(self, rank: int, cpu: int | None) -> None:
        try:
            _prepare_worker(cpu)
        except BaseException as exc:  # reported to the constructor, which stops the team and raises it
            with self._lock:
                self._start_errors[rank] = exc
                self._reported += 1
                self._done.notify_all()
            return
        with self._lock:
            self._reported += 1
            self._done.notify_all()
        seen = 0
        while (work := self._next_work(seen)) is not None:
            seen = work.generation
            error: BaseException | None = None
            try:
                work.fn(rank, self.size)  # type: ignore[misc]
            except BaseException as exc:  # the caller re-raises it; the worker lives on
                error = exc
            work = None  # drop the collective's closure before waiting for the next one
            with self._lock:
                self._errors[rank] = error
                self._remaining -= 1
                if not self._remaining:
                    self._done.notify_all()
            error = None

    def _next_work(self, seen: int) -> _Work | None:
        """The next collective after generation ``seen``; None once the team is closing."""
        deadline = time.perf_counter() + _SPIN_S
        while True:
            work = self._work
            if work.generation != seen:
                return work
            if self._closed:
                return None
            if self._active or time.perf_counter() < deadline:
                time.sleep(0)  # poll, yielding the GIL to whoever computes
                continue
            with self._lock:
                while self._work.generation == seen and not self._closed and not self._active:
                    self._wake.wait()
