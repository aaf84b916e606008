"""A failure while serving one request ends that request alone; the engine keeps serving (issue 42, item 1).

On the embedded model in fp32 on the CPU. Failures are injected by wrapping the real Program, OutputSession and
response channel (``ninfer.testing.faults``): one call, for one request's sequence, raises. For every stage of a
request's own work (docs/engine.md, "Failure"): the failing request ends with an error naming the stage (503 kind
``memory_exhausted`` when memory ran out, else ``request_failed``); a concurrent neighbour finishes with exactly
the greedy tokens it produces alone; a request submitted afterwards succeeds; the engine never fails; every page,
slot and byte is free afterwards. The context cache's, pause and resume stages are in
``test_engine_failures_cache.py``; what still fails the engine, the gateway's answers and how failures are
sorted, in ``test_engine_failures_fatal.py``.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from ninfer.contract.config import StartupFeatures
from ninfer.contract.events import FinishReason
from ninfer.engine.errors import Unrepresentable
from ninfer.testing.faults import (
    AFTER,
    NEIGHBOUR,
    TARGET,
    TOKENS,
    Fault,
    all_free,
    faulty_engine,
    instance,
    req,
    stage_fails_alone,
)
from ninfer.testing.scheduling import submit_together

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def speculative(one_cpu_thread):
    inst = instance(StartupFeatures(speculative="mtp", num_draft_tokens=2))
    yield inst
    inst.frontend.close()


# (id, the fault, the stage the error names, its kind); t / n: the target's / the neighbour's prompt.
STAGES = [
    ("admission", lambda t, n: [Fault("program.open_sequence", MemoryError(), lambda p, prompt, s: tuple(
        prompt.token_ids) == t)], "admission", "memory_exhausted"),
    ("unit-reservation", lambda t, n: [Fault("program.reserve_units", ValueError("no page table"),
                                             lambda p, seq, k: p.prompt_of.get(seq) == t
                                             and p._program.input_remaining(seq) == 0)],
     "unit reservation", "request_failed"),
    ("prefill", lambda t, n: [Fault("program.prefill", torch.OutOfMemoryError("CUDA out of memory"),
                                    lambda p, seq, *a, **k: p.prompt_of.get(seq) == t)],
     "prefill", "memory_exhausted"),
    ("decode-launch", lambda t, n: [Fault("program.launch_decode", MemoryError(),
                                          lambda p, ids, **k: p.alone(ids, t))], "decode launch", "memory_exhausted"),
    ("decode-collect", lambda t, n: [Fault("program.collect", RuntimeError("readback failed"),
                                           lambda p, unit: p.alone(unit.sequence_ids, t))], "decode collect",
     "request_failed"),
    ("decode-plain", lambda t, n: [Fault("program.decode", MemoryError(), lambda p, ids, **k: p.alone(ids, t))],
     "decode", "memory_exhausted"),
    ("decode-speculative", lambda t, n: [Fault("program.launch_decode", MemoryError(),
                                               lambda p, ids, **k: p.alone(ids, t))], "decode launch",
     "memory_exhausted"),
    ("program-commit", lambda t, n: [Fault("program.commit", MemoryError(),
                                           lambda p, batch, d: p.alone(batch.sequence_ids(), t))],
     "Program.commit", "memory_exhausted"),
    ("mask-fill", lambda t, n: [Fault("session.fill_token_mask", MemoryError())], "token mask fill",
     "memory_exhausted"),
    ("session-preview", lambda t, n: [Fault("session.preview", ValueError("matcher rejected its state"))],
     "OutputSession.preview", "request_failed"),
    ("session-commit", lambda t, n: [Fault("session.commit", MemoryError())], "OutputSession.commit",
     "memory_exhausted"),
    ("session-finish", lambda t, n: [Fault("session.finish", RuntimeError("flush failed"))],
     "OutputSession.finish", "request_failed"),
    ("publication", lambda t, n: [], "publication", "memory_exhausted"),
    ("cancellation", lambda t, n: [Fault("session.finish", RuntimeError("flush failed"))], "OutputSession.finish",
     "request_failed"),
]


@pytest.mark.parametrize(("case", "faults", "stage", "kind"), STAGES, ids=[s[0] for s in STAGES])
def test_a_failure_at_each_stage_ends_that_request_alone(fault_model, speculative, case, faults, stage, kind):
    stage_fails_alone(fault_model, case, faults, stage, kind, inst=speculative if case == "decode-speculative"
                      else None, pipelined=case != "decode-plain")


def test_a_failed_shared_decode_ends_every_row_of_its_unit(fault_model):
    """Which row of a shared forward failed is unknown: both rows end; the engine goes on."""
    t = fault_model.tokens[TARGET]
    faults = [Fault("program.launch_decode", MemoryError(), lambda p, ids, **k: len(ids) == 2)]
    with faulty_engine(fault_model.inst, faults, target=t) as eng:
        a, b = [h.result(timeout=120) for h in submit_together(eng, [req(TARGET), req(AFTER)])]
        assert eng._core.program.fired == ["launch_decode"]
        for r in (a, b):
            assert r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "memory_exhausted"
            assert "decode launch" in r.error and r.usage.completion_tokens < TOKENS
        assert eng.generate(req(NEIGHBOUR), timeout=120).token_ids == fault_model.alone[NEIGHBOUR]
        assert not eng.failed
        all_free(eng)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_the_programs_validation_still_rejects_a_request_as_invalid(fault_model, cache):
    """A ValueError of the binding call is the Program's validation: a 400 rejection, not a server failure."""
    t = fault_model.tokens[TARGET]
    faults = [Fault("program.open_sequence", ValueError("no room for this prompt"),
                    lambda p, prompt, s: tuple(prompt.token_ids) == t)]
    with faulty_engine(fault_model.inst, faults, target=t) as eng:
        handles = submit_together(eng, [attrs.evolve(req(TARGET), context_cache=cache), req(NEIGHBOUR)])
        target, neighbour = [h.result(timeout=120) for h in handles]
        assert target.finish_reason is FinishReason.ERROR and target.extra["error_kind"] == "invalid", target
        assert isinstance(handles[0].exception(), Unrepresentable) and "no room" in target.error
        assert neighbour.token_ids == fault_model.alone[NEIGHBOUR] and not eng.failed
        all_free(eng)
