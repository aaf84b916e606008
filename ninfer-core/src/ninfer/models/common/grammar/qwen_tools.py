"""Structural tags for Qwen3.5 XML tool calls, written so that the tool-call parser reads back exactly what they allow.

A call is the chat template's own rendering, with nothing optional in between::

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

Each value is raw text or one JSON value as ``tool_schema`` decides (the parser reads that same decision), the
parameters in the schema's order, required ones always, no others. xgrammar's own ``qwen_xml`` style is not used:
its strings may contain ``<parameter=`` (which the parser's leniency for a missing ``</parameter>`` splits into a
new parameter) and its length-bounded strings even ``</parameter>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.contract.constraint import ConstraintError
from ninfer.models.common.grammar import tool_schema as ts

TOOL_CALL_OPEN = "<tool_call>"
JSON_WHITESPACE = 2  # whitespace run inside a JSON value (a weak model cannot stall there)


def call_tag(tool: Mapping[str, Any], where: str) -> dict:
    """The structural tag of one call of ``tool``; ConstraintError (naming ``where``) for what cannot be written."""
    fn = ts.tool_function(tool)
    name = fn.get("name")
    why = ts.bad_name(name)
    if why is not None:
        raise ConstraintError(f"{where}.function.name {why}, which a Qwen XML tool call cannot carry")
    root = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
    props = dict(ts.properties(fn))
    missing = [r for r in ts.required(fn) if r not in props]
    if missing:
        raise ConstraintError(f"{where}.function.parameters requires {missing[0]!r}, which is not among its "
                              "properties")
    required = set(ts.required(fn))
    elements = []
    for key, schema in props.items():
        why = ts.bad_name(key)
        if why is not None:
            raise ConstraintError(f"{where}.function.parameters property {key[:80]!r} {why}, which a Qwen XML "
                                  "tool call cannot carry")
        element = {"type": "tag", "begin": f"<parameter={key}>\n", "content": _value(fn, schema, root),
                   "end": f"\n{ts.PARAMETER_END}\n"}
        elements.append(element if key in required else {"type": "optional", "content": element})
    if not elements:
        content: dict = {"type": "const_string", "value": ""}
    elif len(elements) == 1:
        content = elements[0]
    else:
        content = {"type": "sequence", "elements": elements}
    return {"type": "tag", "begin": f"{TOOL_CALL_OPEN}\n<function={name}>\n", "content": content,
            "end": "</function>\n</tool_call>"}


def _value(fn: Mapping[str, Any], schema: Any, root: Mapping[str, Any]) -> dict:
    members = ts.raw_members(schema, root)
    if members is not None:
        consts = [{"type": "const_string", "value": m} for m in members]
        return consts[0] if len(consts) == 1 else {"type": "or", "elements": consts}
    if ts.is_raw(schema, root):
        return {"type": "any_text", "excludes": [ts.PARAMETER_END]}
    body = ts.value_schema(fn, schema)
    if not isinstance(body, Mapping | bool):
        body = {}
    return {"type": "json_schema", "json_schema": body, "style": "json", "max_whitespace_cnt": JSON_WHITESPACE}


def required_calls(tools: Sequence[Mapping[str, Any]], where: Sequence[str], *, parallel: bool) -> dict:
    """Calls only (``tool_choice`` required or named), separated by a newline as the template writes them."""
    return {"type": "tags_with_separator", "tags": [call_tag(t, w) for t, w in zip(tools, where, strict=True)],
            "separator": "\n", "at_least_one": True, "stop_after_first": not parallel}


def auto_calls(tools: Sequence[Mapping[str, Any]], where: Sequence[str], *, parallel: bool) -> dict:
    """Free text, and calls held to these tools once ``<tool_call>`` begins one."""
    return {"type": "triggered_tags", "triggers": [TOOL_CALL_OPEN],
            "tags": [call_tag(t, w) for t, w in zip(tools, where, strict=True)], "stop_after_first": not parallel}
