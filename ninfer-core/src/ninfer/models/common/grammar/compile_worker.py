"""A compile worker process: builds, compiles and probes grammars where a runaway one can be stopped.

Started by ``CompilePool`` as ``python -m ninfer.models.common.grammar.compile_worker``; frames
(``grammar.frames``) on stdin/stdout. The first frame is its settings; the worker imports xgrammar, lowers its
own priority (it never starves the engine) and answers ``("ready", info)``. A ``("vocabulary", key, tokens,
vocab_size, stop_token_ids)`` frame gives it one vocabulary, whose TokenizerInfo it builds and keeps (a
process's grammar books of every vocabulary share the workers). Each job frame (a constraint with its limits
and its vocabulary's key) is done in a child forked for it: the child limits
its address space to what it holds plus ``compile_memory_bytes``, reports its steps (``("phase", "compile" |
"probe")``, so the engine knows what a stopped job was doing) and then one verdict, and exits:

- ``("verdict", ("ok", stats))``: the grammar compiled and its probe passed (``stats``: rules, compiled bytes,
  the probe's growth and slowest step); the engine then compiles the same grammar itself, knowing its cost;
- ``("verdict", ("refused", limit, message))``: past a ``ConstraintLimits`` bound;
- ``("verdict", ("invalid", message))``: the constraint does not build or compile, or derives no sentence.

The worker reports the child's pid first (``("started", pid)``). A ``("cancel",)`` frame while a job runs
kills its child (SIGKILL: its memory returns at once) and is answered ``("cancelled",)``; a child that dies
without a verdict is reported as ``("died", status)``. The worker itself only ever holds its imports and the
tokenizer info, so a stopped job costs no new worker (whose imports take seconds).
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import sys
import time
from typing import Any

NICE = 10  # compiles yield the CPU to the engine's threads (and to everything else at the default priority)
PROBE_SLACK = 32 << 20  # the probe's own mask arrays and interpreter allocations, beside the matcher's growth
MAX_MESSAGE = 1000  # characters of a verdict's message: a verdict frame stays one atomic pipe write
POLL_S = 0.02
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PR_SET_PDEATHSIG = 1


def vm_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[0]) * _PAGE


def rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def _limit_address_space(nbytes: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = nbytes if hard == resource.RLIM_INFINITY else min(nbytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _die_with_parent() -> None:
    """SIGKILL when the engine's thread that started this worker ends (Linux), so no worker outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent is already gone
        os._exit(0)


def _trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Worker:
    def __init__(self, setup: dict[str, Any]) -> None:
        import xgrammar  # noqa: F401 - the imports every job needs, paid once

        self.compile_memory_bytes = setup["compile_memory_bytes"]
        self.vocabularies: dict[str, tuple[Any, Any]] = {}  # key -> (GrammarCompiler, TokenClasses)
        self.space = 0

    def add_vocabulary(self, key: str, tokens: list[bytes], vocab_size: int, stop_token_ids) -> None:
        import xgrammar as xgr

        from ninfer.models.common.grammar.probe import TokenClasses

        info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.vocabularies[key] = (xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False),
                                  TokenClasses.of(tokens, vocab_size))
        _trim()

    def run(self, job: dict[str, Any], say) -> tuple:
        """The verdict on one job (in the job's child, under its address-space limit)."""
        self.space = vm_bytes() + self.compile_memory_bytes
        _limit_address_space(self.space)
        compiler, classes = self.vocabularies[job["vocabulary"]]
        from ninfer.contract.constraint import ConstraintError, ConstraintLimitExceeded
        from ninfer.models.common.grammar.build import build_grammar, kind_of, mib, reason
        from ninfer.models.common.grammar.probe import probe
        from ninfer.models.common.grammar.productive import derives_a_sentence, grammar_shape, rule_count

        limits, constraint = job["limits"], job["constraint"]
        what = kind_of(constraint)
        phase = "build"
        try:
            grammar = build_grammar(constraint, reasoning_open=job["reasoning_open"], tools=job["tools"],
                                    tool_format=job["tool_format"])
            shape = grammar_shape(grammar)
            rules = rule_count(shape)
            if rules > limits.max_grammar_rules:
                raise ConstraintLimitExceeded("max_grammar_rules", f"{what} makes a grammar of {rules} rules; at "
                                                                   f"most {limits.max_grammar_rules}")
            if not derives_a_sentence(shape):
                raise ConstraintError(f"{what} derives no sentence: every derivation of its start rule recurses "
                                      f"forever, so no output could complete it")
            del shape
            phase = "compile"
            say(("phase", phase))
            t0 = time.thread_time()
            try:
                compiled = compiler.compile_grammar(grammar)
            except (MemoryError, ConstraintError):
                raise
            except Exception as e:  # noqa: BLE001 - xgrammar names the reason
                if "bad_alloc" in str(e):
                    raise MemoryError(str(e)) from e
                raise ConstraintError(f"{what} does not compile: {reason(e)}") from e
            compile_s = time.thread_time() - t0
            size = compiled.memory_size_bytes
            if size > limits.max_compiled_bytes:
                raise ConstraintLimitExceeded("max_compiled_bytes", f"{what} compiles to {mib(size)}; at most "
                                                                    f"{mib(limits.max_compiled_bytes)}")
            phase = "probe"
            say(("phase", phase))
            _limit_address_space(vm_bytes() + limits.matcher_memory_bytes + PROBE_SLACK)
            try:
                result = probe(compiled, classes, limits, rss=rss_bytes, what=what)
            finally:
                _limit_address_space(self.space)
            verdict = ("ok", {"rules": rules, "compiled_bytes": size, "compile_s": compile_s,
                              "probe_growth_bytes": result.growth_bytes, "probe_step_s": result.step_s,
                              "probe_tokens": result.tokens})
        except ConstraintLimitExceeded as e:
            verdict = ("refused", e.limit, e.base_message[:MAX_MESSAGE])
        except ConstraintError as e:
            verdict = ("invalid", str(e)[:MAX_MESSAGE])
        except MemoryError:
            verdict = out_of_memory(phase, what, limits)
        except Exception as e:  # noqa: BLE001 - the answer carries it
            verdict = out_of_memory(phase, what, limits) if "bad_alloc" in str(e) else \
                ("invalid", f"{what} does not compile: {reason(e)}"[:MAX_MESSAGE])
        return verdict


