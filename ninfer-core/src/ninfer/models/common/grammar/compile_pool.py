"""CompilePool: the compile worker processes, and the engine-side compile of a vetted grammar.

Each of up to ``compile_workers`` slots (``compile_slot``) is a driver thread (at a low priority) and the
worker process it started (``compile_worker``), made when a job first finds no free slot. A driver sends one
job, then waits for its verdict while checking the job's deadline (``compile_timeout_s``), whether anyone still
waits for it, and whether the pool closed; in each of those cases the job's process is killed (SIGKILL: its
memory returns at once). A job that passed its worker's checks is then compiled by the driver in the engine's
process, where its matchers run: the worker has measured what that costs, and the compile releases the GIL.
(Carrying the worker's compiled grammar over instead costs more: xgrammar serializes it as JSON, many times its
size, more slowly than it compiles.)

A pool is shared by every GrammarBook of the process with the same worker settings (``compile_workers``,
``compile_memory_bytes``), whatever its vocabulary: a worker is given each vocabulary once, before its first
job over it (an engine has one; a test run has several, and a worker's imports take seconds). Pools start
lazily and close LINGER_S after their last book closes (a restarted engine, the next test module, reuses
them), or at exit.
"""

from __future__ import annotations

import atexit
import hashlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ninfer.contract.constraint import (
    ConstraintBusy,
    ConstraintCancelled,
    ConstraintClosed,
    ConstraintLimits,
)
from ninfer.models.common.grammar.compile_job import CompileJob
from ninfer.models.common.grammar.compile_slot import START_TIMEOUT_S, CompileSlot

LINGER_S = 300.0  # an unused pool's workers stay this long for the next book (a test module, a restarted engine)


