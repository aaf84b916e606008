"""SessionMasks: the ``TokenMasks`` the engine lends the Program, read from resident requests' OutputSessions.

The Program asks when it queues a unit's sampling, which the worker does only after committing every earlier
unit of those sequences, so each session's matcher stands exactly before the token being sampled. A sequence
no longer bound to a request (finished while its row was in flight) is unconstrained: its token is never kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ninfer.engine.request import RequestRecord


class SessionMasks:
    def __init__(self, by_seq: dict[int, RequestRecord]) -> None:
        self._by_seq = by_seq

    def constrained(self, sequence_id: int) -> bool:
        rec = self._by_seq.get(sequence_id)
        return rec is not None and rec.session.constrained

    def fill(self, sequence_id: int, out: Any, drafts: Sequence[int] = ()) -> None:
        self._by_seq[sequence_id].session.fill_token_mask(out, drafts)

    def wanted(self, recs: Iterable[RequestRecord]) -> SessionMasks | None:
        """Itself when one of ``recs`` is constrained (the Program then checks each row), else None."""
        return self if any(r.session.constrained for r in recs) else None
