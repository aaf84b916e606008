"""How each parameter of a tool is written in the Qwen3.5 XML tool-call format under a constraint.

The one place that decides it, read by both sides so that they agree exactly: the grammar that constrains a call
(``qwen_tools``) and the parser that reads it back (``qwen.tool_calls`` with ``strict``). A parameter is
written between ``<parameter=NAME>\\n`` and ``\\n</parameter>\\n``, its value in one of two ways:

* raw text, as the chat template writes strings: a plain string (no length, pattern or format), or one member
  of a string ``enum`` / ``const``. The text never contains ``</parameter>``, so the first ``</parameter>`` ends
  it (``<parameter=`` or ``</function>`` inside it are text);
* JSON, for everything else (numbers, booleans, null, objects, arrays, unions, strings with length, pattern or
  format): one JSON value, which ends where the JSON ends (a ``</parameter>`` inside a JSON string is text).

Parameters appear in the schema's order, required ones always, no others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PARAMETER_END = "</parameter>"
MAX_NAME = 256  # a longer function or parameter name is refused (the parser gives up on tags past 512 characters)
# Keywords that describe a string without constraining it (a string with only these is raw text).
_ANNOTATIONS = frozenset(("type", "title", "description", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly"))
_MAX_REF_HOPS = 16


def tool_function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
    return fn if isinstance(fn, Mapping) else {}


def find_function(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    for tool in tools:
        fn = tool_function(tool)
        if fn.get("name") == name:
            return fn
    return None


def resolve(schema: Any, root: Mapping[str, Any]) -> Any:
    """``schema`` with local ``$ref``s (``#/...``) followed; a ref that does not resolve is left as it is."""
    for _ in range(_MAX_REF_HOPS):
        if not isinstance(schema, Mapping) or not isinstance(schema.get("$ref"), str):
            return schema
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return schema
        target: Any = root
        for part in (p for p in ref[1:].split("/") if p):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, Mapping) or part not in target:
                return schema
            target = target[part]
        schema = target
    return schema


def parameters(fn: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function's parameters schema (its top-level ``$ref`` followed); ``{}`` when it has none."""
    params = fn.get("parameters")
    if not isinstance(params, Mapping):
        return {}
    found = resolve(params, params)
    return found if isinstance(found, Mapping) else {}


def properties(fn: Mapping[str, Any]) -> list[tuple[str, Any]]:
    props = parameters(fn).get("properties")
    return list(props.items()) if isinstance(props, Mapping) else []


def required(fn: Mapping[str, Any]) -> list[str]:
    names = parameters(fn).get("required")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def raw_members(schema: Any, root: Mapping[str, Any]) -> list[str] | None:
    """The members of a string ``enum``/``const`` written as raw text, or None when the value is not one."""
    s = resolve(schema, root)
    if not isinstance(s, Mapping):
        return None
    if "const" in s:
        members, extra = [s["const"]], set(s) - _ANNOTATIONS - {"const", "enum"}
    elif "enum" in s:
        members, extra = s["enum"], set(s) - _ANNOTATIONS - {"enum"}
    else:
        return None
    if extra or s.get("type", "string") != "string" or not isinstance(members, list) or not members:
        return None
    if "enum" in s and "const" in s and s["const"] not in s["enum"]:
        return None
    if not all(isinstance(m, str) and PARAMETER_END not in m for m in members):
        return None
    return list(dict.fromkeys(members))


def is_raw(schema: Any, root: Mapping[str, Any]) -> bool:
    """Whether a parameter of this schema is written as raw text (else as one JSON value)."""
    s = resolve(schema, root)
    if not isinstance(s, Mapping):
        return False
    if raw_members(s, root) is not None:
        return True
    return s.get("type") == "string" and set(s) <= _ANNOTATIONS


def param_schema(fn: Mapping[str, Any], param: str) -> Any:
    for name, schema in properties(fn):
        if name == param:
            return schema
    return None


def value_schema(fn: Mapping[str, Any], schema: Any) -> Any:
    """A parameter's schema as a root of its own: the function's ``$defs`` / ``definitions`` carried along, so
    that its refs resolve."""
    params = fn.get("parameters")
    if not isinstance(schema, Mapping) or not isinstance(params, Mapping):
        return schema
    out = dict(schema)
    for key in ("$defs", "definitions"):
        if key in params and key not in out:
            out[key] = params[key]
    return out


def bad_name(name: Any) -> str | None:
    """Why ``name`` cannot be a function or parameter name in the XML format (None: it can)."""
    if not isinstance(name, str) or not name:
        return "is empty"
    if len(name) > MAX_NAME:
        return f"is longer than {MAX_NAME} characters"
    if any(ch in name for ch in "<>\n\r") or name != name.strip():
        return "holds '<', '>', a line break or surrounding whitespace"
    return None
