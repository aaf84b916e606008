"""Constrained decoding over HTTP, translation only: each OpenAI / vLLM / llama.cpp field becomes the right
``GenerationRequest.constraint``, and every malformed or conflicting field is a 400 naming the parameter."""

from __future__ import annotations

import json

import pytest

from ninfer.contract import (
    ChoiceConstraint,
    GrammarConstraint,
    JsonConstraint,
    RegexConstraint,
    ToolCallConstraint,
)
from ninfer.contract.events import FinishReason
from ninfer_serve.constraints import grammar_syntax
from ninfer_serve.errors import APIError
from ninfer_serve.responses import finish_reason
from ninfer_serve.schemas import ChatCompletionRequest, CompletionRequest, structure
from ninfer_serve.translate import chat_request, completion_request

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
STRICT_TOOLS = [TOOLS[0], {"type": "function", "function": {**TOOLS[1]["function"], "strict": True}}]
GBNF = 'root ::= "yes" | "no"'
LARK = 'start: "yes" | "no"'


def chat(**kw):
    return chat_request(structure({"messages": USER, **kw}, ChatCompletionRequest))[0]


def completion(**kw):
    return completion_request(structure({"prompt": "Once", **kw}, CompletionRequest))[0]


def err(fn, **kw) -> APIError:
    with pytest.raises(APIError) as info:
        fn(**kw)
    assert info.value.status == 400
    body = info.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    return info.value


def schema_of(constraint) -> object:
    assert isinstance(constraint, JsonConstraint)
    return constraint.schema_object


# ---------------------------------------------------------------- each field -> its constraint


def test_no_constraint_fields_no_constraint():
    assert chat().constraint is None and completion().constraint is None
    assert chat(response_format={"type": "text"}).constraint is None
    assert completion(response_format={"type": "text"}).constraint is None


@pytest.mark.parametrize("make", [chat, completion])
def test_response_format(make):
    assert schema_of(make(response_format={"type": "json_object"}).constraint) == {"type": "object"}
    # llama.cpp's extension: a schema beside json_object
    assert schema_of(make(response_format={"type": "json_object", "schema": SCHEMA}).constraint) == SCHEMA
    c = make(response_format={"type": "json_schema", "json_schema": {
        "name": "my_Schema-1", "description": "d", "schema": SCHEMA, "strict": True}}).constraint
    assert schema_of(c) == SCHEMA and c.whitespace is None  # the server's default
    # llama.cpp clients send json_schema without a name
    assert schema_of(make(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}).constraint) == \
        SCHEMA


@pytest.mark.parametrize("make", [chat, completion])
def test_structured_outputs(make):
    def so(**fields):
        return make(structured_outputs=fields).constraint

    assert schema_of(so(json=SCHEMA)) == SCHEMA
    assert schema_of(so(json=json.dumps(SCHEMA))) == SCHEMA  # a schema as JSON text
    assert so(json=SCHEMA, disable_any_whitespace=True) == JsonConstraint(schema=SCHEMA, whitespace="compact")
    assert so(json=SCHEMA, disable_any_whitespace=False) == JsonConstraint(schema=SCHEMA, whitespace="bounded")
    assert so(json_object=True) == JsonConstraint(schema={"type": "object"})
    assert so(json_object=True, disable_any_whitespace=True).whitespace == "compact"
    assert so(regex=r"\d{3}") == RegexConstraint(pattern=r"\d{3}")
    assert so(choice=["red", "green"]) == ChoiceConstraint(choices=("red", "green"))
    assert so(grammar=GBNF) == GrammarConstraint(grammar=GBNF, syntax="gbnf")
    assert so(grammar=LARK) == GrammarConstraint(grammar=LARK, syntax="lark")


