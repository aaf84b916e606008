"""Constrained decoding through the Engine with the embedded default model (CPU).

Acceptance (issue 18): every kind of constraint gives valid output (JSON parsed and validated against its
schema, regex full match, choice membership, grammar sentences, tool calls whose arguments fit their
tool); reasoning stays free; bad constraints are rejected at submit; an unconstrained neighbour's output is
the same as beside an unconstrained request; pause by Snapshot and by Replay keeps the committed matcher
(outputs equal to running alone); a token the constraint refuses ends the request with ``grammar``.
"""

from __future__ import annotations

import json
import re

import attrs
import pytest

import ninfer
from ninfer.contract import (
    ChatInput,
    ChoiceConstraint,
    FinishReason,
    GenerationRequest,
    GrammarConstraint,
    JsonConstraint,
    RegexConstraint,
    SamplingParams,
    TextInput,
    ToolCallConstraint,
)
from ninfer.engine.errors import InvalidConstraint
from ninfer.testing.scheduling import submit_together

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["king", "queen", "fool"]}}, "required": ["name", "age", "role"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def check_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


# kind -> (constraint, prompt, check of the content)
CASES = {
    "json_schema": (JsonConstraint(schema=PERSON, whitespace="compact"), "KING HENRY:\n", check_person),
    "json_any": (JsonConstraint(whitespace="compact"), "JSON: ", json.loads),
    "regex": (RegexConstraint(pattern=r"[A-Z][a-z]{2,8} (of|the) [A-Z][a-z]{2,8}"), "KING HENRY:\n",
              lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} (of|the) [A-Z][a-z]{2,8}", t) or pytest.fail(t)),
    "choice": (ChoiceConstraint(choices=["Romeo", "Juliet", "Mercutio"]), "ROMEO:\nWhat say you?\n",
               lambda t: t in ("Romeo", "Juliet", "Mercutio") or pytest.fail(t)),
    "gbnf": (GrammarConstraint(grammar='root ::= "SELECT " [a-z]{1,8} " FROM " [a-z]{1,8} ";"'), "KING HENRY:\n",
             lambda t: re.fullmatch(r"SELECT [a-z]{1,8} FROM [a-z]{1,8};", t) or pytest.fail(t)),
    "lark": (GrammarConstraint(grammar='start: "To " WORD " or not to " WORD\nWORD: /[a-z]{1,8}/', syntax="lark"),
             "KING HENRY:\n", lambda t: re.fullmatch(r"To [a-z]{1,8} or not to [a-z]{1,8}", t) or pytest.fail(t)),
}


@pytest.fixture(scope="module")
def engine():
    # float32: a Replay recomputes history by prefill, equal to the decode steps' numbers only up to rounding
    eng = ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu", max_concurrency=4,
                                                                         context_cache=False,
                                                                         dtype="float32"))
    yield eng
    eng.close()


def text_request(prompt: str, constraint=None, **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", 120)
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(input=TextInput(text=prompt), sampling=SamplingParams(**sampling), constraint=constraint)


def chat_request(question: str, constraint=None, *, tools=(), thinking=False, **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", 160)
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(input=ChatInput(messages=({"role": "user", "content": question},), tools=tools,
                                             template_kwargs={"enable_thinking": thinking}),
                             sampling=SamplingParams(**sampling), constraint=constraint)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_kind_gives_valid_output(engine, kind):
    constraint, prompt, check = CASES[kind]
    result = engine.generate(text_request(prompt, constraint), timeout=120)
    assert result.finish_reason is FinishReason.STOP, result
    check(result.content)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_tool_calls_fit_their_tools(engine, choice):
    result = engine.generate(chat_request("What is the weather in Paris this week?",
                                          ToolCallConstraint(tool_choice=choice, parallel=False),
                                          tools=(WEATHER, CLOCK)), timeout=120)
    assert result.finish_reason is FinishReason.TOOL_CALLS, result
    assert result.content == "" and len(result.tool_calls) == 1
    call = result.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
    if choice != "required":
        assert call.name == choice
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])


