"""CpuExecutor: a fixed pinned team running synchronous collectives. Every rank runs once per collective,
writes are visible afterwards, failures surface in the caller after the whole team finished, nested and
concurrent collectives are refused, start failures leave no thread behind, and split divides exactly.
Every cross-thread wait is on an event the test controls; timeouts are hang guards only."""

from __future__ import annotations

import os
import threading
import traceback

import pytest
import torch
import torch.nn.functional as F

from ninfer.core import cpu_executor
from ninfer.core.cpu_executor import CpuExecutor

GUARD_S = 30.0  # hang guard: no test waits this long unless it is broken
CAN_PIN = hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def team_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name}-")]


def run_guarded(team: CpuExecutor, fn) -> BaseException | None:
    """``team.run(fn)`` from a helper thread, so a broken refusal fails the test instead of hanging it."""
    raised: list[BaseException] = []

    def call() -> None:
        try:
            team.run(fn)
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(GUARD_S)
    assert not t.is_alive(), "the collective did not complete"
    return raised[0] if raised else None


@pytest.fixture
def team():
    ex = CpuExecutor(4, name="cpuexec-test")
    yield ex
    closer = threading.Thread(target=ex.close, daemon=True)  # a stuck worker fails the test, not the run
    closer.start()
    closer.join(GUARD_S)
    assert not closer.is_alive() and team_threads("cpuexec-test") == []


def test_every_rank_runs_once_per_collective_and_its_writes_are_visible(team):
    assert team.size == 4 and len(team.cpus) == 4
    lock = threading.Lock()
    for step in range(20):
        calls: list[tuple[int, int]] = []
        written = [None] * team.size
        out = torch.zeros(team.size, dtype=torch.int64)

        def fn(rank: int, size: int, calls=calls, written=written, out=out, step=step) -> None:
            with lock:
                calls.append((rank, size))
            written[rank] = (step, rank)
            out[rank] = step * 10 + rank

        team.run(fn)
        assert sorted(calls) == [(r, 4) for r in range(4)]
        assert written == [(step, r) for r in range(4)]
        assert out.tolist() == [step * 10 + r for r in range(4)]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 8, 32])
def test_split_covers_range_exactly_in_rank_order(size):
    for n in [0, 1, 2, 3, 5, 7, 8, 9, 31, 32, 33, 100, 1000, 1023]:
        shares = [CpuExecutor.split(n, rank, size) for rank in range(size)]
        assert [i for share in shares for i in share] == list(range(n))
        lengths = [len(s) for s in shares]
        assert max(lengths) - min(lengths) <= 1
        assert lengths == sorted(lengths, reverse=True)  # larger shares first
        assert all(s.step == 1 for s in shares)


