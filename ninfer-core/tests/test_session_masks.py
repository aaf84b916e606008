"""SessionMasks: a unit's mask rows filled by the worker, or spread over fill threads when that is measured to
be cheaper; one failing fill ends only its own request."""

from __future__ import annotations

import threading

import pytest
import torch

from ninfer.contract.constraint import MaskFill
from ninfer.engine import token_masks
from ninfer.engine.token_masks import EXPLORE_EVERY, PARALLEL_ABOVE_S, SessionMasks


class Clock:
    """The clock SessionMasks measures with: a fill's ``delay`` advances it (no test depends on real time)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def perf_counter(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        with self.lock:
            self.now += dt


CLOCK = Clock()


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch):
    monkeypatch.setattr(token_masks, "time", CLOCK)


class Session:
    constrained = True

    def __init__(self, value: int, *, delay: float = 0.0, fail: bool = False) -> None:
        self.value, self.delay, self.fail = value, delay, fail
        self.threads: set[str] = set()

    def fill_token_mask(self, out, drafts=()):
        self.threads.add(threading.current_thread().name)
        CLOCK.advance(self.delay)
        if self.fail:
            raise RuntimeError("fill broke")
        out.fill_(self.value)


class Record:
    def __init__(self, session: Session, request_id: str) -> None:
        self.session, self.request_id, self.frontend_error = session, request_id, None


def unit(masks: SessionMasks, recs: dict[int, Record]) -> torch.Tensor:
    out = torch.zeros((len(recs), 4), dtype=torch.int32)
    masks.fill([MaskFill(sequence_id=i, out=out[k:k + 1]) for k, i in enumerate(recs)])
    return out


def test_fast_rows_stay_on_the_worker_and_slow_rows_spread():
    slow = PARALLEL_ABOVE_S  # four rows of it are four times the threshold
    recs = {i: Record(Session(i + 1, delay=slow), f"r{i}") for i in range(4)}
    masks = SessionMasks(recs, threads=3)
    try:
        first = unit(masks, recs)  # no cost known yet: the worker fills every row, and times them
        assert first[:, 0].tolist() == [1, 2, 3, 4]
        assert all(r.session.threads == {threading.current_thread().name} for r in recs.values())
        second = unit(masks, recs)
        assert second[:, 0].tolist() == [1, 2, 3, 4]
        helpers = set().union(*(r.session.threads for r in recs.values())) - {threading.current_thread().name}
        assert helpers and all(name.startswith("ninfer-masks") for name in helpers)
    finally:
        masks.close()


def test_a_failing_fill_marks_its_request_and_allows_every_token():
    recs = {0: Record(Session(5, delay=2 * PARALLEL_ABOVE_S), "ok"), 1: Record(Session(6, fail=True), "broken"),
            2: Record(Session(7), "ok2")}
    masks = SessionMasks(recs, threads=2)
    try:
        for _ in range(2):  # serial, then spread over the threads
            for r in recs.values():
                r.frontend_error = None
            out = unit(masks, recs)
            assert out[:, 0].tolist() == [5, -1, 7]
            assert isinstance(recs[1].frontend_error, RuntimeError) and recs[0].frontend_error is None
        assert any(name.startswith("ninfer-masks") for name in recs[1].session.threads)  # the second unit spread
    finally:
        masks.close()


def test_fast_rows_stay_on_the_worker():
    recs = {i: Record(Session(i + 1), f"r{i}") for i in range(4)}
    masks = SessionMasks(recs, threads=3)
    try:
        for _ in range(2 * EXPLORE_EVERY):
            unit(masks, recs)
        assert all(r.session.threads == {threading.current_thread().name} for r in recs.values())
    finally:
        masks.close()