@pytest.mark.parametrize("make", [chat, completion])
def test_disable_any_whitespace_applies_to_any_json_field(make):
    """vLLM's spelling for response_format: structured_outputs holding only the option, beside it."""
    json_schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    for flag, whitespace in ((True, "compact"), (False, "bounded")):
        only = {"disable_any_whitespace": flag}
        assert make(response_format=json_schema, structured_outputs=only).constraint == \
            JsonConstraint(schema=SCHEMA, whitespace=whitespace)
        assert make(response_format={"type": "json_object"}, structured_outputs=only).constraint.whitespace == \
            whitespace
        assert make(json_schema=SCHEMA, structured_outputs=only).constraint.whitespace == whitespace
    # false asks for nothing a non-JSON or absent constraint could refuse
    assert make(structured_outputs={"regex": "a", "disable_any_whitespace": False}).constraint == \
        RegexConstraint(pattern="a")
    assert make(structured_outputs={"disable_any_whitespace": False}).constraint is None


@pytest.mark.parametrize("make", [chat, completion])
def test_llama_cpp_fields(make):
    assert make(grammar=GBNF).constraint == GrammarConstraint(grammar=GBNF)
    assert schema_of(make(json_schema=SCHEMA).constraint) == SCHEMA
    assert make(json_schema={}).constraint == JsonConstraint(schema=None)  # {}: any JSON value


def test_grammar_syntax_detection():
    assert grammar_syntax(GBNF) == "gbnf"
    assert grammar_syntax('root ::= start\nstart ::= "x"') == "gbnf"
    assert grammar_syntax('start ::= "x"') == "gbnf"
    assert grammar_syntax('// a lark grammar\n?start: item+\nitem: "a"') == "lark"
    assert grammar_syntax('  start : "x"') == "lark"


def test_tool_choice():
    assert chat(tools=TOOLS, tool_choice="required").constraint == ToolCallConstraint(tool_choice="required")
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.constraint == ToolCallConstraint(tool_choice="get_time")
    assert named.input.tools[1]["function"]["name"] == "get_time"  # the tools still reach the template
    single = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).constraint
    assert single == ToolCallConstraint(tool_choice="required", parallel=False)
    # auto constrains only when a tool asks for strict arguments (vLLM's rule); auto is the default with tools
    assert chat(tools=TOOLS, tool_choice="auto").constraint is None
    assert chat(tools=TOOLS).constraint is None
    assert chat(tools=STRICT_TOOLS, tool_choice="auto").constraint == ToolCallConstraint(tool_choice="auto")
    assert chat(tools=STRICT_TOOLS).constraint == ToolCallConstraint(tool_choice="auto")
    # none: no constraint, and the tools stay out of the prompt
    none = chat(tools=STRICT_TOOLS, tool_choice="none")
    assert none.constraint is None and none.input.tools == ()


def test_tool_choice_none_leaves_room_for_response_format():
    c = chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}).constraint
    assert schema_of(c) == {"type": "object"}
    assert schema_of(chat(tools=TOOLS, tool_choice="auto", structured_outputs={"json": SCHEMA}).constraint) == SCHEMA


def test_grammar_finish_reason():
    assert finish_reason(FinishReason.GRAMMAR) == "grammar"


# ---------------------------------------------------------------- bad input -> 400 naming the parameter


