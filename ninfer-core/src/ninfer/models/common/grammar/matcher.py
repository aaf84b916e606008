"""TokenMatcher: one request's position in its compiled grammar (an xgrammar GrammarMatcher), guarded.

The OutputSession previews tokens by accepting them and rolling back (a refused token leaves the state
unchanged), and commits by accepting them again; masks are written for the committed state, or for the
committed state followed by draft tokens (speculative verification), which are rolled back afterwards.

The guard: every xgrammar call the matcher makes is measured, its CPU time (``time.thread_time``) and the
process's resident growth across it (``/proc/self/statm``, read with one ``pread`` of an open descriptor, a few
microseconds). Calls run on the engine's worker or fill threads; the growth is the process's, so another
thread's allocation during a call is counted too, in both directions (the sum is signed, and others' frees
cancel their allocations). A matcher that grows past ``matcher_memory_bytes``, or past the book's total
budget, or one step that takes more than ``token_time_s`` raises ``ConstraintLimitExceeded``: the engine ends
that request alone, and its matcher's memory goes with it. The compile worker's probe refuses such grammars
before they run; this is the backstop for paths the probe did not walk.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from ninfer.contract.constraint import (
    ConstraintBusy,
    ConstraintError,
    ConstraintLimitExceeded,
    ConstraintLimits,
)
from ninfer.models.common.grammar.build import mib

MIN_CHARGE = 256 << 10  # the least a live matcher counts against the total (its state before any growth)


class Resident:
    """The process's resident bytes (Linux; 0 elsewhere, which turns the memory guard off)."""

    _fd: int | None = None
    _lock = threading.Lock()
    _page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    @classmethod
    def bytes(cls) -> int:
        fd = cls._fd
        if fd is None:
            with cls._lock:
                if cls._fd is None:
                    try:
                        cls._fd = os.open("/proc/self/statm", os.O_RDONLY)
                    except OSError:
                        cls._fd = -1
                fd = cls._fd
        if fd < 0:
            return 0
        return int(os.pread(fd, 128, 0).split()[1]) * cls._page


class MatcherBudget:
    """The memory all live matchers of one GrammarBook hold, bounded by ``total_matcher_bytes``."""

    def __init__(self, limits: ConstraintLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self.live = 0  # matchers
        self.held = 0  # bytes counted against the total

    def reserve(self, nbytes: int) -> None:
        """Count a new matcher; ConstraintBusy when the total would pass its bound."""
        with self._lock:
            if self.held + nbytes > self.limits.total_matcher_bytes:
                raise ConstraintBusy(f"the live grammar matchers hold {mib(self.held)}; this request's would "
                                     f"pass the total of {mib(self.limits.total_matcher_bytes)} "
                                     f"(ConstraintLimits.total_matcher_bytes); retry later")
            self.live += 1
            self.held += nbytes

    def grow(self, nbytes: int) -> bool:
        """Count ``nbytes`` more (or fewer) for a live matcher; False when the total passed its bound."""
        with self._lock:
            self.held += nbytes
            return nbytes <= 0 or self.held <= self.limits.total_matcher_bytes

    def release(self, cell: list[int]) -> None:
        with self._lock:
            self.live -= 1
            self.held -= cell[0]
            cell[0] = 0


class TokenMatcher:
    def __init__(self, compiled: Any, *, budget: MatcherBudget | None = None, charge: int = MIN_CHARGE) -> None:
        """``compiled``: an xgrammar CompiledGrammar. With a ``budget`` the matcher counts ``charge`` bytes
        against it (reserved by the caller) and is guarded by the budget's limits; without one it is not."""
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        self._budget = budget
        self._limits = budget.limits if budget is not None else None
        self._growth = 0  # signed resident growth measured across this matcher's calls
        self._counted = [charge]  # what the budget holds for it (shared with the finalizer)
        self._failure: ConstraintError | None = None
        self._release = weakref.finalize(self, budget.release, self._counted) if budget is not None else None

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow it."""
        return self._call("accept_token", int(token))

    def accept_prefix(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """Advance by the longest allowed prefix of ``tokens``, stopping after a terminating (stop) token:
        (tokens advanced, whether the grammar ended)."""
        n = 0
        for t in tokens:
            if not self._call("accept_token", int(t)):
                return n, False
            n += 1
            if self._live().is_terminated():
                return n, True
        return n, False

    def rollback(self, n: int) -> None:
        if n:
            self._live().rollback(n)

    @property
    def completed(self) -> bool:
        """The text so far is a complete sentence of the grammar (a stop token may follow)."""
        return self._live().is_completed()

    @property
    def terminated(self) -> bool:
        """A stop token ended the grammar: nothing more may follow."""
        return self._live().is_terminated()

    def fill(self, out: Any, drafts: Sequence[int] = ()) -> None:
        """Row 0 of ``out`` (int32 [1 + len(drafts), words]): the tokens allowed now; row j: after drafts[:j].
        Rows after a refused draft, or after a stop token, are zeroed; the state is unchanged afterwards."""
        self._call("fill_next_token_bitmask", out, 0)
        advanced = 0
        for j, t in enumerate(drafts, start=1):
            if not self._call("accept_token", int(t)):
                out[j:].zero_()
                break
            advanced += 1
            if self._live().is_terminated():
                out[j:].zero_()
                break
            self._call("fill_next_token_bitmask", out, j)
        self.rollback(advanced)

    def close(self) -> None:
        """End the matcher now (otherwise when it is collected): its xgrammar state and what the budget counted
        go; a later call raises."""
        if self._failure is None:
            self._failure = ConstraintError("the grammar matcher was closed (its request ended)")
        self._m = None
        if self._release is not None:
            self._release()

    @property
    def counted_bytes(self) -> int:
        return self._counted[0]

    # -- the guard -------------------------------------------------------------------------------------
    def _live(self) -> Any:
        if self._m is None:
            raise self._failure
        return self._m

    def _call(self, name: str, *args):
        fn = getattr(self._live(), name)
        if self._limits is None:
            return fn(*args)
        before = Resident.bytes()
        t0 = time.thread_time()
        out = fn(*args)
        spent = time.thread_time() - t0
        grown = Resident.bytes() - before
        fn = None  # a traceback through this frame must not keep the matcher alive
        if grown:
            self._account(grown)
        if spent > self._limits.token_time_s:
            self._fail("token_time_s", f"one step of the grammar's matcher took {spent:.3f} CPU seconds; at most "
                                       f"{self._limits.token_time_s}")
        if self._m is None:
            raise self._failure
        return out

    def _account(self, grown: int) -> None:
        self._growth += grown
        counted = max(self._counted[0], self._growth)
        if self._growth > self._limits.matcher_memory_bytes:
            self._fail("matcher_memory_bytes", f"the grammar's matcher grew by {mib(self._growth)}; at most "
                                               f"{mib(self._limits.matcher_memory_bytes)} per request")
        if counted != self._counted[0] and self._release is not None and self._release.alive:
            delta, self._counted[0] = counted - self._counted[0], counted
            if not self._budget.grow(delta):
                self._fail("total_matcher_bytes", f"the live grammar matchers passed their total of "
                                                  f"{mib(self._limits.total_matcher_bytes)} as this one grew")

    def _fail(self, limit: str, message: str) -> None:
        """Fail for good: the xgrammar matcher and what the budget counted go now, whoever still holds this."""
        if self._failure is None:
            self._failure = ConstraintLimitExceeded(limit, message)
            self.close()
