"""Whitespace in JSON output (docs/constrained-decoding.md, "Whitespace in JSON"), at the grammar (CPU, no model).

Bounded (the default): nothing before ``:`` and ``,``, at most one space after ``:``, and elsewhere nothing, one
space, or one newline and at most MAX_JSON_INDENT spaces or tabs, so compact and pretty-printed JSON pass and a
longer run is refused. Compact:
no whitespace at all outside strings. The rewrite never touches a schema's own strings or patterns, recognises
every run xgrammar writes (every schema of the JSONSchemaBench sample builds), and bounds the tool-call
formats' JSON values as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from ninfer.contract import EngineConfig, JsonConstraint
from ninfer.contract.constraint import MAX_JSON_INDENT, ConstraintError
from ninfer.models.common.grammar.build import build_grammar
from ninfer.models.common.grammar.whitespace import WS_MARK, bound_whitespace, bounded_text

xgr = pytest.importorskip("xgrammar")

SAMPLE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "jsonschemabench_sample.jsonl"
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0},
    "status": {"enum": ["open", "paid", "void"]},
    "total": {"type": "number"},
    "note": {"type": "string"},
    "customer": {"type": "object", "properties": {"name": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["name"], "additionalProperties": False},
    "lines": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
    "required": ["id", "status", "customer"], "additionalProperties": False}
INSTANCE = {"id": 7, "status": "paid", "total": -1.5e3, "note": "a  b\tc",
            "customer": {"name": "Ann  Lee", "tags": ["x y", ""]}, "lines": [{"sku": "k 1", "qty": 2}, {"sku": "z", "qty": 0}]}


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])  # the matcher below is fed strings, not tokens
    return xgr.GrammarCompiler(info, max_threads=1)


def accepts(compiler, grammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


def grammar(schema=ORDER, whitespace="bounded"):
    return build_grammar(JsonConstraint(schema=schema, whitespace=whitespace), reasoning_open=False, tools=())


def test_the_whitespace_option_is_validated():
    assert JsonConstraint().whitespace is None  # the engine's default
    assert EngineConfig().json_whitespace == "bounded"
    assert EngineConfig(json_whitespace="compact").json_whitespace == "compact"
    with pytest.raises(ValueError, match="whitespace"):
        JsonConstraint(whitespace="any")
    with pytest.raises(ValueError, match="json_whitespace must be one of bounded, compact"):
        EngineConfig(json_whitespace=None)


@pytest.mark.parametrize("text", [
    json.dumps(INSTANCE, separators=(",", ":")),  # compact
    json.dumps(INSTANCE),  # ", " and ": "
    json.dumps(INSTANCE, indent=2),
    json.dumps(INSTANCE, indent=4),
    json.dumps(INSTANCE, indent="\t"),
    '{ "id": 7, "status": "open", "customer": { "name": "" } }',
    '{\n' + " " * MAX_JSON_INDENT + '"id": 1, "status": "void", "customer": {"name": "a"}}',
])
def test_bounded_admits_compact_and_pretty_printed_json(compiler, text):
    assert accepts(compiler, grammar(), text)


@pytest.mark.parametrize("text", [
    '{"id":  1, "status": "open", "customer": {"name": "a"}}',  # two spaces
    '{"id": 1,\n\n"status": "open", "customer": {"name": "a"}}',  # two newlines
    '{\n' + " " * (MAX_JSON_INDENT + 1) + '"id": 1, "status": "void", "customer": {"name": "a"}}',
    '{"id": 1, "status": "open", "customer": {"name": "a"}\t}',  # a tab not after a newline
    '{"id": 1, "status": "open", "customer": {"name": "a"} \n}',
    '{"id": 1,\r\n"status": "open", "customer": {"name": "a"}}',
    ' {"id": 1, "status": "open", "customer": {"name": "a"}}',  # nothing before the value
    '{"id" : 1, "status": "open", "customer": {"name": "a"}}',  # nothing before ':' or ','
    '{"id": 1 , "status": "open", "customer": {"name": "a"}}',
    '{"id":\n  1, "status": "open", "customer": {"name": "a"}}',  # one space at most after ':'
])
def test_bounded_refuses_longer_runs(compiler, text):
    assert json.loads(text)  # valid JSON, refused only for its whitespace
    assert not accepts(compiler, grammar(), text)


def test_compact_admits_no_whitespace_outside_strings(compiler):
    compact = grammar(whitespace="compact")
    assert accepts(compiler, compact, json.dumps(INSTANCE, separators=(",", ":")))
    assert not accepts(compiler, compact, json.dumps(INSTANCE))
    assert not accepts(compiler, compact, json.dumps(INSTANCE, indent=2))
    assert not accepts(compiler, compact, '{"id":1,"status":"open","customer":{"name":"a"} }')
    any_json = grammar(schema=None, whitespace="compact")
    assert accepts(compiler, any_json, '[1,{"a b":[null,true]},"c d"]')
    assert not accepts(compiler, any_json, '[1, 2]')


def test_any_json_is_bounded_too(compiler):
    any_json = grammar(schema=None)
    assert accepts(compiler, any_json, '[1, {"a": [null,\n  true]}, "c"]')
    assert not accepts(compiler, any_json, '[1,   2]')
    assert accepts(compiler, grammar(schema={"type": "object"}), '{"free": {"form": [1, 2]}}')


def test_a_schemas_own_strings_are_left_alone(compiler):
    marked = f"whitespace_3{{0, {WS_MARK}}}"  # what a marked run looks like in xgrammar's printed grammar
    schema = {"type": "object", "properties": {"c": {"const": marked}, "e": {"enum": [f"[ \\n]{{0, {WS_MARK}}}"]},
              "p": {"type": "string", "pattern": "^[ ]{0,3}x$"}}, "required": ["c", "e", "p"],
              "additionalProperties": False}
    g = grammar(schema)
    assert accepts(compiler, g, json.dumps({"c": marked, "e": f"[ \\n]{{0, {WS_MARK}}}", "p": "   x"}))
    assert not accepts(compiler, g, json.dumps({"c": "whitespace_3", "e": "[ \\n]", "p": "x"}))


def test_every_sample_schema_builds_bounded():
    """Every run xgrammar writes is recognised (bound_whitespace raises on a marked run it does not know)."""
    built = 0
    for line in SAMPLE.read_text(encoding="utf-8").splitlines():
        schema = json.loads(line)["schema"]
        try:
            grammar(schema, whitespace="compact")
        except ConstraintError:
            continue  # refused either way (a keyword it cannot enforce, an integer past 64 bits)
        grammar(schema)
        built += 1
    assert built >= 30


def test_an_unknown_form_of_run_is_an_error_not_a_looser_grammar():
    text = f'root ::= (("a" odd{{0, {WS_MARK}}} "b"))\nodd ::= (("x"))\n'
    with pytest.raises(RuntimeError, match="not recognised"):
        bounded_text(text)


def test_tool_call_json_values_can_be_bounded_the_same_way(compiler):
    """How the tool-call grammar may adopt the rule: build with max_whitespace_cnt=WS_MARK, then bound it."""
    params = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}
    tag = {"type": "tag", "begin": "<tool_call>\n<function=w>\n", "end": "\n</function>\n</tool_call>",
           "content": {"type": "json_schema", "json_schema": params, "style": "qwen_xml", "max_whitespace_cnt": WS_MARK}}
    g = bound_whitespace(xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": tag})))
    call = "<tool_call>\n<function=w>\n<parameter=city>\nMantua\n</parameter>\n<parameter=where>\n{}\n</parameter>\n" \
           "</function>\n</tool_call>"
    assert accepts(compiler, g, call.replace("{}", '{"lat": 45.2}'))
    assert not accepts(compiler, g, call.replace("{}", '{"lat":   45.2}'))


def test_none_reads_as_bounded_where_the_engine_did_not_resolve_it():
    assert str(grammar(whitespace=None)) == str(grammar(whitespace="bounded"))
    assert attrs.evolve(JsonConstraint(schema=ORDER), whitespace="compact").whitespace == "compact"
