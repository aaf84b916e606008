"""CompilePool: the compile worker processes of one vocabulary, and the engine-side compile of a vetted grammar.

Each of up to ``compile_workers`` slots is a driver thread (at a low priority) and the worker process it
started (``compile_worker``), started when a job first finds no idle slot. A driver sends one job, then waits
for its verdict while checking the job's deadline (``compile_timeout_s``), whether anyone still waits for it,
and whether the pool closed; in each of those cases it kills the worker (SIGKILL: its memory returns at once)
and the slot starts a fresh one for its next job. A job that passed its worker's checks is then compiled by
the driver in the engine's process, where its matchers run: the worker has measured what that costs, and the
compile releases the GIL. (Carrying the worker's compiled grammar over instead costs more: xgrammar serializes
it as JSON, many times its size, more slowly than it compiles.)

Pools are shared by every GrammarBook of the same vocabulary and worker settings in the process (the engine
has one; a test run has many), started lazily, and closed a little after their last book is, or at exit.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ninfer.contract.constraint import (
    ConstraintBusy,
    ConstraintCancelled,
    ConstraintClosed,
    ConstraintError,
    ConstraintLimitExceeded,
    ConstraintLimits,
)
from ninfer.models.common.grammar import frames
from ninfer.models.common.grammar.build import build_grammar, kind_of, reason

WORKER_MODULE = "ninfer.models.common.grammar.compile_worker"
DRIVER_NICE = 10  # the engine-side compile yields the CPU to the engine's worker and HTTP threads
POLL_S = 0.05  # how often a driver or a waiter looks at deadlines, cancellation and closing
CANCEL_WAIT_S = 5.0  # a worker answers a cancel within milliseconds; one that does not is killed
START_TIMEOUT_S = 300.0  # a worker's imports and tokenizer info (seconds on an idle machine)
LINGER_S = 30.0  # an unused pool's workers stay this long for the next book (a test module, a restarted engine)
_DOING = {"build": "building", "compile": "compiling", "probe": "probing the matcher of"}
log = logging.getLogger(__name__)


@attrs.frozen(eq=False)
class Compiled:
    """A compiled constraint: xgrammar's CompiledGrammar and what its worker measured."""

    grammar: Any
    compiled_bytes: int
    rules: int
    probe_growth_bytes: int
    probe_step_s: float


