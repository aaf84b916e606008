"""ConstraintLimits and the checks that need no compile worker (issue 42, items 1, 2 and 8).

The limits are typed and validated, carried by EngineConfig / StartupOptions; each size limit refuses its kind
of constraint with a message naming the limit and its flag (choice: count and bytes); a remote ``$ref`` is
refused; a grammar that derives no sentence is recognized (self-loop, mutual recursion without a base case,
a required repetition of one) while recursive grammars with a base case pass; a running matcher past its
memory, time or the book's total ends with the limit named, and every byte it counted is given back.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.contract import EngineConfig
from ninfer.contract.constraint import (
    ChoiceConstraint,
    ConstraintBusy,
    ConstraintError,
    ConstraintLimitExceeded,
    ConstraintLimits,
    GrammarConstraint,
    JsonConstraint,
    RegexConstraint,
    ToolCallConstraint,
)
from ninfer.models.common.grammar import GrammarBook, TokenMatcher
from ninfer.models.common.grammar import matcher as matcher_module
from ninfer.models.common.grammar.build import build_grammar
from ninfer.models.common.grammar.matcher import MIN_CHARGE, MatcherBudget

xgr = pytest.importorskip("xgrammar")
MIB = 1 << 20


def test_limits_are_validated_and_carried_by_the_configs():
    with pytest.raises(ValueError, match="max_choice_bytes"):
        ConstraintLimits(max_choice_bytes=0)
    with pytest.raises(ValueError, match="compile_timeout_s"):
        ConstraintLimits(compile_timeout_s=float("inf"))
    with pytest.raises(ValueError, match="constraint_limits"):
        EngineConfig(constraint_limits={"max_regex_bytes": 1})
    limits = ConstraintLimits(max_regex_bytes=10)
    config = EngineConfig(constraint_limits=limits).for_device("cpu")
    assert config.startup_options().constraint_limits is limits
    assert config.startup_fields_set() == ("constraint_limits",)  # the Frontend is built with them


def book(**limits) -> GrammarBook:
    """A book whose checks run here; it starts no worker (none of these constraints reaches one)."""
    return GrammarBook(lambda: [b"a", b"b", b""], vocab_size=3, stop_token_ids=[2],
                       limits=ConstraintLimits(**limits))


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "string", "description": "y" * 200}}}}}


@pytest.mark.parametrize(("limit", "value", "constraint", "tools"), [
    ("max_schema_bytes", 64, JsonConstraint(schema={"type": "object", "description": "x" * 100}), ()),
    ("max_regex_bytes", 8, RegexConstraint(pattern="a{1,3}|b{1,3}|c"), ()),
    ("max_grammar_bytes", 16, GrammarConstraint(grammar='root ::= "abc" | "defghij"'), ()),
    ("max_choices", 2, ChoiceConstraint(choices=["a", "b", "c"]), ()),
    ("max_choice_bytes", 8, ChoiceConstraint(choices=["aaaa", "bbbb", "\u00e9"]), ()),  # 4 + 4 + 2 UTF-8 bytes
    ("max_schema_bytes", 128, ToolCallConstraint(tool_choice="required"), (TOOL,)),
])
def test_each_size_limit_refuses_its_kind_and_names_itself(limit, value, constraint, tools):
    with pytest.raises(ConstraintLimitExceeded) as info:
        book(**{limit: value}).compile(constraint, tools=tools)
    assert info.value.limit == limit
    assert f"ConstraintLimits.{limit}" in str(info.value) and "ninfer serve --constraint-" in str(info.value)
    book().check(constraint, tools)  # the defaults let it through


def test_a_remote_reference_is_refused():
    """Where the schema is built (in a compile worker): its keywords are walked there, off the engine's process."""
    def build(schema):
        return build_grammar(JsonConstraint(schema=schema), reasoning_open=False, tools=())

    for ref in ("http://example.com/s.json", "other.json#/a", "urn:x"):
        with pytest.raises(ConstraintError, match="remote references are not fetched"):
            build({"type": "object", "properties": {"a": {"$ref": ref}}})
    build({"$defs": {"a": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/a"}}})


@pytest.mark.parametrize(("grammar", "syntax", "derives"), [
    ("root ::= x\nx ::= x", "gbnf", False),
    ('root ::= a\na ::= "(" b ")"\nb ::= "[" a "]"', "gbnf", False),  # mutual recursion, no base case
    ('root ::= x+\nx ::= "a" x', "gbnf", False),  # must repeat a rule that never ends
    ('start: a\na: "(" a ")"', "lark", False),
    ('root ::= a\na ::= "(" a ")" | "x"', "gbnf", True),
    ('root ::= x*\nx ::= x', "gbnf", True),  # zero repetitions are a sentence
    ('root ::= "a" | x\nx ::= x "b"', "gbnf", True),
    ('root ::= [a-z]+ ("," [a-z]+)*', "gbnf", True),
    ('start: expr\nexpr: "(" expr ")" | NUM\nNUM: /[0-9]+/', "lark", True),
])
def test_derives_a_sentence(grammar, syntax, derives):
    from ninfer.models.common.grammar.productive import derives_a_sentence, grammar_shape

    g = xgr.Grammar.from_lark(grammar) if syntax == "lark" else xgr.Grammar.from_ebnf(grammar, root_rule_name="root")
    assert derives_a_sentence(grammar_shape(g)) is derives


def test_a_schema_that_requires_itself_derives_nothing():
    from ninfer.models.common.grammar.productive import derives_a_sentence, grammar_shape

    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    assert not derives_a_sentence(grammar_shape(xgr.Grammar.from_json_schema(JsonConstraint(schema=endless).schema)))
    endless["required"] = []
    assert derives_a_sentence(grammar_shape(xgr.Grammar.from_json_schema(JsonConstraint(schema=endless).schema)))


# -- the running matcher's guard ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo([b"a", b"b", b""], xgr.VocabType.RAW, vocab_size=3, stop_token_ids=[2])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(
        xgr.Grammar.from_ebnf("root ::= [ab]*"))


def guarded(compiled, budget: MatcherBudget, charge: int = MIN_CHARGE) -> TokenMatcher:
    budget.reserve(charge)
    return TokenMatcher(compiled, budget=budget, charge=charge)


def test_a_matcher_that_grows_past_its_limit_fails_with_the_limit_named(compiled, monkeypatch):
    budget = MatcherBudget(ConstraintLimits(matcher_memory_bytes=4 * MIB))
    m = guarded(compiled, budget)
    assert m.accept(0)
    resident = iter(range(0, 1 << 40, 3 * MIB))  # every reading 3 MiB above the one before
    monkeypatch.setattr(matcher_module.Resident, "bytes", classmethod(lambda cls: next(resident)))
    assert m.accept(1)  # grew 3 MiB: within 4
    with pytest.raises(ConstraintLimitExceeded, match="matcher_memory_bytes") as info:
        m.accept(0)
    assert "grew by 6 MiB; at most 4 MiB" in str(info.value)
    assert budget.held == 0 and budget.live == 0  # its memory and its count go at once, though `m` lives on
    with pytest.raises(ConstraintLimitExceeded):  # it stays failed
        m.fill(torch.zeros((1, 1), dtype=torch.int32))


def test_a_slow_matcher_step_fails_with_the_limit_named(compiled):
    budget = MatcherBudget(ConstraintLimits(token_time_s=1e-12))
    m = guarded(compiled, budget)
    with pytest.raises(ConstraintLimitExceeded, match="token_time_s"):
        m.accept(0)
    assert budget.held == 0 and budget.live == 0


def test_the_total_bound_refuses_new_matchers_and_ends_a_growing_one(compiled, monkeypatch):
    budget = MatcherBudget(ConstraintLimits(total_matcher_bytes=1 * MIB))
    live = [guarded(compiled, budget) for _ in range(MIB // MIN_CHARGE)]
    with pytest.raises(ConstraintBusy, match="total_matcher_bytes"):
        guarded(compiled, budget)
    live.pop().close()
    growing = guarded(compiled, budget)
    resident = iter(range(0, 1 << 40, MIB // 2))
    monkeypatch.setattr(matcher_module.Resident, "bytes", classmethod(lambda cls: next(resident)))
    with pytest.raises(ConstraintLimitExceeded, match="total_matcher_bytes"):
        growing.accept(0)
    del growing, live
    assert budget.held == 0 and budget.live == 0


def test_an_unguarded_matcher_counts_nothing(compiled):
    m = TokenMatcher(compiled)
    assert m.accept(0) and m.accept(1) and not m.terminated
