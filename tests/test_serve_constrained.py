"""Constrained decoding end to end: a real ``ninfer serve`` process with the embedded model, driven by the official
``openai`` client and raw httpx. Each kind of constraint yields output of that kind (a JSON instance of the
schema, a full regex match, one of the choices, a sentence of the grammar, tool calls whose arguments fit their
tool), whole and streamed; a constraint the grammar compiler refuses answers 400 naming the problem.

Greedy throughout, so every run sees the same outputs; the schemas are small (enums, bounded integers, short
strings) so that any valid output fits in the token budget."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer import env
from ninfer_serve.testing import ServerProcess

MODEL_ID = "verse"
# Enough for any output of these constraints: a gap in a JSON value holds at most a newline and 20 spaces or tabs
# (docs/constrained-decoding.md, "Whitespace in JSON"), so RATING's longest instance is well under 250 tokens.
MAX_TOKENS = 400
DEVICE = env.get("NINFER_SERVE_TEST_DEVICE")
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Tell me of the king."}]
RATING = {"type": "object", "properties": {
    "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    "stars": {"type": "integer", "minimum": 1, "maximum": 5},
    "word": {"type": "string", "maxLength": 6}},
    "required": ["colour", "stars", "word"], "additionalProperties": False}
# Tool parameters the tiny model cannot run on with: a free string argument is text it continues to the token limit.
WEATHER = {"type": "object", "properties": {
    "days": {"type": "integer", "minimum": 1, "maximum": 7}, "metric": {"type": "boolean"}},
    "required": ["days", "metric"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for some days.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in some hours.",
                                           "parameters": {"type": "object", "properties": {
                                               "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
                                               "required": ["hours"], "additionalProperties": False}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# A sentence of GREETING is "hail" or "good morrow", a space, then a name of 2 to 8 lower-case letters.
GREETING = 'root ::= greeting " " name\ngreeting ::= "hail" | "good morrow"\nname ::= [a-z] [a-z] [a-z]{0,6}'
GREETING_LARK = 'start: GREETING " " NAME\nGREETING: "hail" | "good morrow"\nNAME: /[a-z]{2,8}/'


def is_greeting(text: str) -> bool:
    for greeting in ("hail ", "good morrow "):
        if text.startswith(greeting):
            name = text[len(greeting):]
            return 2 <= len(name) <= 8 and all("a" <= ch <= "z" for ch in name)
    return False


@pytest.fixture(scope="module")
def server():
    with ServerProcess(None, "--model-id", MODEL_ID, "--max-concurrency", "4", "--device", DEVICE,
                       "--max-model-len", "2048", "--no-warmup") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(model=MODEL_ID, extra_body={**NO_THINK, **extra}, **kw)


def complete(client, **kw):
    kw.setdefault("prompt", "KING.\n")
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL_ID, **kw)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL_ID, "temperature": 0, **body}, timeout=300)


def test_response_format_json_schema(client):
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": RATING,
                                                                             "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), RATING)
    # llama.cpp's spelling: a schema beside json_object
    r = chat(client, response_format={"type": "json_object", "schema": RATING})
    assert r.choices[0].message.content == choice.message.content


def test_structured_outputs_each_kind(client):
    r = chat(client, extra_body={"structured_outputs": {"choice": ["ay", "nay", "perchance"]}})
    assert r.choices[0].message.content in ("ay", "nay", "perchance") and r.choices[0].finish_reason == "stop"
    r = chat(client, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", r.choices[0].message.content), r.choices[0].message.content
    for grammar in (GREETING, GREETING_LARK):
        r = chat(client, extra_body={"structured_outputs": {"grammar": grammar}})
        assert is_greeting(r.choices[0].message.content), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    r = chat(client, extra_body={"structured_outputs": {"json": json.dumps(RATING), "disable_any_whitespace": True}})
    content = r.choices[0].message.content
    jsonschema.validate(json.loads(content), RATING)
    assert json.dumps(json.loads(content), separators=(",", ":")) == content  # compact: no whitespace


def test_disable_any_whitespace_beside_response_format(client):
    """vLLM's spelling for response_format: a structured_outputs holding only the option."""
    rating = {"type": "json_schema", "json_schema": {"name": "rating", "schema": RATING}}
    r = chat(client, response_format=rating, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    content = r.choices[0].message.content
    jsonschema.validate(json.loads(content), RATING)
    assert json.dumps(json.loads(content), separators=(",", ":")) == content
    r = chat(client, response_format=rating)  # the server's default: bounded runs
    content = r.choices[0].message.content
    jsonschema.validate(json.loads(content), RATING)
    outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', content)
    assert all(re.fullmatch(r" |\n[ \t]{0,20}", run) for run in re.findall(r"\s+", outside_strings)), content
    assert not re.search(r"\s[:,]|:\s\s|:\n", outside_strings), content


def test_completions_constraints(client):
    r = complete(client, extra_body={"structured_outputs": {"regex": "(thou|thee|thy) [a-z]{1,8}"}})
    assert re.fullmatch("(thou|thee|thy) [a-z]{1,8}", r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    r = complete(client, extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": RATING}}})
    jsonschema.validate(json.loads(r.choices[0].text), RATING)
    r = complete(client, extra_body={"grammar": GREETING})  # llama.cpp's fields
    assert is_greeting(r.choices[0].text), r.choices[0].text
    r = complete(client, extra_body={"json_schema": RATING})
    jsonschema.validate(json.loads(r.choices[0].text), RATING)


def check_calls(choice, names: set[str]) -> None:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_and_named(client):
    # parallel_tool_calls=false: the tiny model, allowed more calls, makes them until the token limit
    r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    check_calls(r.choices[0], set(PARAMETERS))
    assert len(r.choices[0].message.tool_calls) == 1
    r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
             parallel_tool_calls=False)
    check_calls(r.choices[0], {"get_time"})
    assert len(r.choices[0].message.tool_calls) == 1


def test_a_constrained_string_argument_is_one_of_its_enum(client):
    zone = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_zone_time", "parameters": zone}}
    r = chat(client, tools=[tool], tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), zone)


# A strict tool whose every value the tiny model must end (bounded strings, enums, integers in a range, small arrays).
BOOKING = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]},
    "nights": {"type": "integer", "minimum": 1, "maximum": 9},
    "guest": {"type": "object", "properties": {"vip": {"type": "boolean"}}, "required": ["vip"],
              "additionalProperties": False},
    "rooms": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2},
    "note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]}},
    "required": ["city", "unit", "nights"], "additionalProperties": False}


