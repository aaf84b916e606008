"""GrammarBook: the compiled grammars of one vocabulary, and the per-request matchers made from them.

The backend is xgrammar (``docs/constrained-decoding.md`` says why). Its ``TokenizerInfo`` is built from the
exact bytes of each token, with two traps closed (``shared/reference/constrained_frontend.md`` §1.6): special
tokens get no text, so a grammar never allows ``<|im_start|>`` as string content (except the markers the
model's own formats write as text, e.g. ``<think>`` and ``<tool_call>``), and every end-of-sequence id is a
stop token.

``compile`` runs on the submitting thread, which waits while the work happens where it can be stopped:

1. cheap checks here: the constraint's size against ``ConstraintLimits``, the tools' names;
2. the compiled-grammar LRU (keyed by the constraint, whether the prompt opened a thinking block, and the tools),
   the refusals remembered (by digest: the same hostile constraint again is refused at once), and the compiles
   in flight: identical constraints share one;
3. a compile worker process (``compile_pool``) checks unsupported schema keywords and remote ``$ref``s
   (``schema_features``, a walk of the whole schema: kept off this process), builds the grammar, refuses it past
   its rule limit or when it derives no sentence, compiles it under an address-space limit and probes its
   matcher; past its deadline, or once every waiter was cancelled or the book closed, it is killed;
4. the vetted grammar is compiled in this process, on the pool's low-priority thread.

Each matcher counts its probed size (at least ``MIN_CHARGE``) against the book's ``total_matcher_bytes`` and
is guarded as it runs (``matcher``).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ninfer.contract.constraint import (
    ChoiceConstraint,
    Constraint,
    ConstraintCancelled,
    ConstraintClosed,
    ConstraintError,
    ConstraintLimitExceeded,
    ConstraintLimits,
    GrammarConstraint,
    JsonConstraint,
    RegexConstraint,
    ToolCallConstraint,
    regex_syntax_error,
)
from ninfer.models.common.grammar import compile_pool
from ninfer.models.common.grammar.build import TOOL_FORMAT, kind_of, tool_names
from ninfer.models.common.grammar.compile_job import POLL_S, Compiled, CompileJob
from ninfer.models.common.grammar.compile_pool import CompilePool
from ninfer.models.common.grammar.matcher import MIN_CHARGE, MatcherBudget, TokenMatcher

REFUSED_ENTRIES = 256  # refusals remembered by digest: a hostile constraint sent again costs no worker time


class GrammarBook:
    """Compiled grammars for one vocabulary. ``vocabulary()`` returns each token id's bytes (``b""`` for special
    tokens); ids from its length up to ``vocab_size`` are padding. Thread-safe."""

    def __init__(self, vocabulary: Callable[[], list[bytes]], *, vocab_size: int, stop_token_ids: Sequence[int],
                 tool_format: str = TOOL_FORMAT, limits: ConstraintLimits | None = None,
                 cache_bytes: int = 256 << 20, cache_entries: int = 512) -> None:
        self._vocabulary = vocabulary
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.tool_format = tool_format
        self.limits = limits if limits is not None else ConstraintLimits()
        self.cache_bytes = cache_bytes
        self.cache_entries = cache_entries
        self._lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._pool: CompilePool | None = None
        self._vocabulary_key = ""
        self._cache: OrderedDict[tuple, Compiled] = OrderedDict()
        self._cached_bytes = 0
        self._refused: OrderedDict[bytes, ConstraintError] = OrderedDict()  # digest of a key -> its refusal
        self._inflight: dict[tuple, CompileJob] = {}
        self._waiters: dict[CompileJob, int] = {}
        self._closed = False
        self.budget = MatcherBudget(self.limits)
        self.compiles = 0  # cold compiles (cache misses that compiled)

    # -- compile --------------------------------------------------------------------------------------
    def compile(self, constraint: Constraint, *, reasoning_open: bool = False,
                tools: Sequence[Mapping[str, Any]] = (), cancel: threading.Event | None = None) -> Compiled:
        """The compiled ``constraint`` (cached). Raises ConstraintError (ConstraintLimitExceeded past a limit)
        naming what is wrong, ConstraintBusy when the workers are full, ConstraintCancelled once ``cancel`` is
        set while it waits, ConstraintClosed when the book closes meanwhile."""
        self.check(constraint, tools)
        # keys keep their order: a schema's property order is the order its call writes them in
        tools_json = json.dumps(list(tools)) if isinstance(constraint, ToolCallConstraint) else None
        key = (constraint, reasoning_open, tools_json)
        digest = _digest(key)
        with self._lock:
            if self._closed:
                raise ConstraintClosed("the grammar book is closed")
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            refused = self._refused.get(digest)
            if refused is not None:  # the same constraint again: refused at once, no worker time
                self._refused.move_to_end(digest)
                raise _fresh(refused)
        pool = self._pool_once()
        with self._lock:
            if self._closed:
                raise ConstraintClosed("the grammar book is closed")
            hit = self._cache.get(key)
            if hit is not None:
                return hit
            job = self._inflight.get(key)
            if job is None or job.abandoned:
                payload = {"constraint": constraint, "reasoning_open": reasoning_open, "limits": self.limits,
                           "vocabulary": self._vocabulary_key,
                           "tools": json.loads(tools_json) if tools_json is not None else [],
                           "tool_format": self.tool_format}
                job = CompileJob(payload, on_done=lambda job, key=key, digest=digest: self._finished(key, digest, job))
                pool.submit(job)  # ConstraintBusy / ConstraintClosed before anything is recorded
                self._inflight[key] = job
            self._waiters[job] = self._waiters.get(job, 0) + 1
        return self._wait(pool, key, job, cancel)

    def _wait(self, pool: CompilePool, key: tuple, job: CompileJob, cancel: threading.Event | None) -> Compiled:
        stop: BaseException | None = None
        try:
            while not job.done.wait(POLL_S):
                if cancel is not None and cancel.is_set():
                    stop = ConstraintCancelled("the request was cancelled while its constraint compiled")
                elif self._closed:
                    stop = ConstraintClosed("the engine closed while the constraint compiled")
                if stop is not None:
                    break
                pool.expire(job)
        finally:
            with self._lock:
                left = self._waiters[job] = self._waiters[job] - 1
                if not left:
                    del self._waiters[job]
                    job.abandoned = not job.done.is_set()  # a later identical request starts its own
                    if job.abandoned and self._inflight.get(key) is job:
                        del self._inflight[key]
            if job.abandoned:
                pool.abandon(job, stop or ConstraintCancelled("nobody waits for this compile"))
        if stop is not None:
            raise stop
        if job.error is not None:
            raise _fresh(job.error)
        return job.result

    def _finished(self, key: tuple, digest: bytes, job: CompileJob) -> None:
        with self._lock:
            if self._inflight.get(key) is job:
                del self._inflight[key]
            if _remembered(job.error) and not self._closed:
                self._refused[digest] = job.error
                self._refused.move_to_end(digest)
                while len(self._refused) > REFUSED_ENTRIES:
                    self._refused.popitem(last=False)
            if job.result is None or self._closed:
                return
            self.compiles += 1
            if key not in self._cache:
                self._cache[key] = job.result
                self._cached_bytes += job.result.compiled_bytes
                while self._cache and (self._cached_bytes > self.cache_bytes or len(self._cache) > self.cache_entries):
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.compiled_bytes

    def matcher(self, compiled: Compiled) -> TokenMatcher:
        """A guarded matcher, counted against the book's total; ConstraintBusy when the total is full."""
        charge = max(MIN_CHARGE, compiled.probe_growth_bytes)
        self.budget.reserve(charge)
        try:
            return TokenMatcher(compiled.grammar, budget=self.budget, charge=charge)
        except BaseException:
            self.budget.release([charge])
            raise

    # -- checks made here, before any worker ----------------------------------------------------------
    def check(self, c: Constraint, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        """ConstraintError (ConstraintLimitExceeded for a size) for what can be seen without compiling."""
        lim = self.limits
        if isinstance(c, JsonConstraint):
            if c.schema is not None:  # its keywords are checked where it is built (build_grammar, in a worker)
                _size("max_schema_bytes", "the JSON schema", _utf8(c.schema), lim.max_schema_bytes)
        elif isinstance(c, RegexConstraint):
            _size("max_regex_bytes", "the regex", _utf8(c.pattern), lim.max_regex_bytes)
            error = regex_syntax_error(c.pattern)
            if error is not None:
                raise ConstraintError(f"the regex does not parse: {error}")
        elif isinstance(c, GrammarConstraint):
            _size("max_grammar_bytes", "the grammar", _utf8(c.grammar), lim.max_grammar_bytes)
        elif isinstance(c, ChoiceConstraint):
            if len(c.choices) > lim.max_choices:
                raise ConstraintLimitExceeded("max_choices", f"the choice has {len(c.choices)} options; at most "
                                                             f"{lim.max_choices}")
            _size("max_choice_bytes", "the choice's options", sum(map(_utf8, c.choices)), lim.max_choice_bytes)
        elif isinstance(c, ToolCallConstraint):
            tool_names(c, tools)
            try:
                text = json.dumps(list(tools), ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise ConstraintError(f"the tools cannot be written as JSON: {e}") from e
            _size("max_schema_bytes", "the tools", _utf8(text), lim.max_schema_bytes)

    # -- lifetime --------------------------------------------------------------------------------------
    def warm(self) -> None:
        """Build the vocabulary's tokenizer info and start a compile worker now (serve warmup), not at the
        first constrained request."""
        self._pool_once().warm(self._vocabulary_key)

    def close(self) -> None:
        """Abandon every compile in flight (their workers are killed; waiting callers get ConstraintClosed) and
        let the pool go. Matchers made before go on working."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._inflight.values())
            self._inflight.clear()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            for job in jobs:
                pool.abandon(job, ConstraintClosed("the engine closed while the constraint compiled"))
            compile_pool.release(pool)

    @property
    def cached(self) -> int:
        return len(self._cache)

    def worker_pids(self) -> list[int]:
        """The compile workers' process ids (shared with the process's other books of the same worker settings)."""
        return self._pool.pids() if self._pool is not None else []

    def _pool_once(self) -> CompilePool:
        with self._pool_lock:
            if self._closed:
                raise ConstraintClosed("the grammar book is closed")
            if self._pool is None:
                pool = compile_pool.shared_pool(self.limits)
                try:
                    self._vocabulary_key = pool.add_vocabulary(self._vocabulary(), vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                except BaseException:
                    compile_pool.release(pool)
                    raise
                self._pool = pool
            return self._pool


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def _size(limit: str, what: str, nbytes: int, most: int) -> None:
    if nbytes > most:
        raise ConstraintLimitExceeded(limit, f"{what} is {nbytes} bytes; at most {most}")


def _digest(key: tuple) -> bytes:
    """A compile key's identity in a few bytes (a refusal is remembered without holding the constraint)."""
    return hashlib.sha256(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _remembered(error: BaseException | None) -> bool:
    """Refusals that the same constraint would meet again: what it is, not how busy the machine was (a compile
    past its deadline may pass on a quieter machine, so it is tried again)."""
    if not isinstance(error, ConstraintError):
        return False
    return not (isinstance(error, ConstraintLimitExceeded) and error.limit == "compile_timeout_s")


def _fresh(error: BaseException) -> BaseException:
    """A copy of a shared job's error for one waiter (each raise gets its own traceback)."""
    if isinstance(error, ConstraintLimitExceeded):
        return ConstraintLimitExceeded(error.limit, error.base_message)
    try:
        return type(error)(*error.args)
    except Exception:  # noqa: BLE001 - an error type that cannot be rebuilt is raised as it is
        return error


__all__ = ["Compiled", "GrammarBook", "kind_of"]