def test_reasoning_stays_free_and_the_answer_is_constrained(engine):
    result = engine.generate(chat_request("Who loves Juliet?", ChoiceConstraint(choices=["Romeo", "Paris"]),
                                          thinking=True), timeout=120)
    assert result.finish_reason is FinishReason.STOP, result
    assert result.content in ("Romeo", "Paris")


@pytest.mark.parametrize("constraint, tools, words", [
    (JsonConstraint(schema={"type": "object", "allOf": [{"required": ["a"]}]}), (), "allOf"),
    (JsonConstraint(schema={"type": "array", "uniqueItems": True}), (), "uniqueItems"),
    (JsonConstraint(schema={"type": "string", "format": "credit-card"}), (), "format"),
    (JsonConstraint(schema={"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}), (), "beside a pattern"),
    (JsonConstraint(schema={"type": "integer", "multipleOf": 5, "maximum": 50}), (), "multipleOf"),
    (JsonConstraint(schema={"type": "object", "properties": {"a": {"type": "strin"}}}), (), "JSON schema"),
    (RegexConstraint(pattern="(?<=a)b"), (), "Lookbehind"),
    (RegexConstraint(pattern="(unclosed"), (), "the regex does not parse: missing )"),
    (GrammarConstraint(grammar="root ::= item\n"), (), "item"),
    (GrammarConstraint(grammar="start: (", syntax="lark"), (), "grammar"),
    (ToolCallConstraint(tool_choice="get_stock"), (WEATHER,), "get_stock"),
    (ToolCallConstraint(tool_choice="required"), (), "tools"),
    (ToolCallConstraint(), ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "patternProperties": {"^x": {}}}}},), "patternProperties"),
])
def test_a_constraint_that_does_not_compile_is_rejected_at_submit(engine, constraint, tools, words):
    request = chat_request("hello", constraint, tools=tools) if tools or isinstance(constraint, ToolCallConstraint) \
        else text_request("hello", constraint)
    with pytest.raises(InvalidConstraint, match=re.escape(words)):
        engine.submit(request)
    assert engine.metrics().outstanding == 0


def test_an_unconstrained_neighbour_is_unaffected(engine):
    plain = text_request("ROMEO:\n", max_tokens=40, ignore_eos=True)
    beside_plain = submit_together(engine, [plain, text_request("KING HENRY:\n", max_tokens=40, ignore_eos=True)])
    beside_constrained = submit_together(engine, [plain, text_request("KING HENRY:\n", CASES["json_schema"][0],
                                                                      max_tokens=40)])
    a, b = (h[0].result(timeout=120) for h in (beside_plain, beside_constrained))
    assert a.token_ids == b.token_ids
    check_person(beside_constrained[1].result(timeout=120).content)


LONG = [  # constraints that take ~40-60 tokens, so four residents outgrow the pool below
    (JsonConstraint(schema={"type": "object", "properties": {"text": {"type": "string", "minLength": 120,
                                                                      "maxLength": 160}},
                            "required": ["text"], "additionalProperties": False}, whitespace="compact"),
     lambda t: jsonschema.validate(json.loads(t), {"properties": {"text": {"minLength": 120}}, "required": ["text"]})),
    (RegexConstraint(pattern="[A-Za-z ,.']{150,200}"),
     lambda t: re.fullmatch("[A-Za-z ,.']{150,200}", t) or pytest.fail(t)),
    (GrammarConstraint(grammar='root ::= line line line line\nline ::= [A-Za-z ,]{30,40} "\\n"'),
     lambda t: re.fullmatch("([A-Za-z ,]{30,40}\n){4}", t) or pytest.fail(repr(t))),
]


def workload():
    return [text_request("KING HENRY:\n", c, max_tokens=100) for c, _ in LONG] + \
        [text_request("ROMEO:\n", LONG[1][0], max_tokens=100, temperature=0.9, seed=7)]