class CompilePool:
    def __init__(self, limits: ConstraintLimits) -> None:
        self._setup = {"compile_memory_bytes": limits.compile_memory_bytes}
        self._vocabularies: dict[str, tuple[list[bytes], int, tuple[int, ...]]] = {}
        self._infos: dict[str, Any] = {}  # this process's TokenizerInfo per vocabulary
        self.workers = limits.compile_workers
        self._cond = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._slots: list[CompileSlot] = []
        self._busy = 0  # slots serving a job
        self.closed = False
        self.users = 0
        self.submitted = 0  # jobs accepted (identical constraints in flight share one)
        self._linger: threading.Timer | None = None

    # -- jobs ------------------------------------------------------------------------------------------
    def add_vocabulary(self, vocabulary: Sequence[bytes], *, vocab_size: int, stop_token_ids: Sequence[int]) -> str:
        """The key jobs over this vocabulary carry (a worker is given the vocabulary before its first such job)."""
        key = f"{vocabulary_fingerprint(vocabulary)}:{vocab_size}:{','.join(map(str, stop_token_ids))}"
        with self._cond:
            self._vocabularies.setdefault(key, (list(vocabulary), vocab_size, tuple(stop_token_ids)))
        return key

    def submit(self, job: CompileJob) -> None:
        """Queue ``job`` for the next free slot (starting one if there is room); ConstraintBusy when full."""
        with self._cond:
            if self.closed:
                raise ConstraintClosed("the grammar compilers are closed")
            if len(self._queue) >= self.workers - self._busy + job.limits.compile_queue:  # each book's own bound on the shared queue
                raise ConstraintBusy(f"all {self.workers} grammar compile workers are busy and "
                                     f"{len(self._queue)} constraints wait for them (ConstraintLimits."
                                     f"compile_workers / compile_queue); retry later")
            self._queue.append(job)
            self.submitted += 1
            if len(self._queue) > len(self._slots) - self._busy and len(self._slots) < self.workers:
                slot = CompileSlot(self, len(self._slots))
                self._slots.append(slot)
                slot.thread.start()
            self._cond.notify()

    def abandon(self, job: CompileJob, error: BaseException) -> None:
        """Nobody waits for ``job``: unqueue it, or have its driver kill its worker (a compile in this process,
        once started, finishes and is cached)."""
        with self._cond:
            job.abandoned = True
            queued = job in self._queue
            if queued:
                self._queue.remove(job)
        if queued:
            job.finish(error=error)

    def expire(self, job: CompileJob) -> None:
        """A job still queued after its compile deadline, behind busy workers (not one still starting), is
        refused as busy (the waiter's poll calls this)."""
        with self._cond:
            stale = not job.started and time.monotonic() - job.queued_at > job.limits.compile_timeout_s \
                and not any(slot.starting for slot in self._slots)
            if stale and job in self._queue:
                self._queue.remove(job)
            else:
                stale = False
        if stale:
            job.finish(error=ConstraintBusy(f"the grammar compile workers were busy for "
                                            f"{job.limits.compile_timeout_s:g} s (ConstraintLimits."
                                            f"compile_timeout_s); retry later"))

    def warm(self, vocabulary: str) -> None:
        """Start one worker now and wait until it is ready (serve's warmup), and the engine-side tokenizer info."""
        self.tokenizer_info(vocabulary)
        with self._cond:
            if self.closed:
                return
            if not self._slots:
                slot = CompileSlot(self, 0)
                self._slots.append(slot)
                slot.thread.start()
            slot = self._slots[0]
        slot.ready.wait(START_TIMEOUT_S)

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [s.proc.pid for s in list(self._slots) if s.proc is not None and s.proc.poll() is None]

    def tokenizer_info(self, vocabulary: str) -> Any:
        with self._cond:
            if vocabulary not in self._infos:
                import xgrammar as xgr

                tokens, vocab_size, stops = self._vocabularies[vocabulary]
                self._infos[vocabulary] = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab_size,
                                                            stop_token_ids=list(stops))
            return self._infos[vocabulary]

    def vocabulary(self, key: str) -> tuple[list[bytes], int, tuple[int, ...]]:
        with self._cond:
            return self._vocabularies[key]

    def close(self) -> None:
        """Kill every worker; queued jobs end as closed."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            queued, self._queue = list(self._queue), deque()
            self._cond.notify_all()
            slots = list(self._slots)
        for job in queued:
            job.finish(error=ConstraintClosed("the grammar compilers closed"))
        for slot in slots:
            slot.terminate()  # its driver sees the worker gone, reaps it and ends

    # -- a slot's driver -------------------------------------------------------------------------------
    def _next(self, slot: CompileSlot) -> CompileJob | None:
        """The next job for ``slot`` (None once closed); ``_served`` follows it."""
        with self._cond:
            while not self._queue and not self.closed:
                self._cond.wait()
            if self.closed:
                return None
            job = self._queue.popleft()
            job.started = True
            self._busy += 1
            return job

    def _served(self) -> None:
        with self._cond:
            self._busy -= 1

    def _interrupted(self, job: CompileJob) -> BaseException | None:
        if self.closed:
            return ConstraintClosed("the grammar compilers closed")
        if job.abandoned:
            return ConstraintCancelled("nobody waits for this compile any more")
        return None


# -- the process's pools -------------------------------------------------------------------------------
_pools: dict[tuple, CompilePool] = {}
_pools_lock = threading.Lock()


def vocabulary_fingerprint(vocabulary: Sequence[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for token in vocabulary:
        h.update(len(token).to_bytes(4, "little"))
        h.update(token)
    return h.hexdigest()


def shared_pool(limits: ConstraintLimits) -> CompilePool:
    """The process's pool for these worker settings (made on first use); ``release`` it after."""
    key = (limits.compile_workers, limits.compile_memory_bytes)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.closed:
            pool = _pools[key] = CompilePool(limits)
        pool.users += 1
        if pool._linger is not None:
            pool._linger.cancel()
            pool._linger = None
        return pool


def release(pool: CompilePool) -> None:
    """One user fewer; an unused pool closes after LINGER_S unless a book takes it again."""
    with _pools_lock:
        pool.users -= 1
        if pool.users > 0 or pool.closed:
            return
        pool._linger = threading.Timer(LINGER_S, _close_if_unused, args=(pool,))
        pool._linger.daemon = True
        pool._linger.start()


def _close_if_unused(pool: CompilePool) -> None:
    with _pools_lock:
        if pool.users > 0:
            return
        for key, p in list(_pools.items()):
            if p is pool:
                del _pools[key]
    pool.close()


@atexit.register
def close_all() -> None:
    """Kill every worker of the process (at exit; tests may call it)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()
