"""Constrained tool calls keep their schema: the tool-call grammar and the tool-call parser agree exactly.

A random walk over the tokens the real grammar (``build_grammar``) allows writes hundreds of calls over many
schemas (required, enums, numbers, integers, booleans, null, nested objects, arrays, ``$ref``, bounded and patterned
strings, ``additionalProperties: false``); each is tokenized with the real Qwen3.5 vocabulary and read back by the
real OutputSession in strict mode, in random rows. Every call must name an offered function and validate against its
tool's schema with ``jsonschema``, and read back the values the walk wrote. The walk's vocabulary is full of the
parser's boundaries (``<parameter=location>``, ``</function>``, ``</parameter>``...) so values hold them where the
grammar allows.
"""

from __future__ import annotations

import json
import random

import pytest

from ninfer.contract import ChatInput, FinishReason, ToolCallConstraint
from ninfer.contract.constraint import ConstraintError
from ninfer.models.common.grammar.build import build_grammar
from ninfer.models.common.qwen import QwenFrontend
from ninfer.models.common.qwen.output_session import QwenOutputSession
from ninfer_qwen35.testing.qwen_vocab import qwen35_frontend_resources

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

IM_END = 248046


def fn(name, properties, required=(), **extra):
    params = {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False,
              **extra}
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": params}}