@pytest.mark.parametrize("kw,param,words", [
    # response_format
    ({"response_format": {"type": "json"}}, "response_format.type", '"json_schema"'),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name", "1 to 64 characters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}},
     "response_format.json_schema.name", "1 to 64 characters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": SCHEMA}}},
     "response_format.json_schema.name", "1 to 64 characters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema", "expected an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}},
     "response_format.json_schema.extra", "Unrecognized"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "expected a boolean"),
    ({"response_format": {"type": "json_schema", "schema": SCHEMA}}, "response_format.schema",
     "json_schema.schema"),
    ({"response_format": {"type": "text", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema",
     "goes with type 'json_schema'"),
    ({"response_format": {"type": "json_object", "schema": "{}"}}, "response_format.schema", "expected an object"),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}, "response_format.type",
     "not supported"),
    ({"response_format": {"type": "json_object", "format": {}}}, "response_format.format", "structural_tag"),
    ({"response_format": "json"}, "response_format", "expected an object"),
    # structured_outputs
    ({"structured_outputs": {}}, "structured_outputs", "needs one of"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "needs one of"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex", "one kind"),
    ({"structured_outputs": {"choice": ["a"], "grammar": GBNF}}, "structured_outputs.grammar", "'choice' and"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs.backend", "Unrecognized"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "'json' and 'json_object' only"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace",
     "applies to JSON output"),
    ({"structured_outputs": {"disable_any_whitespace": True}, "grammar": GBNF},
     "structured_outputs.disable_any_whitespace", "applies to JSON output"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json", "must be an object"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json", "expected an object or a string"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "empty"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]", "expected a string"),
    ({"structured_outputs": {"choice": ["x"] * 1025}}, "structured_outputs.choice", "at most 1024"),
    ({"structured_outputs": {"grammar": "  \n"}}, "structured_outputs.grammar", "empty"),
    ({"structured_outputs": "regex"}, "structured_outputs", "expected an object"),
    # llama.cpp fields
    ({"grammar": ""}, "grammar", "empty"),
    ({"grammar": 5}, "grammar", "expected a string"),
    ({"json_schema": "{}"}, "json_schema", "expected an object"),
    ({"grammar": GBNF, "json_schema": {}}, "grammar", "'json_schema' and 'grammar'"),
    # two fields asking for a constraint
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex", "'response_format' (json_object) and 'structured_outputs' (regex)"),
    ({"response_format": {"type": "json_object"}, "grammar": GBNF}, "grammar", "'response_format'"),
    ({"structured_outputs": {"choice": ["a"]}, "json_schema": SCHEMA}, "json_schema", "'structured_outputs'"),
])
@pytest.mark.parametrize("make", [chat, completion])
def test_bad_constraint_fields_are_a_400_naming_the_parameter(make, kw, param, words):
    e = err(make, **kw)
    assert e.param == param and words in e.message, (e.param, e.message)


@pytest.mark.parametrize("kw,param,words", [
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}}, "response_format.json_schema.schema",
     "'tool_choice' (required) and 'response_format' (json_schema)"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice", "'tool_choice' (function 'get_time')"),
    ({"tools": STRICT_TOOLS, "grammar": GBNF}, "grammar", "'tool_choice' (auto, with a strict tool) and 'grammar'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not among 'tools' (get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name",
     "missing required parameter"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "get_time"}}}, "tool_choice.type",
     '"function"'),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "expected"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "expected a boolean"),
])
def test_bad_tool_choice_is_a_400_naming_the_parameter(kw, param, words):
    e = err(chat, **kw)
    assert e.param == param and words in e.message, (e.param, e.message)


def test_unknown_fields_stay_unknown_on_completions():
    e = err(completion, tools=TOOLS)
    assert e.param == "tools" and "Unrecognized" in e.message


# ---------------------------------------------------------------- the engine's refusal


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs.regex"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "required"}, "tools"),
    ("/v1/completions", {"prompt": "Once", "grammar": GBNF}, "grammar"),
    ("/v1/completions", {"prompt": "Once", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_a_constraint_the_engine_refuses_is_a_400_naming_the_field(engine, client, path, body, param):
    from ninfer.engine.errors import InvalidConstraint

    engine.next = InvalidConstraint("invalid constraint: the regex is not valid: lookahead is not supported")
    r = client(engine).post(path, json=body)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "invalid constraint: the regex is not valid: lookahead is not supported",
                                  "type": "invalid_request_error", "param": param, "code": "invalid_constraint"}}
    assert engine.submitted[0].constraint is not None


def test_other_rejections_keep_their_param(engine, client):
    from ninfer.engine.errors import InputTooLong

    engine.next = InputTooLong("the prompt is too long")
    r = client(engine).post("/v1/chat/completions", json={"messages": USER, "structured_outputs": {"regex": "a"}})
    assert r.status_code == 400 and r.json()["error"]["param"] is None and r.json()["error"]["code"] == "too_long"
