"""Constraint limits through the Engine with the embedded default model (CPU) (issue 42, items 1, 2 and 8).

EngineConfig's ConstraintLimits reach the Frontend's grammar book; a constraint past one is InvalidConstraint
naming it; a grammar that derives no sentence and a remote ``$ref`` are refused at submit; ``submit``'s
``cancel`` abandons a compile (RequestCancelled, kind ``cancelled``) and ``close()`` ends a submit waiting for
one at once (EngineClosed); a full matcher budget is Overloaded; a matcher past its limit while it runs ends
its own request with the limit named while its neighbour completes, and every counted byte comes back.
"""

from __future__ import annotations

import gc
import threading
import time

import attrs
import pytest

import ninfer
from ninfer.contract import (
    ChoiceConstraint,
    FinishReason,
    GenerationRequest,
    GrammarConstraint,
    JsonConstraint,
    RegexConstraint,
    SamplingParams,
    TextInput,
)
from ninfer.contract.constraint import ConstraintLimits
from ninfer.engine.errors import EngineClosed, InvalidConstraint, Overloaded, RequestCancelled
from ninfer.testing.scheduling import submit_together

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
pytest.importorskip("xgrammar")

SLOW = ChoiceConstraint(choices=[f"{i:04d}" + "ab" * 498 for i in range(1024)])  # compiles for a minute or more
LIMITS = ConstraintLimits(max_choices=1024, max_choice_bytes=1 << 20, max_compiled_bytes=1 << 30,
                          compile_timeout_s=600.0, max_regex_bytes=64)


def make_engine() -> ninfer.Engine:
    return ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu", max_concurrency=2,
                                                                          context_cache=False,
                                                                          constraint_limits=LIMITS))


@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.close()


def request(constraint=None, **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", 16)
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(input=TextInput(text="KING HENRY:\n"), sampling=SamplingParams(**sampling),
                             constraint=constraint)


def submit_in_thread(engine, req, **kwargs) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(engine.submit(req, **kwargs))
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def compiling(engine) -> None:
    """Wait until the engine's grammar book runs a compile on a worker."""
    book = engine.frontend.grammars
    end = time.monotonic() + 120
    while time.monotonic() < end:
        if any(job.worker_pid is not None for job in list(book._inflight.values())):
            return
        time.sleep(0.02)
    pytest.fail("no compile started")


def test_limits_reach_the_grammar_book_and_name_themselves(engine):
    assert engine.frontend.grammars.limits is LIMITS
    with pytest.raises(InvalidConstraint, match=r"the regex is 70 bytes; at most 64 \(limit: "
                                                r"ConstraintLimits.max_regex_bytes, ninfer serve --constraint-regex"):
        engine.submit(request(RegexConstraint(pattern="a" * 70)))


@pytest.mark.parametrize(("constraint", "words"), [
    (GrammarConstraint(grammar="root ::= x\nx ::= x"), "the grammar derives no sentence"),
    (GrammarConstraint(grammar='start: a\na: "(" a ")"', syntax="lark"), "derives no sentence"),
    (JsonConstraint(schema={"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}),
     "remote references are not fetched"),
])
def test_the_small_traps_are_refused_at_submit(engine, constraint, words):
    with pytest.raises(InvalidConstraint, match=words):
        engine.submit(request(constraint))


def test_cancel_abandons_a_compile(engine):
    cancel = threading.Event()
    thread, out = submit_in_thread(engine, request(SLOW), cancel=cancel)
    compiling(engine)
    cancel.set()
    thread.join(30)
    assert isinstance(out[0], RequestCancelled) and out[0].kind == "cancelled"
    assert engine.metrics().requests_rejected.get("cancelled") == 1
    assert not engine.frontend.grammars._inflight


def test_close_ends_a_submit_waiting_for_its_compile():
    eng = make_engine()
    thread, out = submit_in_thread(eng, request(SLOW))
    compiling(eng)
    eng.close()
    thread.join(30)
    assert not thread.is_alive() and isinstance(out[0], EngineClosed)


def test_a_full_matcher_budget_is_overloaded_until_a_request_ends(engine):
    book = engine.frontend.grammars
    forever = GrammarConstraint(grammar='root ::= [a-z ]*')
    first = engine.submit(request(forever, max_tokens=100_000, ignore_eos=True))
    # what the first matcher left of the budget is taken (its own size is measured, so it varies)
    filler = book.budget.limits.total_matcher_bytes - book.budget.held
    book.budget.grow(filler)
    try:
        with pytest.raises(Overloaded, match="total_matcher_bytes"):
            engine.submit(request(forever))
    finally:
        book.budget.grow(-filler)
    first.next_event(timeout=120)  # running: its end closes its matcher (one cancelled while queued is
    first.cancel()                 # collected when the worker drops its record)
    first.result(timeout=120)
    gc.collect()
    assert book.budget.held == 0 and book.budget.live == 0
    assert engine.generate(request(forever, max_tokens=4), timeout=120).finish_reason is FinishReason.LENGTH


def test_a_matcher_past_its_limit_ends_its_request_alone(engine, monkeypatch):
    open_session, doomed = engine.frontend.open_session, GrammarConstraint(grammar='root ::= [a-z \\n:]*')

    def opening(prompt, sampling, constraint=None, **kwargs):  # the doomed request's matcher gets a tiny step limit
        session = open_session(prompt, sampling, constraint, **kwargs)
        if constraint is doomed:
            matcher = session._grammar
            matcher._limits = attrs.evolve(matcher._limits, token_time_s=1e-12)
        return session

    monkeypatch.setattr(engine.frontend, "open_session", opening)
    handles = submit_together(engine, [request(doomed), request(RegexConstraint(pattern="[A-Z]+"), max_tokens=8),
                                       request(max_tokens=8, ignore_eos=True)])
    broken, regex, plain = (h.result(timeout=120) for h in handles)
    assert broken.finish_reason is FinishReason.ERROR and broken.extra["error_kind"] == "request_failed"
    assert "ConstraintLimits.token_time_s" in broken.error
    assert regex.finish_reason is not FinishReason.ERROR and plain.usage.completion_tokens == 8
    assert not engine.failed and engine.usage().all_free
    gc.collect()
    assert engine.frontend.grammars.budget.held == 0