WEATHER = fn("get_weather", {"city": {"type": "string"}, "location": {"type": "string"},
                             "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])
NUMBERS = fn("measure", {"n": {"type": "integer", "minimum": -3, "maximum": 40}, "x": {"type": "number"},
                         "ok": {"type": "boolean"}, "nothing": {"type": "null"}}, ["n", "ok"])
NESTED = fn("book", {"guest": {"type": "object", "properties": {"name": {"type": "string"},
                                                                "age": {"type": "integer"}},
                               "required": ["name"], "additionalProperties": False},
                     "rooms": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                     "tags": {"type": "array", "items": {"type": "string"}}}, ["guest"])
PYDANTIC = fn("plan", {"when": {"$ref": "#/$defs/Slot"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                       "size": {"$ref": "#/$defs/Size"}, "code": {"type": "string", "maxLength": 5},
                       "day": {"type": "string", "pattern": "^[0-9]{2}$"}, "kind": {"const": "trip"},
                       "mix": {"enum": [1, "a", None]}}, ["when", "note", "size", "kind"],
              **{"$defs": {"Slot": {"type": "object", "properties": {"hour": {"type": "integer"}},
                                    "required": ["hour"], "additionalProperties": False},
                           "Size": {"type": "string", "enum": ["S", "M", "L"]}}})
EMPTY = fn("ping", {})
SCHEMAS = [(WEATHER,), (NUMBERS,), (NESTED,), (PYDANTIC,), (EMPTY, WEATHER), (WEATHER, NUMBERS, NESTED, PYDANTIC)]
BOUNDARIES = ["<parameter=location>", "<parameter=city>\n", "<parameter=", "</parameter>", "\n</parameter>\n",
              "</function>", "</function>\n</tool_call>", "<tool_call>", "</tool_call>", "<function=get_weather>",
              "<think>", "</think>"]
PIECES = ["\n", "\t", " ", "null", "true", "false", "Mantua", "é", "🤖", "\\n", "\\u003c", '"', "{", "}", "[", "]",
          ",", ":", "-", ".", "e", "0", "1", "7", "42", "celsius", "fahrenheit", "trip", "S", "M", "a",
          *[chr(c) for c in range(33, 127)]]


def names_of(tools):
    return [t["function"]["name"] for t in tools]


def vocabulary(tools):
    words = set(BOUNDARIES) | set(PIECES)
    for tool in tools:
        f = tool["function"]
        words.add(f"<tool_call>\n<function={f['name']}>\n")
        for key in f["parameters"]["properties"]:
            words.add(f"<parameter={key}>\n")
    return sorted(words)


class Walker:
    """Random sentences of a grammar over a small text vocabulary (token ``len(words)`` is the end)."""

    def __init__(self, grammar, words):
        self.words = words
        self.eos = len(words)
        info = xgr.TokenizerInfo([*words, ""], xgr.VocabType.RAW, vocab_size=len(words) + 1, stop_token_ids=[self.eos])
        self.compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(grammar)
        self.closers = {i for i, w in enumerate(words) if w.startswith(("\n</parameter>", "</function>", '"', "}", "]"))}
        self.closers.add(self.eos)
        self.structural = {i for i, w in enumerate(words) if len(w) > 1}

    def allowed(self, matcher, mask) -> list[int]:
        matcher.fill_next_token_bitmask(mask)
        words = mask[0].tolist()
        return [i for i in range(self.eos + 1) if (words[i // 32] >> (i % 32)) & 1]

    def walk(self, rng: random.Random, limit: int = 500) -> str | None:
        matcher = xgr.GrammarMatcher(self.compiled)
        mask = xgr.allocate_token_bitmask(1, self.eos + 1)
        out = []
        for step in range(limit):
            allowed = self.allowed(matcher, mask)
            assert allowed, "the grammar allows nothing before it ended"
            closing = [t for t in allowed if t in self.closers]
            structural = [t for t in allowed if t in self.structural]
            if closing and rng.random() < min(0.9, step / 80):
                token = rng.choice(closing)
            elif structural and rng.random() < 0.35:
                token = rng.choice(structural)
            else:
                token = rng.choice(allowed)
            assert matcher.accept_token(token)
            if token == self.eos:
                assert matcher.is_terminated()
                return "".join(out)
            out.append(self.words[token])
        return None


@pytest.fixture(scope="module")
def frontend():
    return QwenFrontend.from_resources(qwen35_frontend_resources(), chat_template_override="builtin:qwen3_5")


def read_back(frontend, tools, text, rng):
    """The calls a strict session reads from ``text`` (the turn), fed in random rows of real tokens."""
    prompt = frontend.prepare(ChatInput(messages=({"role": "user", "content": "?"},), tools=tools,
                                        template_kwargs={"enable_thinking": False}))
    session = QwenOutputSession(frontend.tokenizer, stop_token_ids=[IM_END], tools=prompt.tools,
                                turn_end_id=IM_END, strict_tool_calls=True)
    tokens = [*frontend.tokenizer.encode(text), IM_END]
    i, finish = 0, None
    while finish is None:
        row = tokens[i:i + rng.randint(1, 6)]
        preview = session.preview(row)
        session.commit(preview)
        i += preview.accepted
        finish = preview.finish_reason
    return session, finish


def check_calls(tools, choice, session, finish, text):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if choice == "auto":  # free text around the calls
        assert finish in (FinishReason.TOOL_CALLS, FinishReason.STOP), text
    else:
        assert finish is FinishReason.TOOL_CALLS, text
        assert session.content == "" and session.tool_calls, text
    for call in session.tool_calls:
        assert call.name in params and choice in ("required", "auto", call.name), text
        args = json.loads(call.arguments)
        jsonschema.validate(args, params[call.name])
        assert set(args) <= set(params[call.name]["properties"]), text


@pytest.mark.parametrize("case", range(len(SCHEMAS)))
def test_every_constrained_call_validates_against_its_schema(frontend, case):
    tools = SCHEMAS[case]
    rng = random.Random(case)
    calls = 0
    for choice in ("required", names_of(tools)[-1], "auto"):
        for parallel in (True, False):
            grammar = build_grammar(ToolCallConstraint(tool_choice=choice, parallel=parallel), reasoning_open=False,
                                    tools=tools)
            walker = Walker(grammar, vocabulary(tools))
            for _ in range(12):
                text = walker.walk(rng)
                if text is None:  # ran past the walk's limit: not a sentence yet
                    continue
                session, finish = read_back(frontend, tools, text, rng)
                check_calls(tools, choice, session, finish, text)
                if not parallel:
                    assert len(session.tool_calls) <= 1
                calls += len(session.tool_calls)
    assert calls >= 50


def test_a_value_holding_parameter_markup_stays_one_value(frontend):
    """The reported bug: a strict string value holding ``<parameter=location>`` (allowed by the grammar) was split
    by the parser into a second parameter, giving ``{"city": "", "location": "Mantua"}``."""
    tools = (WEATHER,)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n\n<parameter=location>\nMantua\n</parameter>\n"
            "</function>\n</tool_call>")
    grammar = build_grammar(ToolCallConstraint(tool_choice="required"), reasoning_open=False, tools=tools)
    assert xgr.testing._is_grammar_accept_string(grammar, text)
    session, finish = read_back(frontend, tools, text, random.Random(0))
    check_calls(tools, "required", session, finish, text)
    assert json.loads(session.tool_calls[0].arguments) == {"city": "\n<parameter=location>\nMantua"}
    # the grammar never lets a raw value hold </parameter>, nor a parameter the schema does not declare
    for bad in ("<tool_call>\n<function=get_weather>\n<parameter=city>\na</parameter>b\n</parameter>\n</function>\n"
                "</tool_call>",
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=zip>\n1\n"
                "</parameter>\n</function>\n</tool_call>",
                "<tool_call>\n<function=get_weather>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n"
                "</tool_call>"):
        assert not xgr.testing._is_grammar_accept_string(grammar, bad)


def test_json_values_end_where_their_json_ends(frontend):
    tools = (NESTED,)
    text = ('<tool_call>\n<function=book>\n<parameter=guest>\n{"name": "a</parameter>\\n<parameter=rooms>"}\n'
            "</parameter>\n</function>\n</tool_call>")
    grammar = build_grammar(ToolCallConstraint(tool_choice="book"), reasoning_open=False, tools=tools)
    assert xgr.testing._is_grammar_accept_string(grammar, text)
    session, finish = read_back(frontend, tools, text, random.Random(1))
    check_calls(tools, "book", session, finish, text)
    assert json.loads(session.tool_calls[0].arguments) == {"guest": {"name": "a</parameter>\n<parameter=rooms>"}}


def test_reasoning_before_constrained_calls_holds_no_call():
    grammar = build_grammar(ToolCallConstraint(tool_choice="required"), reasoning_open=True, tools=(WEATHER,))
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n</tool_call>"
    assert xgr.testing._is_grammar_accept_string(grammar, "hm</think>\n\n" + call)
    assert not xgr.testing._is_grammar_accept_string(grammar, "hm" + call + "</think>\n\n" + call)


def test_without_a_constraint_a_call_to_an_unoffered_function_stays_content(frontend):
    prompt = frontend.prepare(ChatInput(messages=({"role": "user", "content": "?"},), tools=(WEATHER,),
                                        template_kwargs={"enable_thinking": False}))
    session = frontend.open_session(prompt, frontend.sampling_defaults())
    text = "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"
    preview = session.preview([*frontend.tokenizer.encode(text), IM_END])
    session.commit(preview)
    assert preview.finish_reason is FinishReason.STOP
    assert session.tool_calls == () and session.content == text


@pytest.mark.parametrize("tool, words", [
    (fn("a>b", {}), "function.name"),
    (fn("f", {"x>y": {"type": "string"}}), "property 'x>y'"),
    (fn("f", {"x": {"type": "string"}}, ["y"]), "requires 'y'"),
])
def test_names_the_format_cannot_carry_are_refused(tool, words):
    with pytest.raises(ConstraintError, match=words):
        build_grammar(ToolCallConstraint(tool_choice="required"), reasoning_open=False, tools=(tool,))
