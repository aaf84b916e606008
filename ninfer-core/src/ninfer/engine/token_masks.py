"""SessionMasks: the ``TokenMasks`` the engine lends the Program, read from resident requests' OutputSessions.

The Program asks when it queues a unit's sampling, which the worker does only after committing every earlier
unit of those sequences, so each session's matcher stands exactly before the token being sampled. A sequence
no longer bound to a request (finished while its row was in flight) is unconstrained: its token is never kept.

A unit's rows may be spread over fill threads: a position of a large JSON Schema or a GBNF grammar is slow
to fill (docs/performance.md, "Constrained decoding"), and the fills of different sessions touch different matchers (their
C++ fill releases the GIL). Handing a cheap fill to a thread costs more than it saves, so the choice is
measured: units are filled by the worker alone first; once that costs more than PARALLEL_ABOVE_S, spreading
(the worker plus a small TaskPool, started then) is tried, and from then on the cheaper way per row is used,
the other one re-measured every EXPLORE_EVERY units. A fill that fails ends its request alone
(``RequestRecord.frontend_error``, settled when the row's tokens are previewed); its row allows every token
meanwhile.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence

from ninfer.contract.constraint import MaskFill
from ninfer.core.task_pool import Task, TaskPool
from ninfer.engine.request import RequestRecord

MAX_FILL_THREADS = 7  # beside the worker: B = 8 rows at once
PARALLEL_ABOVE_S = 0.5e-3  # a unit's rows filled by the worker alone take longer than this: try spreading them
EXPLORE_EVERY = 256  # a re-measurement of the slower way costs one slow unit
log = logging.getLogger(__name__)


class SessionMasks:
    def __init__(self, by_seq: dict[int, RequestRecord], *, threads: int | None = None) -> None:
        """``threads``: fill threads beside the worker (default: half the CPUs, at most MAX_FILL_THREADS)."""
        self._by_seq = by_seq
        self._threads = min(MAX_FILL_THREADS, (os.cpu_count() or 2) // 2) if threads is None else threads
        self._pool: TaskPool | None = None
        self._row_s = {False: 0.0, True: 0.0}  # recent wall time per row of a unit, by the worker alone / spread
        self._units = 0

    def constrained(self, sequence_id: int) -> bool:
        rec = self._by_seq.get(sequence_id)
        return rec is not None and rec.session.constrained

    def fill(self, fills: Sequence[MaskFill]) -> None:
        recs = [self._by_seq[f.sequence_id] for f in fills]
        spread = self._spread(len(fills))
        t0 = time.perf_counter()
        if spread:
            if self._pool is None:
                self._pool = TaskPool("ninfer-masks", threads=self._threads, max_queued=MAX_FILL_THREADS + 1)
            tasks = [Task(lambda rec=rec, f=f: _fill(rec, f)) for rec, f in zip(recs[1:], fills[1:], strict=True)]
            for task in tasks:
                self._pool.submit(task)
            errors = [_fill(recs[0], fills[0]), *(task.result() for task in tasks)]
        else:
            errors = [_fill(rec, f) for rec, f in zip(recs, fills, strict=True)]
        if len(fills) > 1:
            per_row = (time.perf_counter() - t0) / len(fills)
            old = self._row_s[spread]
            self._row_s[spread] = per_row if not old else 0.75 * old + 0.25 * per_row
        for rec, f, error in zip(recs, fills, errors, strict=True):
            if error is not None:  # on the worker: the request ends when its row is previewed
                log.error("token mask of %s failed: %s", rec.request_id, error)
                rec.frontend_error = error
                f.out.fill_(-1)

    def _spread(self, rows: int) -> bool:
        """Whether this unit's rows go to the fill threads too (see the module docstring)."""
        if rows < 2 or self._threads < 1:
            return False
        self._units += 1
        alone, spread = self._row_s[False], self._row_s[True]
        if not spread:  # not tried yet: only once the worker alone is slow
            return alone * rows > PARALLEL_ABOVE_S
        cheaper = spread < alone
        return not cheaper if self._units % EXPLORE_EVERY == 0 else cheaper

    def wanted(self, recs: Iterable[RequestRecord]) -> SessionMasks | None:
        """Itself when one of ``recs`` is constrained (the Program then checks each row), else None."""
        return self if any(r.session.constrained for r in recs) else None

    def close(self) -> None:
        """Stop the fill threads (the worker's last act)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _fill(rec: RequestRecord, f: MaskFill) -> BaseException | None:
    """Fill one request's rows; the error instead of raising it (one request's failure is its own)."""
    try:
        rec.session.fill_token_mask(f.out, f.drafts)
    except Exception as exc:  # noqa: BLE001 - reported on the worker, ends that request only
        return exc
    return None
