"""The xgrammar ``Grammar`` of a constraint: what a compile worker vets and the engine's process then compiles.

One function, ``build_grammar``, used on both sides so that what was measured is what runs. With a thinking
block open the constraint applies after ``</think>``: the reasoning before it is free text (without the think
markers), then up to two newlines. Tool calls are ``qwen_tools``' structural tags, which the tool-call parser reads
back exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.contract.constraint import (
    ChoiceConstraint,
    Constraint,
    ConstraintError,
    GrammarConstraint,
    JsonConstraint,
    RegexConstraint,
    ToolCallConstraint,
)
from ninfer.models.common.grammar import qwen_tools
from ninfer.models.common.grammar.schema_features import check_schema
from ninfer.models.common.grammar.whitespace import COMPACT_SEPARATORS, WS_MARK, bound_whitespace

TOOL_FORMAT = "qwen_3_5"   # the Qwen3.5 / Qwen3-Coder XML tool-call format (qwen_tools)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def build_grammar(constraint: Constraint, *, reasoning_open: bool, tools: Sequence[Mapping[str, Any]],
                  tool_format: str = TOOL_FORMAT) -> Any:
    """The Grammar of ``constraint`` (checked statically before: ``GrammarBook``); ConstraintError names what
    does not build."""
    import xgrammar as xgr

    if isinstance(constraint, ToolCallConstraint):  # with its reasoning part
        return _tool_calls(xgr, constraint, reasoning_open, tools, tool_format)
    try:
        body = _body(xgr, constraint)
    except ConstraintError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
        raise ConstraintError(f"{kind_of(constraint)} is not valid: {reason(e)}") from e
    return xgr.Grammar.concat(_think(xgr), body) if reasoning_open else body


def tool_names(c: ToolCallConstraint, tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tools' function names; ConstraintError when a tool has none or ``tool_choice`` names none of them."""
    if not tools:
        raise ConstraintError("tool_choice needs the request's tools, and it offers none")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ConstraintError(f"tools[{i}] has no function name")
        names.append(fn["name"])
    if c.tool_choice != "auto" and c.tool_choice not in ("required", *names):
        raise ConstraintError(f"tool_choice names function {c.tool_choice!r}, which is not among the "
                              f"request's tools ({', '.join(names)})")
    return names


def _tool_calls(xgr, c: ToolCallConstraint, reasoning_open: bool, tools: Sequence[Mapping[str, Any]],
                tool_format: str) -> Any:
    names = tool_names(c, tools)
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        if params is not None:
            check_schema(params, f"tools[{i}].function.parameters")
    if tool_format != TOOL_FORMAT:
        raise ConstraintError(f"tool calls in the {tool_format!r} format cannot be constrained")
    where = [f"tools[{i}]" for i in range(len(tools))]
    if c.tool_choice == "auto":  # free text, and calls held to their tools' schemas once they begin
        body = qwen_tools.auto_calls(tools, where, parallel=c.parallel)
    else:  # required / one named function: calls only (OpenAI's tool_choice), then the end of the turn
        chosen = [(t, w) for t, w, n in zip(tools, where, names, strict=True) if c.tool_choice in ("required", n)]
        body = qwen_tools.required_calls([t for t, _ in chosen], [w for _, w in chosen], parallel=c.parallel)
    try:
        calls = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": body}))
    except Exception as e:  # noqa: BLE001
        raise ConstraintError(f"tool calls over these tools do not compile: {reason(e)}") from e
    # the reasoning before the calls may not hold one: the parser would read it as a call the grammar never saw
    return xgr.Grammar.concat(_think(xgr, (qwen_tools.TOOL_CALL_OPEN,)), calls) if reasoning_open else calls


def _think(xgr, excludes: tuple[str, ...] = ()) -> Any:
    """Free reasoning up to ``</think>`` (without think markers, nor ``excludes``), then up to two newlines."""
    think = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE, *excludes]},
         "end": THINK_CLOSE},
        {"type": "regex", "pattern": "\\n{0,2}"}]}}
    return xgr.Grammar.from_structural_tag(json.dumps(think))


def _body(xgr, c: Constraint) -> Any:
    """The Grammar of the answer itself."""
    if isinstance(c, JsonConstraint):
        if c.schema is not None:
            check_schema(c.schema_object)
        if c.whitespace == "compact":
            return xgr.Grammar.from_json_schema(c.schema or "{}", any_whitespace=False, strict_mode=True,
                                                separators=COMPACT_SEPARATORS)
        # bounded (None is the engine's to resolve; bounded is the safe reading)
        return bound_whitespace(xgr.Grammar.from_json_schema(c.schema or "{}", any_whitespace=True,
                                                             strict_mode=True, max_whitespace_cnt=WS_MARK))
    if isinstance(c, RegexConstraint):
        return xgr.Grammar.from_regex(c.pattern)
    if isinstance(c, ChoiceConstraint):
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(s) for s in c.choices))
    if isinstance(c, GrammarConstraint):
        if c.syntax == "lark":
            return xgr.Grammar.from_lark(c.grammar)
        return xgr.Grammar.from_ebnf(c.grammar, root_rule_name="root")
    raise ConstraintError(f"unknown constraint type {type(c).__name__}")


def _ebnf_string(text: str) -> str:
    """``text`` as a GBNF string literal (backslash, quote and control characters escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def mib(nbytes: int) -> str:
    """``nbytes`` for a message: ``64 MiB``, ``0.25 MiB``, ``63.99 MiB``."""
    return f"{nbytes / (1 << 20):.4g} MiB"


def kind_of(c: Constraint) -> str:
    return {JsonConstraint: "the JSON schema", RegexConstraint: "the regex", ChoiceConstraint: "the choice",
            GrammarConstraint: "the grammar", ToolCallConstraint: "the tool calls"}.get(type(c), "the constraint")


_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+\.cc:[0-9]+: ")  # xgrammar's C++ log prefix: time, source file, line


def reason(e: BaseException) -> str:
    text = _LOG_PREFIX.sub("", str(e)).strip() or type(e).__name__
    return text.splitlines()[0] if len(text) > 400 else text