def test_strict_tool_calls_over_seeds_keep_their_schema(client):
    """Sampled (temperature 1, two seeds, n=4), every constrained call validates against its strict schema:
    the grammar and the tool-call parser agree (docs/serving.md, "Tool calls")."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "book", "strict": True, "parameters": BOOKING}}]
    schemas = {**PARAMETERS, "book": BOOKING}
    calls = 0
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "book"}}]):
        r = chat(client, tools=tools, tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=seed, n=4)
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c
            (call,) = c.message.tool_calls
            assert choice == "required" or call.function.name == "book"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            calls += 1
    assert calls == 8


def test_streamed_output_is_the_whole_output(client):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "rating", "schema": RATING}}}
    whole = chat(client, **body).choices[0]
    chunks = list(chat(client, stream=True, **body))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    jsonschema.validate(json.loads(text), RATING)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    tools = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    whole = chat(client, **tools).choices[0]
    chunks = list(chat(client, stream=True, **tools))
    calls: dict[int, list[str]] = {}
    for part in (tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []):
        entry = calls.setdefault(part.index, ["", ""])
        entry[0] += part.function.name or ""
        entry[1] += part.function.arguments or ""
    assert [[c.function.name, c.function.arguments] for c in whole.message.tool_calls] == \
        [calls[i] for i in sorted(calls)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema",
     "uniqueItems cannot be enforced"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs.regex",
     "Lookahead is not supported"),
    ("/v1/completions", {"structured_outputs": {"grammar": 'root ::= "a" undefined_rule'}},
     "structured_outputs.grammar", 'Rule "undefined_rule" is not defined'),
    ("/v1/completions", {"grammar": 'root ::= ("a"'}, "grammar", "EBNF parser error at line 1"),
    ("/v1/chat/completions", {"json_schema": {"type": "string", "format": "colour"}}, "json_schema",
     "string format 'colour' is not supported"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools", "tools[0].function.parameters/properties/a: uniqueItems"),
])
def test_a_constraint_the_compiler_refuses_is_a_400_naming_it(server, path, body, param, words):
    prompt = {"messages": ASK, **NO_THINK} if path.endswith("chat/completions") else {"prompt": "KING.\n"}
    r = post(server, path, {**prompt, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_constraint"
    assert err["param"] == param and words in err["message"], err


def test_a_malformed_field_is_a_400_naming_it(server):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "structured_outputs": {"regex": "(open"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"
    r = post(server, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                              "response_format": {"type": "json_object"}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format" and "'tool_choice' (required)" in err["message"]


# ---------------------------------------------------------------- fuzz: whatever the constraint fields, never a 5xx

TEXT = st.one_of(st.text(max_size=16), st.text(alphabet='root:=|"()[]{}*+?,.^$\\ a-z0-9\nstart', max_size=24),
                 st.sampled_from(["", "root ::= ", 'root ::= "a"', "start: /a+/", "(?=a)", "a{2,1}", "\\", "{}"]))
SCHEMA_KEYS = st.sampled_from(["type", "properties", "items", "enum", "const", "required", "minimum", "maximum",
                               "minLength", "maxLength", "pattern", "format", "anyOf", "oneOf", "$ref", "$defs",
                               "additionalProperties", "minItems", "maxItems", "prefixItems", "uniqueItems"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**12), st.floats(allow_nan=False, allow_infinity=False), TEXT,
                    st.sampled_from(["string", "integer", "number", "object", "array", "boolean", "null", "#",
                                     "#/$defs/a", "email", "date"]))
SCHEMAS = st.recursive(st.dictionaries(SCHEMA_KEYS, SCALARS, max_size=3),
                       lambda inner: st.one_of(st.dictionaries(SCHEMA_KEYS, inner, max_size=3),
                                               st.dictionaries(TEXT, inner, max_size=3), st.lists(inner, max_size=3)),
                       max_leaves=10)
FIELDS = st.one_of(
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "structural_tag", "x"])},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"name": TEXT, "schema": SCHEMAS,
                                                                     "strict": st.booleans()}),
                  "schema": SCHEMAS})}),
    st.fixed_dictionaries({"structured_outputs": st.fixed_dictionaries({}, optional={
        "json": st.one_of(SCHEMAS, TEXT), "regex": TEXT, "choice": st.lists(TEXT, max_size=4), "grammar": TEXT,
        "json_object": st.booleans(), "disable_any_whitespace": st.booleans()})}),
    st.fixed_dictionaries({}, optional={"grammar": TEXT, "json_schema": SCHEMAS}),
    st.fixed_dictionaries({"tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                                             st.fixed_dictionaries({"name": TEXT}, optional={
                                                 "parameters": SCHEMAS, "strict": st.booleans()})}), max_size=2),
                           "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
                               {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT})}))}),
)


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=FIELDS, chat_endpoint=st.booleans())
def test_fuzz_constraint_fields_never_5xx(server, fields, chat_endpoint):
    if chat_endpoint:
        path, body = "/v1/chat/completions", {"messages": ASK, **NO_THINK}
    else:
        path, body = "/v1/completions", {"prompt": "KING.\n"}
        fields = {k: v for k, v in fields.items() if k not in ("tools", "tool_choice")}
    r = post(server, path, {**body, "max_tokens": 4, **fields})
    assert r.status_code in (200, 400), (fields, r.status_code, r.text[:500])
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text[:500]
