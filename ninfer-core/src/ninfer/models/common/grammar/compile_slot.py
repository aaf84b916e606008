"""CompileSlot: one of a CompilePool's driver threads (at a low priority) and the worker process it started.

The driver starts its worker ahead of work, gives it each vocabulary before the first job over it, sends one
job, then reads the worker's frames while checking the job's deadline, whether anyone still waits for it and
whether the pool closed; in each of those cases it has the worker kill the job's child (and kills the worker
itself if it does not answer). A job the worker passed is then compiled here, in the engine's process, on this
thread: xgrammar's compile releases the GIL, and its own threads, if any, inherit this thread's priority.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ninfer.contract.constraint import (
    ConstraintBusy,
    ConstraintClosed,
    ConstraintError,
    ConstraintLimitExceeded,
)
from ninfer.models.common.grammar import frames
from ninfer.models.common.grammar.build import build_grammar, reason
from ninfer.models.common.grammar.compile_job import POLL_S, Compiled, CompileJob

if TYPE_CHECKING:
    from ninfer.models.common.grammar.compile_pool import CompilePool

WORKER_MODULE = "ninfer.models.common.grammar.compile_worker"
DRIVER_NICE = 10  # the engine-side compile yields the CPU to the engine's worker and HTTP threads
CANCEL_WAIT_S = 5.0  # a worker answers a cancel within milliseconds; one that does not is killed
START_TIMEOUT_S = 300.0  # a worker's imports (seconds on an idle machine; minutes on a loaded one)
_DOING = {"build": "building", "compile": "compiling", "probe": "probing the matcher of"}
log = logging.getLogger(__name__)


class CompileSlot:
    """One driver thread and its worker process."""

    def __init__(self, pool: CompilePool, index: int) -> None:
        self.pool = pool
        self.proc: subprocess.Popen | None = None
        self.reader: frames.FrameReader | None = None
        self.ready = threading.Event()
        self.starting = False  # a worker process is being started (its imports take seconds)
        self._known: set[str] = set()  # vocabularies the current worker process was given
        self._compilers: dict[str, Any] = {}  # this thread's GrammarCompiler per vocabulary
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
            self._send(job)
        except (BrokenPipeError, OSError, AttributeError):  # it died while idle (or the pool closed): once more
            self.kill()
            self._start()
            self._send(job)
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

    def _send(self, job: CompileJob) -> None:
        key = job.payload["vocabulary"]
        if key not in self._known:
            frames.write_frame(self.proc.stdin, ("vocabulary", key, *self.pool.vocabulary(key)))
            self._known.add(key)
        frames.write_frame(self.proc.stdin, job.payload)

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

        p = job.payload
        compiler = self._compilers.get(p["vocabulary"])
        if compiler is None:  # made on this thread, so any threads of its own share its priority
            compiler = self._compilers[p["vocabulary"]] = xgr.GrammarCompiler(
                self.pool.tokenizer_info(p["vocabulary"]), max_threads=1, cache_enabled=False)
        try:
            grammar = build_grammar(p["constraint"], reasoning_open=p["reasoning_open"], tools=p["tools"],
                                    tool_format=p["tool_format"])
            compiled = compiler.compile_grammar(grammar)
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
            self._known = set()
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