@pytest.fixture(scope="module")
def alone(engine):
    return [engine.generate(r, timeout=120) for r in workload()]


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_pause_and_resume_keep_the_committed_matcher(alone, mode):
    # 9 pages of 16 positions cannot hold 4 residents of up to ~70 positions: pauses are forced
    with ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu", max_concurrency=4,
                                                                        context_cache=False, dtype="float32",
                                                                        page_size=16, num_pages=9,
                                                                        prefill_chunk=16, pause_mode=mode,
                                                                        host_budget_bytes=(64 << 20) if mode == "snapshot" else 0)) as eng:
        results = [h.result(timeout=300) for h in submit_together(eng, workload())]
        m = eng.metrics()
        assert m.preemptions > 0
        assert (m.preemptions_snapshot if mode == "snapshot" else m.preemptions_replay) == m.preemptions
        assert [r.token_ids for r in results] == [r.token_ids for r in alone]
        for r, (_, check) in zip(results, [*LONG, LONG[1]], strict=True):
            assert r.finish_reason is FinishReason.STOP, r
            check(r.content)
        assert eng.usage().all_free


def test_a_refused_token_ends_the_request_with_grammar(engine, monkeypatch):
    """With the masks switched off the model picks what it likes; the matcher refuses the first token outside
    the constraint, and the request ends there with what was valid."""
    free = engine.generate(text_request("KING HENRY:\n", max_tokens=8), timeout=120)
    tok = engine.frontend.tokenizer
    first = tok.decode(free.token_ids[:1])
    assert first and first.isalnum(), first  # the prefix below is a literal in the regex
    import ninfer.ops.sampling as sampling_ops

    monkeypatch.setattr(sampling_ops, "apply_token_mask", lambda logits, mask: logits)
    refused = engine.generate(text_request("KING HENRY:\n", RegexConstraint(pattern=first + "[0-9]{40}")), timeout=120)
    assert refused.finish_reason is FinishReason.GRAMMAR
    assert refused.content == first and refused.token_ids == free.token_ids[:1]
    nothing = engine.generate(text_request("KING HENRY:\n", ChoiceConstraint(choices=["\u00e6\u00e6\u00e6"])), timeout=120)
    assert nothing.finish_reason is FinishReason.GRAMMAR and nothing.token_ids == () and nothing.content == ""
    assert engine.usage().all_free


def test_a_failing_mask_fill_ends_its_request_alone(engine, monkeypatch):
    from ninfer.models.common.qwen.output_session import QwenOutputSession

    fill, open_session, doomed = QwenOutputSession.fill_token_mask, engine.frontend.open_session, []

    def opening(prompt, sampling, constraint=None, *, cancel=None):  # the choice request's session breaks
        session = open_session(prompt, sampling, constraint, cancel=cancel)
        if isinstance(constraint, ChoiceConstraint):
            doomed.append(session)
        return session

    def failing(self, out, drafts=()):
        if any(self is d for d in doomed):
            raise RuntimeError("fill broke")
        fill(self, out, drafts)

    monkeypatch.setattr(engine.frontend, "open_session", opening)
    monkeypatch.setattr(QwenOutputSession, "fill_token_mask", failing)
    handles = submit_together(engine, [text_request("ROMEO:\n", ChoiceConstraint(choices=["Juliet"])),
                                       text_request(*CASES["regex"][1:2], CASES["regex"][0]),
                                       text_request("ROMEO:\n", max_tokens=20, ignore_eos=True)])
    broken, regex, plain = (h.result(timeout=120) for h in handles)
    assert broken.finish_reason is FinishReason.ERROR and "fill broke" in broken.error
    assert broken.extra["error_kind"] == "request_failed"
    CASES["regex"][2](regex.content)
    assert plain.usage.completion_tokens == 20 and not engine.failed
    assert engine.usage().all_free


@pytest.mark.parametrize("seed", [1, 2])
def test_cancellations_and_deadlines_among_constrained_rows_leave_nothing_held(engine, seed):
    """Constrained and plain requests at once, some cancelled after their first output and some with a tiny
    deadline (a constrained row's sampling may still be waiting when its request ends): every request ends
    once, the engine stays healthy, and every slot and page is free again."""
    import random

    rng = random.Random(seed)
    kinds = sorted(CASES)
    requests = []
    for i in range(8):
        kind = rng.choice([*kinds, None])
        constraint, prompt = (CASES[kind][0], CASES[kind][1]) if kind else (None, "ROMEO:\n")
        request = text_request(prompt, constraint, max_tokens=40, ignore_eos=kind is None)
        if i % 4 == 3:
            request = GenerationRequest(input=request.input, sampling=request.sampling, constraint=constraint,
                                        deadline_s=0.001 * rng.randint(1, 50))
        requests.append(request)
    handles = submit_together(engine, requests)
    for i, h in enumerate(handles):
        if i % 4 == 1:
            next(iter(h))  # the start event, then cancel while it runs
            h.cancel()
    results = [h.result(timeout=120) for h in handles]
    assert all(r.finish_reason is not FinishReason.ERROR for r in results), results
    assert not engine.failed and engine.usage().all_free


