"""A compile in flight (``CompileJob``) and its result (``Compiled``), shared by the book, the pool and its slots."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from ninfer.contract.constraint import ConstraintLimits
from ninfer.models.common.grammar.build import kind_of

POLL_S = 0.05  # how often a driver or a waiter looks at deadlines, cancellation and closing


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
        self._finished = False

    def finish(self, result: Compiled | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self.result, self.error = result, error
        # ``on_done`` (the book's cache, refusals and in-flight table) runs before a waiter wakes: a caller that
        # sends the same constraint again right after its verdict finds it recorded, never this finished job
        try:
            self._on_done(self)
        finally:
            self.done.set()
