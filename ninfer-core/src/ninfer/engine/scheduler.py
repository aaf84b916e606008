"""Scheduler: execution membership and fairness rules, decided from request state and submission order.

Rules (design document, "Scheduler"):
- Waiting requests are admitted strictly in submission order (no request overtakes an older waiting one).
- Unit permits go to the protected recovery first, then residents in ticket order (oldest first).
- Under pressure the youngest resident younger than the row in need is paused; a row with no younger
  victim pauses itself (it is the youngest).
- Paused requests resume oldest first, one protected recovery at a time; while an older resident
  remains, a paused request waits instead of pausing younger borrowers.
- Fresh admission may overtake paused requests at most ``bypass_limit`` times per pause; then fresh
  admission closes until the paused request resumes.
- Prefill/Replay chunks rotate round robin among residents, the protected recovery first.
- Host pressure on a pause revokes paused Snapshots shortest replay first (youngest on ties), only when
  that makes room and loses fewer replay positions than the new Snapshot saves.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from ninfer.engine.request import RequestRecord, RequestState


class Scheduler:
    def __init__(self, *, max_concurrency: int, bypass_limit: int) -> None:
        """Both come validated from ``EngineConfig``."""
        self.max_concurrency = max_concurrency
        self.bypass_limit = bypass_limit
        self.waiting: collections.deque[RequestRecord] = collections.deque()
        self.residents: dict[int, RequestRecord] = {}   # ticket -> record
        self.paused: dict[int, RequestRecord] = {}      # ticket -> record
        self.protected: RequestRecord | None = None
        self._last_prefill_ticket = -1
        self.max_bypass_seen = 0

    # -- membership --------------------------------------------------------------------------------
    def enqueue(self, rec: RequestRecord) -> None:
        if self.waiting and self.waiting[-1].ticket > rec.ticket:
            raise AssertionError("waiting queue out of submission order")
        self.waiting.append(rec)

    def make_resident(self, rec: RequestRecord) -> None:
        if len(self.residents) >= self.max_concurrency:
            raise AssertionError(f"lane overflow: {len(self.residents)} residents at max_concurrency")
        self.residents[rec.ticket] = rec
        self.paused.pop(rec.ticket, None)

    def make_paused(self, rec: RequestRecord) -> None:
        self.residents.pop(rec.ticket)
        self.paused[rec.ticket] = rec
        rec.bypassed = 0
        if self.protected is rec:
            self.protected = None

    def remove(self, rec: RequestRecord) -> None:
        self.residents.pop(rec.ticket, None)
        self.paused.pop(rec.ticket, None)
        if rec in self.waiting:
            self.waiting.remove(rec)
        if self.protected is rec:
            self.protected = None

    @property
    def free_lanes(self) -> int:
        return self.max_concurrency - len(self.residents)

    # -- ordering ----------------------------------------------------------------------------------
    def permit_order(self) -> list[RequestRecord]:
        """Residents in permit order: the protected recovery first, then oldest ticket first."""
        order = [self.residents[t] for t in sorted(self.residents)]
        if self.protected is not None and self.protected in order:
            order.remove(self.protected)
            order.insert(0, self.protected)
        return order

    def victim_for(self, needy: RequestRecord) -> RequestRecord | None:
        """The youngest resident younger than ``needy`` that may be paused (never the protected one)."""
        cands = [r for t, r in self.residents.items() if t > needy.ticket and r is not self.protected]
        return max(cands, key=lambda r: r.ticket) if cands else None

    def revocations_for(self, shortfall: int, saves: int) -> list[RequestRecord]:
        """Paused Snapshots to demote to Replay so that ``shortfall`` more host bytes are free, or [] when
        that cannot make room or would lose at least the ``saves`` replay positions the new Snapshot saves.

        Every Snapshot holds a fixed StateImage plus KV in proportion to its frontier, so the shortest
        replay also loses least per byte freed; among equals the youngest goes (it resumes last).
        """
        held = sorted((r for r in self.paused.values() if r.snapshot is not None),
                      key=lambda r: (r.snapshot.replay_positions, -r.ticket))
        chosen, freed, lost = [], 0, 0
        for rec in held:
            if freed >= shortfall:
                break
            chosen.append(rec)
            freed += rec.snapshot.host_bytes
            lost += rec.snapshot.replay_positions
        if shortfall <= 0 or freed < shortfall or lost >= saves:
            return []
        return chosen

    def oldest_paused(self) -> RequestRecord | None:
        return self.paused[min(self.paused)] if self.paused else None

    def has_older_resident(self, rec: RequestRecord) -> bool:
        return any(t < rec.ticket for t in self.residents)

    def fresh_admission_open(self) -> bool:
        return all(p.bypassed < self.bypass_limit for p in self.paused.values())

    def note_fresh_admission(self) -> None:
        """A fresh request was admitted ahead of every paused (older) request."""
        for p in self.paused.values():
            p.bypassed += 1
            self.max_bypass_seen = max(self.max_bypass_seen, p.bypassed)

    def pick_prefill(self, candidates: Iterable[RequestRecord]) -> RequestRecord | None:
        """One Prefill/Replay row for this cycle: the protected recovery first, else round robin by ticket."""
        cands = sorted(candidates, key=lambda r: r.ticket)
        if not cands:
            return None
        if self.protected is not None and self.protected in cands:
            pick = self.protected
        else:
            later = [r for r in cands if r.ticket > self._last_prefill_ticket]
            pick = later[0] if later else cands[0]
        self._last_prefill_ticket = pick.ticket
        return pick

    def prefill_candidates(self) -> list[RequestRecord]:
        return [r for r in self.residents.values() if r.state in (RequestState.PREFILL, RequestState.REPLAY)]

    def decode_candidates(self) -> list[RequestRecord]:
        return [r for r in self.permit_order() if r.state is RequestState.DECODE_READY]