def test_a_restored_prompt_is_constrained_from_its_first_token():
    """With the context cache on, a repeated prompt restores everything and its first token comes from a
    decode step: the mask applies there as it does after a prefill."""
    with ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu",
                                                                        dtype="float32")) as eng:
        constraint, prompt, check = CASES["json_schema"]
        first, again = (eng.generate(text_request(prompt, constraint), timeout=120) for _ in range(2))
        assert again.usage.cached_tokens > 0 and again.token_ids == first.token_ids
        check(again.content)


@pytest.mark.gpu
@pytest.mark.parametrize("ops", ["auto", "torch"])
def test_constrained_rows_on_cuda_with_graphs_and_pipelined_decode(monkeypatch, ops):
    """Every kind at once on the GPU (bf16, CUDA graphs, pipelined decode: a constrained row's sampling waits
    for the step before it to be committed): outputs valid, beside unconstrained rows, and nothing left held.
    ``ops=torch``: the mask applied by the torch reference instead of the Triton kernel."""
    monkeypatch.setenv("NINFER_OPS", ops)
    with ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cuda", max_concurrency=8,
                                                                        context_cache=False)) as eng:
        kinds = sorted(CASES)
        requests = [text_request(CASES[k][1], CASES[k][0]) for k in kinds]
        requests.append(chat_request("What is the weather in Paris this week?",
                                     ToolCallConstraint(tool_choice="required", parallel=False), tools=(WEATHER, CLOCK)))
        requests.append(text_request("ROMEO:\n", max_tokens=60, ignore_eos=True))  # unconstrained neighbour
        results = [h.result(timeout=300) for h in submit_together(eng, requests)]
        for kind, r in zip(kinds, results, strict=False):
            assert r.finish_reason is FinishReason.STOP, (kind, r)
            CASES[kind][2](r.content)
        call = results[len(kinds)]
        assert call.finish_reason is FinishReason.TOOL_CALLS and len(call.tool_calls) == 1, call
        assert results[-1].usage.completion_tokens == 60
        assert eng.usage().all_free


def outside_strings(text: str) -> str:
    """(Possibly cut-short) JSON ``text`` with each string, the last one perhaps unterminated, written ``""``."""
    return re.sub(r'"(\\.|[^"\\])*"?', '""', text)


BOUNDED_RUN = re.compile(r" |\n[ \t]{0,20}")  # docs/constrained-decoding.md, "Whitespace in JSON"


@pytest.mark.parametrize("whitespace", ["bounded", "compact"])
def test_json_whitespace_is_held_to_its_rule_when_sampled(engine, monkeypatch, whitespace):
    """Sampled at temperature 1 on a small budget, the embedded model's JSON never has a longer whitespace run than
    the rule allows; the engine's default (``EngineConfig.json_whitespace``) applies where the constraint sets none."""
    assert outside_strings('{"a \\" b": [1, {"c":\n  "d e') == '{"": [1, {"":\n  ""'  # the helper itself
    monkeypatch.setattr(engine, "config", attrs.evolve(engine.config, json_whitespace=whitespace))
    requests = [text_request("KING HENRY:\n", JsonConstraint(schema=schema), max_tokens=60, temperature=1.0, seed=seed)
                for seed, schema in enumerate((PERSON, PERSON, {"type": "object"}))]
    for handle in submit_together(engine, requests):
        text = handle.result(timeout=120).content
        json_part = outside_strings(text)
        runs = re.findall(r"\s+", json_part)
        assert all(BOUNDED_RUN.fullmatch(r) for r in runs) if whitespace == "bounded" else not runs, (runs, text)
        assert not re.search(r"\s[:,]|:\s\s|:\n", json_part), text  # nothing before ':' or ',', one space after ':'
