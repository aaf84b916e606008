"""What still fails the engine, what the gateway answers for a failed request, and how failures are sorted.

A device error, a broken invariant, a failed rollback or a Program ledger that disagrees fails the engine,
cleanly: every response ends, later submissions are refused. A request ended by memory exhaustion answers 503
with Retry-After, any other failure 500 without its text, and ``/health`` stays ok (issue 42, item 1). The
request-level cases are in ``test_engine_failures.py`` and ``test_engine_failures_cache.py``.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.events import FinishReason, GenerationResult
from ninfer.engine.errors import (
    EngineFailed,
    InvariantBroken,
    MemoryExhausted,
    is_device_error,
    is_fatal,
    is_memory_exhaustion,
    request_failure,
)
from ninfer.testing.faults import (
    AFTER,
    CPU_OOM,
    NEIGHBOUR,
    TARGET,
    Fault,
    all_free,
    faulty_engine,
    instance,
    req,
)
from ninfer.testing.scheduling import submit_together

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

FATAL = [
    ("invariant", [Fault("program.launch_decode", InvariantBroken("two requests hold one sequence"))]),
    ("device-error", [Fault("program.prefill", RuntimeError("CUDA error: an illegal memory access was encountered"))]),
    # A recoverable failure whose rollback fails: the Program cannot free the failed request's sequence.
    ("rollback", [Fault("program.launch_decode", MemoryError()),
                  Fault("program.release", RuntimeError("sequence is pending"))]),
    # Binding raised after it bound a sequence: the Program holds one the engine cannot name.
    ("ledger", [Fault("program.open_sequence", MemoryError(), after=True)]),
]


@pytest.mark.parametrize(("case", "faults"), FATAL, ids=[f[0] for f in FATAL])
def test_a_device_error_or_broken_invariant_still_fails_the_engine_cleanly(case, faults):
    inst = instance()  # its own Program: a failed engine's state is not reused
    try:
        with faulty_engine(inst, faults) as eng:
            handles = submit_together(eng, [req(TARGET, max_tokens=64), req(NEIGHBOUR, max_tokens=64)])
            results = [h.result(timeout=120) for h in handles]  # every response ends: nothing hangs
            assert eng._core.program.fired
            kinds = [r.extra["error_kind"] for r in results if r.finish_reason is FinishReason.ERROR]
            assert len(kinds) == len(results) and "engine_failed" in kinds, results
            # Binding failed before the ledger check found what it left: that request had ended already.
            assert set(kinds) == ({"engine_failed", "memory_exhausted"} if case == "ledger" else {"engine_failed"})
            assert eng.failed and eng.metrics().failed and eng.metrics().outstanding == 0
            with pytest.raises(EngineFailed):
                eng.submit(req(AFTER))
    finally:
        inst.frontend.close()


# -- the gateway ------------------------------------------------------------------------------------------------
BODY = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0.0}


def test_the_gateway_answers_503_for_memory_and_health_stays_ok(fault_model):
    from starlette.testclient import TestClient

    from ninfer_serve.app import create_app

    faults = [Fault("program.prefill", MemoryError())]  # the first prefill: the first request's
    with faulty_engine(fault_model.inst, faults) as eng, TestClient(create_app(eng)) as c:
        r = c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and r.headers["Retry-After"], r.text
        error = r.json()["error"]
        assert error["code"] == "memory_exhausted" and "prefill" in error["message"] and "retry" in error["message"]
        assert c.get("/health").json() == {"status": "ok"}
        assert c.post("/v1/chat/completions", json=BODY).status_code == 200
        assert c.get("/health").status_code == 200
        all_free(eng)


def test_an_unexpected_failure_answers_500_without_its_text(fault_model):
    from starlette.testclient import TestClient

    from ninfer_serve.app import create_app

    faults = [Fault("program.prefill", ValueError("secret internal detail"))]
    with faulty_engine(fault_model.inst, faults) as eng, TestClient(create_app(eng)) as c:
        r = c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", r.text
        assert "secret" not in r.text
        assert c.get("/health").status_code == 200
        assert c.post("/v1/chat/completions", json=BODY).status_code == 200
        all_free(eng)


def test_a_final_result_with_the_memory_kind_maps_to_503_with_retry_after():
    from ninfer_serve.errors import from_error_result

    err = from_error_result("request r ended at decode launch: the server ran out of memory (MemoryError); retry "
                            "later", "memory_exhausted", request_id="r")
    assert err.status == 503 and err.headers["Retry-After"] and err.code == "memory_exhausted"
    assert "decode launch" in err.message


def test_the_final_result_is_the_last_event_even_when_publishing_it_fails(fault_model):
    """A failure while publishing the final result still ends the response (a bare error result)."""
    with faulty_engine(fault_model.inst, []) as eng:
        def submit():
            h = eng.submit(req(AFTER))
            ch, real, failed = h._channel, h._channel.publish, []

            def publish(event):
                if isinstance(event, GenerationResult) and not failed:
                    failed.append(event)
                    raise MemoryError()
                return real(event)

            ch.publish = publish
            return h

        h = eng._core.on_worker(submit)
        r = h.result(timeout=120)
        assert r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "memory_exhausted"
        assert "publication" in r.error
        assert eng.generate(req(AFTER), timeout=120).token_ids == fault_model.alone[AFTER] and not eng.failed
        all_free(eng)


# -- how failures are sorted ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("exc", "memory", "fatal"), [
    (MemoryError(), True, False),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True, False),
    (RuntimeError(CPU_OOM), True, False),
    (RuntimeError("CUDA error: out of memory"), True, False),
    (RuntimeError("CUDA error: device-side assert triggered"), False, True),
    (InvariantBroken("settled twice"), False, True),
    (AssertionError("lane overflow"), False, True),
    (KeyboardInterrupt(), False, True),
    (ValueError("the matcher's state is gone"), False, False),
    (RuntimeError("shape mismatch"), False, False),
])
def test_failures_are_sorted_into_fatal_memory_and_request_level(exc, memory, fatal):
    assert is_memory_exhaustion(exc) is memory
    assert is_fatal(exc) is fatal
    assert not (memory and is_device_error(exc))
    err = request_failure("r1", "prefill", exc)
    assert isinstance(err, MemoryExhausted) is memory and err.stage == "prefill" and err.__cause__ is exc
    assert "r1" in str(err) and "prefill" in str(err) and type(exc).__name__ in str(err)
    assert err.http_status == (503 if memory else 500)