def out_of_memory(phase: str, what: str, limits) -> tuple:
    """The verdict for a job that hit the worker's address-space limit in ``phase``."""
    from ninfer.models.common.grammar.build import mib

    if phase == "probe":
        return ("refused", "matcher_memory_bytes", f"{what}: its matcher needs more than "
                                                   f"{mib(limits.matcher_memory_bytes)} within a few tokens")
    return ("refused", "compile_memory_bytes", f"compiling {what} needs more than "
                                               f"{mib(limits.compile_memory_bytes)}")


def serve_job(worker: Worker, job: dict[str, Any], stdin, stdout) -> Any:
    """Run ``job`` in a forked child; answer a cancel by killing it. Every frame reaches ``stdout`` whole.
    Returns the next job when it arrives before the child has exited (it was sent on the child's verdict)."""
    from ninfer.models.common.grammar.frames import read_frame, write_frame

    pid = os.fork()
    if pid == 0:  # the child: its verdict, then out (never back into the worker's loop)
        status = 0
        try:
            _die_with_parent()
            write_frame(stdout, ("verdict", worker.run(job, lambda message: write_frame(stdout, message))))
        except BaseException:  # noqa: BLE001 - reported by the worker as a death without a verdict
            status = 1
        finally:
            os._exit(status)
    write_frame(stdout, ("started", pid))
    following = None
    while True:
        readable = following is None and select.select([stdin], [], [], POLL_S)[0]
        done, status = os.waitpid(pid, 0 if following is not None else os.WNOHANG)
        if done:
            if status:  # it ended without its verdict (a signal, or an error of its own)
                write_frame(stdout, ("died", os.waitstatus_to_exitcode(status)))
            return following
        if readable:
            message = read_frame(stdin)
            if message != ("cancel",):
                following = message  # the verdict is out: the child is exiting
                continue
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            write_frame(stdout, ("cancelled",))
            return None


def main() -> int:
    from ninfer.models.common.grammar.frames import WorkerGone, read_frame, write_frame

    stdin, stdout = sys.stdin.buffer.raw, sys.stdout.buffer
    sys.stdout = sys.stderr  # stdout carries frames only
    _die_with_parent()
    os.nice(NICE)
    try:
        worker = Worker(read_frame(stdin))
        write_frame(stdout, ("ready", {"pid": os.getpid()}))
        following = None
        while True:
            job = following if following is not None else read_frame(stdin)
            following = None
            if isinstance(job, tuple) and job[0] == "vocabulary":
                worker.add_vocabulary(*job[1:])
            elif job != ("cancel",):  # a cancel that crossed its job's verdict: nothing runs
                following = serve_job(worker, job, stdin, stdout)
    except (WorkerGone, BrokenPipeError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