def test_split_refuses_bad_arguments():
    with pytest.raises(ValueError, match="size"):
        CpuExecutor.split(4, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        CpuExecutor.split(4, 2, 2)
    with pytest.raises(ValueError, match="rank"):
        CpuExecutor.split(4, -1, 2)
    with pytest.raises(ValueError, match="n must"):
        CpuExecutor.split(-1, 0, 2)


def test_failure_is_raised_in_caller_after_every_rank_finished_and_team_stays_usable(team):
    finished: list[int] = []
    lock = threading.Lock()
    rank1_failing = threading.Event()

    def fail_in_rank(rank: int, size: int) -> None:
        if rank == 1:
            rank1_failing.set()
            raise ValueError("rank one is bad")
        if rank == 3:
            raise KeyError("rank three is bad too")
        assert rank1_failing.wait(GUARD_S)  # these ranks are still running when rank 1 has failed
        with lock:
            finished.append(rank)

    with pytest.raises(ValueError, match="rank one is bad") as info:
        team.run(fail_in_rank)
    assert sorted(finished) == [0, 2]
    notes = getattr(info.value, "__notes__", [])
    assert any("rank 1 of 4" in n and "1 other rank" in n for n in notes)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "fail_in_rank" in frames  # the worker's frames travel with the exception

    seen: list[int] = []
    team.run(lambda rank, size: seen.append(rank))
    assert sorted(seen) == [0, 1, 2, 3]


def test_base_exceptions_in_a_worker_do_not_kill_it(team):
    def fn(rank: int, size: int) -> None:
        if rank == 0:
            raise SystemExit("not really")

    with pytest.raises(SystemExit):
        team.run(fn)
    seen: list[int] = []
    team.run(lambda rank, size: seen.append(rank))
    assert sorted(seen) == [0, 1, 2, 3]


def test_nested_collective_is_refused(team):
    def nested(rank: int, size: int) -> None:
        if rank == 2:
            team.run(lambda r, s: None)

    error = run_guarded(team, nested)
    assert isinstance(error, RuntimeError) and "nested collective" in str(error)
    seen: list[int] = []
    team.run(lambda rank, size: seen.append(rank))
    assert sorted(seen) == [0, 1, 2, 3]


def test_concurrent_collective_from_another_thread_is_refused(team):
    started, release = threading.Event(), threading.Event()
    first_error: list[BaseException | None] = []

    def hold(rank: int, size: int) -> None:
        if rank == 0:
            started.set()
        assert release.wait(GUARD_S)

    t = threading.Thread(target=lambda: first_error.append(run_guarded(team, hold)))
    t.start()
    try:
        assert started.wait(GUARD_S)
        second = run_guarded(team, lambda rank, size: None)
        assert isinstance(second, RuntimeError) and "another collective" in str(second)
    finally:
        release.set()
        t.join(GUARD_S)
    assert not t.is_alive() and first_error == [None]
    seen: list[int] = []
    team.run(lambda rank, size: seen.append(rank))
    assert sorted(seen) == [0, 1, 2, 3]


def test_close_is_idempotent_and_refuses_later_work():
    ex = CpuExecutor(3, name="cpuexec-close")
    assert len(team_threads("cpuexec-close")) == 3
    ex.close()
    ex.close()
    assert ex.closed and team_threads("cpuexec-close") == []
    with pytest.raises(RuntimeError, match="closed"):
        ex.run(lambda rank, size: None)
    with pytest.raises(RuntimeError, match="closed"), ex.keep_active():
        pass
    with CpuExecutor(2, name="cpuexec-with") as ex2:
        seen: list[int] = []
        ex2.run(lambda rank, size: seen.append(rank))
        assert sorted(seen) == [0, 1]
    assert ex2.closed and team_threads("cpuexec-with") == []


def test_close_from_inside_a_collective_lets_it_complete():
    ex = CpuExecutor(3, name="cpuexec-inner-close")
    seen: list[int] = []

    def fn(rank: int, size: int) -> None:
        if rank == 0:
            ex.close()
        seen.append(rank)

    ex.run(fn)
    assert sorted(seen) == [0, 1, 2]
    ex.close()  # joins the worker that closed the team from inside
    assert team_threads("cpuexec-inner-close") == []


@pytest.mark.skipif(not CAN_PIN, reason="the platform cannot pin threads")
def test_cpu_outside_the_allowed_set_is_refused_before_any_thread_starts():
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"cpus {outside} are not among the CPUs this process may use"):
        CpuExecutor(cpus=[outside], name="cpuexec-outside")
    assert team_threads("cpuexec-outside") == []


def test_worker_start_failure_stops_and_joins_the_others(monkeypatch):
    real = cpu_executor._prepare_worker

    def fail_in_worker_2(cpu):
        if threading.current_thread().name == "cpuexec-startfail-2":
            raise OSError(22, "Invalid argument")
        real(cpu)

    monkeypatch.setattr(cpu_executor, "_prepare_worker", fail_in_worker_2)
    with pytest.raises(RuntimeError, match="worker 2 .* could not start") as info:
        CpuExecutor(4, name="cpuexec-startfail")
    assert isinstance(info.value.__cause__, OSError)
    assert team_threads("cpuexec-startfail") == []