class CompileJob:
    """One distinct constraint in flight. ``on_done`` runs once, in the thread that finishes it."""

    def __init__(self, payload: dict[str, Any], on_done: Callable[[CompileJob], None]) -> None:
        self.payload = payload
        self.limits: ConstraintLimits = payload["limits"]
        self.what = kind_of(payload["constraint"])
        self.done = threading.Event()
        self.result: Compiled | None = None
        self.error: BaseException | None = None
        self.abandoned = False  # nobody waits for it any more (set under the pool's lock)
        self.queued_at = time.monotonic()
        self.started = False
        self.worker_pid: int | None = None  # the process compiling it (a child of a worker)
        self._on_done = on_done
        self._lock = threading.Lock()

    def finish(self, result: Compiled | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self.done.is_set():
                return
            self.result, self.error = result, error
            self.done.set()
        self._on_done(self)


class CompilePool:
    def __init__(self, vocabulary: Sequence[bytes], *, vocab_size: int, stop_token_ids: Sequence[int],
                 limits: ConstraintLimits) -> None:
        self._vocabulary = vocabulary
        self._setup = {"vocabulary": list(vocabulary), "vocab_size": vocab_size,
                       "stop_token_ids": tuple(stop_token_ids), "compile_memory_bytes": limits.compile_memory_bytes}
        self.workers = limits.compile_workers
        self._cond = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._slots: list[_Slot] = []
        self._busy = 0  # slots serving a job
        self.closed = False
        self._info: Any = None
        self.users = 0
        self.submitted = 0  # jobs accepted (identical constraints in flight share one)
        self._linger: threading.Timer | None = None

    # -- jobs ------------------------------------------------------------------------------------------
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
                slot = _Slot(self, len(self._slots))
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

    def warm(self) -> None:
        """Start one worker now and wait until it is ready (serve's warmup), and the engine-side tokenizer info."""
        self.tokenizer_info()
        with self._cond:
            if self.closed:
                return
            if not self._slots:
                slot = _Slot(self, 0)
                self._slots.append(slot)
                slot.thread.start()
            slot = self._slots[0]
        slot.ready.wait(START_TIMEOUT_S)

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [s.proc.pid for s in list(self._slots) if s.proc is not None and s.proc.poll() is None]

    def tokenizer_info(self) -> Any:
        with self._cond:
            if self._info is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo(list(self._vocabulary), xgr.VocabType.RAW,
                                               vocab_size=self._setup["vocab_size"],
                                               stop_token_ids=list(self._setup["stop_token_ids"]))
            return self._info

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
    def _next(self, slot: _Slot) -> CompileJob | None:
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


class _Slot:
    """One driver thread and its worker process."""

    def __init__(self, pool: CompilePool, index: int) -> None:
        self.pool = pool
        self.proc: subprocess.Popen | None = None
        self.reader: frames.FrameReader | None = None
        self.ready = threading.Event()
        self.starting = False  # a worker process is being started (its imports take seconds)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._drive, name=f"ninfer-grammar-{index}", daemon=True)

    def _drive(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DRIVER_NICE)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        try:
            while True:
                try:
                    self._start()  # ahead of the job: at the slot's start, and after a worker was killed
                except BaseException:  # noqa: BLE001 - retried for the job, which then carries the error
                    if not self.pool.closed:
                        log.exception("a grammar compile worker did not start")
                finally:
                    self.ready.set()  # warmup waits for the first attempt
                if (job := self.pool._next(self)) is None:
                    break
                try:
                    self._serve(job)
                except BaseException as exc:  # noqa: BLE001 - the job carries it; the slot starts afresh
                    if self.pool._interrupted(job) is None:
                        log.exception("grammar compile slot failed")
                    self.kill()
                    job.finish(error=self.pool._interrupted(job) or ConstraintBusy(
                        f"the grammar compile worker failed ({type(exc).__name__}: {exc}); retry later"))
                finally:
                    self.pool._served()
        finally:
            self.kill()

    def _serve(self, job: CompileJob) -> None:
        pool = self.pool
        if (stop := pool._interrupted(job)) is not None:
            job.finish(error=stop)
            return
        self._start()
        try:
            frames.write_frame(self.proc.stdin, job.payload)
        except (BrokenPipeError, OSError, AttributeError):  # it died while idle (or the pool closed): once more
            self.kill()
            self._start()
            frames.write_frame(self.proc.stdin, job.payload)
        deadline = time.monotonic() + job.limits.compile_timeout_s
        phase = "build"
        while True:
            left = deadline - time.monotonic()
            if (stop := pool._interrupted(job)) is None and left <= 0:
                stop = ConstraintLimitExceeded("compile_timeout_s", f"{_DOING[phase]} {job.what} took more than "
                                                                    f"{job.limits.compile_timeout_s:g} s")
            if stop is not None:
                self._cancel()
                job.finish(error=stop)
                return
            try:
                message = self.reader.poll(min(POLL_S, left))
            except (frames.WorkerGone, OSError, ValueError):
                status = self.kill()
                job.finish(error=pool._interrupted(job) or ConstraintError(
                    f"the grammar compile worker ended (exit status {status}) {_DOING[phase]} {job.what}"))
                return
            if message is None:
                continue
            if message[0] == "phase":
                phase = message[1]
            elif message[0] == "started":
                job.worker_pid = message[1]
            elif message[0] == "died":
                job.finish(error=ConstraintError(f"the grammar compile job ended (exit status {message[1]}) "
                                                 f"{_DOING[phase]} {job.what}"))
                return
            elif message[0] == "verdict":
                break
        verdict = message[1]
        if verdict[0] == "refused":
            job.finish(error=ConstraintLimitExceeded(verdict[1], verdict[2]))
        elif verdict[0] == "invalid":
            job.finish(error=ConstraintError(verdict[1]))
        else:
            job.finish(result=self._compile_here(job, verdict[1]))

    def _cancel(self) -> None:
        """Have the worker kill the job's child; if it does not answer at once, kill the worker itself."""
        try:
            frames.write_frame(self.proc.stdin, ("cancel",))
            end = time.monotonic() + CANCEL_WAIT_S
            while time.monotonic() < end:
                message = self.reader.poll(POLL_S)
                if message is not None and message[0] in ("cancelled", "verdict", "died"):
                    return
        except (frames.WorkerGone, OSError, ValueError, AttributeError):
            pass
        self.kill()

    def _compile_here(self, job: CompileJob, stats: dict[str, Any]) -> Compiled:
        """The vetted grammar compiled in this process (on this low-priority thread; the GIL is released)."""
        import xgrammar as xgr

        if self._compiler is None:  # made on this thread, so any threads of its own share its priority
            self._compiler = xgr.GrammarCompiler(self.pool.tokenizer_info(), max_threads=1, cache_enabled=False)
        p = job.payload
        try:
            grammar = build_grammar(p["constraint"], reasoning_open=p["reasoning_open"], tools=p["tools"],
                                    tool_format=p["tool_format"])
            compiled = self._compiler.compile_grammar(grammar)
        except ConstraintError:
            raise
        except Exception as e:  # noqa: BLE001 - the worker compiled it; this should not happen
            raise ConstraintError(f"{job.what} does not compile: {reason(e)}") from e
        return Compiled(grammar=compiled, compiled_bytes=compiled.memory_size_bytes, rules=stats["rules"],
                        probe_growth_bytes=stats["probe_growth_bytes"], probe_step_s=stats["probe_step_s"])

    def _start(self) -> None:
        with self._lock:
            if self.pool.closed or (self.proc is not None and self.proc.poll() is None):
                return
        self.starting = True
        try:
            self._spawn()
        finally:
            self.starting = False

    def _spawn(self) -> None:
        env = dict(os.environ, MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True)
        reader = frames.FrameReader(proc.stdout.fileno())
        with self._lock:
            self.proc, self.reader = proc, reader
        try:
            frames.write_frame(proc.stdin, self.pool._setup)
            deadline = time.monotonic() + START_TIMEOUT_S
            while (message := reader.poll(POLL_S)) is None:
                if self.pool.closed or time.monotonic() > deadline:
                    raise ConstraintClosed("the grammar compilers closed") if self.pool.closed else \
                        TimeoutError(f"the grammar compile worker did not start within {START_TIMEOUT_S:g} s")
        except BaseException:
            self.kill()
            raise
        if message[0] != "ready":
            self.kill()
            raise RuntimeError(f"the grammar compile worker answered {message[0]!r} to its setup")

    def terminate(self) -> None:
        """SIGKILL the worker from any thread (the driver reaps it)."""
        with self._lock:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc)

    def kill(self) -> int | None:
        """Kill the worker (if any) and reap it, on the driver's thread; its exit status."""
        with self._lock:
            proc, self.proc, self.reader = self.proc, None, None
        if proc is None:
            return None
        if proc.poll() is None:
            _kill_group(proc)
        status = proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        return status


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a worker and its job's child (the worker leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


# -- the process's pools -------------------------------------------------------------------------------
_pools: dict[tuple, CompilePool] = {}
_pools_lock = threading.Lock()


def vocabulary_fingerprint(vocabulary: Sequence[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for token in vocabulary:
        h.update(len(token).to_bytes(4, "little"))
        h.update(token)
    return h.hexdigest()


def shared_pool(vocabulary: Sequence[bytes], *, vocab_size: int, stop_token_ids: Sequence[int],
                limits: ConstraintLimits) -> CompilePool:
    """The process's pool for this vocabulary and worker settings (made on first use); ``release`` it after."""
    key = (vocabulary_fingerprint(vocabulary), vocab_size, tuple(stop_token_ids), limits.compile_workers,
           limits.compile_memory_bytes)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.closed:
            pool = _pools[key] = CompilePool(vocabulary, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                             limits=limits)
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