def test_thread_creation_failure_stops_and_joins_the_started_ones(monkeypatch):
    class RefusingThread(threading.Thread):
        def start(self) -> None:
            if self.name == "cpuexec-nothread-2":
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(cpu_executor.threading, "Thread", RefusingThread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        CpuExecutor(4, name="cpuexec-nothread")
    monkeypatch.undo()
    assert team_threads("cpuexec-nothread") == []


def test_bad_team_configuration_is_refused():
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        CpuExecutor(0)
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        CpuExecutor(True)
    with pytest.raises(ValueError, match="cpus is empty"):
        CpuExecutor(cpus=[])
    with pytest.raises(ValueError, match="OS CPU ids"):
        CpuExecutor(cpus=[-1])
    if CAN_PIN:
        cpu = min(os.sched_getaffinity(0))
        with pytest.raises(ValueError, match="threads=3 but cpus names 2 CPUs"):
            CpuExecutor(3, cpus=[cpu, cpu])


def test_keep_active_scope_runs_back_to_back_collectives(team):
    total = torch.zeros(team.size, dtype=torch.int64)
    with team.keep_active():
        with pytest.raises(RuntimeError, match="already held"), team.keep_active():
            pass
        for _ in range(50):
            def fn(rank: int, size: int) -> None:
                total[rank] += rank + 1
            team.run(fn)
        assert total.tolist() == [50 * (r + 1) for r in range(team.size)]
    with team.keep_active():  # the scope can be taken again once released
        team.run(lambda rank, size: None)
    team.run(lambda rank, size: None)  # and collectives work outside it


def test_keep_active_is_exclusive_across_threads(team):
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with team.keep_active():
            entered.set()
            assert release.wait(GUARD_S)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert entered.wait(GUARD_S)
        with pytest.raises(RuntimeError, match="already held"), team.keep_active():
            pass
    finally:
        release.set()
        t.join(GUARD_S)


def test_default_cpus_leave_the_first_allowed_cpu_to_the_control_thread(monkeypatch):
    monkeypatch.setattr(cpu_executor, "_allowed_cpus", lambda: (4, 5, 6, 9))
    assert cpu_executor._resolve_cpus(None, None) == (5, 6, 9)
    assert cpu_executor._resolve_cpus(5, None) == (5, 6, 9, 5, 6)  # more workers than CPUs: reused in order
    assert cpu_executor._resolve_cpus(None, [9, 4]) == (9, 4)
    with pytest.raises(ValueError, match="cpus 7-8 are not among the CPUs this process may use \\(4-6,9\\)"):
        cpu_executor._resolve_cpus(None, [7, 8])
    monkeypatch.setattr(cpu_executor, "_allowed_cpus", lambda: (3,))
    assert cpu_executor._resolve_cpus(None, None) == (3,)
    monkeypatch.setattr(cpu_executor, "_allowed_cpus", lambda: tuple(range(64)))
    assert cpu_executor._resolve_cpus(None, None) == tuple(range(1, 33))  # at most 32 by default


def test_without_affinity_support_workers_run_unpinned(monkeypatch):
    monkeypatch.setattr(cpu_executor, "_allowed_cpus", lambda: None)
    monkeypatch.setattr(cpu_executor.os, "cpu_count", lambda: 8)
    assert cpu_executor._resolve_cpus(None, None) == (None,) * 7
    assert cpu_executor._resolve_cpus(2, None) == (None, None)
    with pytest.raises(ValueError, match="cannot pin threads"):
        cpu_executor._resolve_cpus(None, [0])


@pytest.mark.skipif(not CAN_PIN, reason="the platform cannot pin threads")
def test_each_worker_is_pinned_to_its_cpu_and_limits_torch_to_one_thread():
    allowed = sorted(os.sched_getaffinity(0))
    main_threads = torch.get_num_threads()
    cpus = [allowed[i % len(allowed)] for i in range(3)]
    with CpuExecutor(cpus=cpus, name="cpuexec-pin") as ex:
        assert ex.cpus == tuple(cpus)
        seen: dict[int, tuple[set[int], int]] = {}

        def fn(rank: int, size: int) -> None:
            seen[rank] = (os.sched_getaffinity(0), torch.get_num_threads())

        ex.run(fn)
        assert seen == {rank: ({cpus[rank]}, 1) for rank in range(3)}
    assert sorted(os.sched_getaffinity(0)) == allowed  # the constructing thread keeps its affinity
    assert torch.get_num_threads() == main_threads
    with CpuExecutor(name="cpuexec-default") as ex:
        expected = allowed[1:] if len(allowed) > 1 else allowed
        assert ex.cpus == tuple(expected[:32]) and ex.size == len(ex.cpus)


def test_linear_split_across_ranks_equals_the_single_thread_result(team):
    # Integer-valued inputs: every partial sum is exact, so the comparison does not depend on how a
    # kernel orders its reduction; what is tested is that the shares assemble the whole output.
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (5, 64), generator=gen).float()
    w = torch.randint(-8, 9, (37, 64), generator=gen).float()
    b = torch.randint(-8, 9, (37,), generator=gen).float()
    expected = F.linear(x, w, b)
    out = torch.full_like(expected, float("nan"))

    def fn(rank: int, size: int) -> None:
        rows = CpuExecutor.split(w.shape[0], rank, size)
        out[:, rows.start:rows.stop] = F.linear(x, w[rows.start:rows.stop], b[rows.start:rows.stop])

    team.run(fn)
    assert torch.equal(out, expected)


def test_single_threaded_caller_restores_the_thread_count():
    import torch

    from ninfer.core.cpu_executor import single_threaded_caller

    before = torch.get_num_threads()
    with single_threaded_caller():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
