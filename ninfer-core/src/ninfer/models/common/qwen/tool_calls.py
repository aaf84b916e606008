"""Streaming parser for Qwen3.5 (Qwen3-Coder) XML tool calls.

The model writes, after ``<tool_call>``::

    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text (one leading and one trailing newline belong to the format) and are typed by the tool's
JSON schema. The parser emits OpenAI-style fragments: the name once, then argument JSON text: string values
(schema type ``string``, or a parameter the schema does not declare) stream as they arrive, other values go
out whole once their end tag is seen (they must be parsed to be typed), and a closing brace ends the call.
The fragments of one call concatenate to ``json.dumps(arguments, ensure_ascii=False)``. State is immutable;
``feed`` returns the next state.

Without a constraint the parser is lenient (models sometimes omit ``</parameter>``: the next ``<parameter=`` or
``</function>`` ends a value too). Under a tool-call constraint (``strict``) it reads exactly what the grammar
allowed (``grammar.tool_schema``): a raw value ends at the first ``</parameter>`` only, a JSON value where its
JSON ends. Either way a call to a function the request did not offer is not a call: its text stays content.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ninfer.contract.events import ToolCall
from ninfer.models.common.grammar import tool_schema as ts

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"
_MAX_TAG = 512  # a function or parameter name longer than this is not a tool call


@attrs.frozen
class ToolCallState:
    """One call in progress. ``phase``: open -> params -> value -> params ... -> close."""

    index: int
    call_id: str
    phase: str = "open"
    name: str = ""
    param: str = ""
    params_done: int = 0
    streamed: bool = False  # the current value is a string sent as it arrives
    started: bool = False   # the newline after <parameter=...> was consumed
    strict: bool = False    # a constraint wrote the call: values end only where its grammar ends them


@attrs.frozen
class FeedResult:
    state: ToolCallState | None  # None once the call ended (``rest`` is ordinary text again)
    fragments: tuple[ToolCall, ...] = ()
    held: str = ""               # text kept for the next feed
    rest: str = ""               # text after the call
    fallback: str | None = None  # not a tool call after all: this raw text is content


def _is_prefix(s: str, *tags: str) -> bool:
    return any(tag.startswith(s) for tag in tags)


def _param_schema(tools: Sequence[Mapping[str, Any]], function: str, param: str) -> Mapping[str, Any] | None:
    fn = ts.find_function(tools, function)
    if fn is None:
        return None
    root = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
    schema = ts.resolve(ts.param_schema(fn, param), root)
    return schema if isinstance(schema, Mapping) else None


def _strict_raw(tools: Sequence[Mapping[str, Any]], function: str, param: str) -> bool:
    """Under a constraint: whether this parameter's value is raw text (else one JSON value)."""
    fn = ts.find_function(tools, function) or {}
    root = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
    return ts.is_raw(ts.param_schema(fn, param), root)


def _as_type(value: str, kind: str) -> tuple[bool, Any]:
    text = value.strip()
    if kind == "string":
        return True, value
    if kind == "null":
        return text.lower() in ("null", "none"), None
    if kind == "boolean":
        low = text.lower()
        return low in ("true", "false"), low == "true"
    if kind == "integer":
        try:
            return True, int(text)
        except ValueError:
            try:
                f = float(text)
                return f.is_integer(), int(f) if f.is_integer() else None
            except ValueError:
                return False, None
    if kind == "number":
        try:
            f = float(text)
        except ValueError:
            return False, None
        if not (f == f and abs(f) != float("inf")):
            return False, None
        return True, int(f) if f.is_integer() and "." not in text and "e" not in text.lower() else f
    # object, array or unknown: JSON, then a Python literal (models sometimes write single quotes).
    try:
        return True, json.loads(text)
    except ValueError:
        pass
    try:
        return True, ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False, None


def typed_value(value: str, schema: Mapping[str, Any] | None) -> Any:
    """The JSON value for a raw parameter text under its schema (strings stay raw; unparsable stays a string)."""
    if schema is None:
        return value
    members = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(members, list) and value not in members and value.strip() in members:
        return value.strip()  # whitespace around an enum member (a constrained call may write some) is not part of it
    kinds = schema.get("type")
    if kinds is None:
        kinds = ["string"] if "enum" not in schema else []
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if not kinds:  # anyOf/oneOf/enum without a type: JSON if it parses, else the text
        ok, parsed = _as_type(value, "object")
        return parsed if ok and not isinstance(parsed, str) else value
    for kind in sorted(kinds, key=lambda k: k == "string"):  # the text itself is the last resort
        ok, parsed = _as_type(value, kind)
        if ok:
            return parsed
    return value


def _strip_format_newlines(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _close(state: ToolCallState, done: int | None = None) -> ToolCall:
    done = state.params_done if done is None else done
    return ToolCall(index=state.index, id="", name="", arguments="}" if done else "{}")


def _fragment(state: ToolCallState, arguments: str) -> ToolCall:
    return ToolCall(index=state.index, id="", name="", arguments=arguments)


def _key(state: ToolCallState) -> str:
    """``{"name": `` for the first parameter, ``, "name": `` for later ones."""
    return ("{" if state.params_done == 0 else ", ") + json.dumps(state.param, ensure_ascii=False) + ": "


def _escape(text: str) -> str:
    # JSON string escaping is per character, so escaped chunks concatenate to the escaped whole.
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _json_value_end(buf: str) -> tuple[Any, int] | None:
    """A JSON parameter value at the start of ``buf`` and where its ``</parameter>`` ends; None while it is
    incomplete (or, at the end of the output, not JSON: then it ends at the first ``</parameter>``)."""
    start = len(buf) - len(buf.lstrip())
    try:
        value, end = _DECODER.raw_decode(buf, start)
    except ValueError:
        return None
    rest = buf[end:]
    tail = rest.lstrip()
    if not tail.startswith(_PARAMETER_END):
        return None
    return value, len(buf) - len(tail) + len(_PARAMETER_END)


_DECODER = json.JSONDecoder()


def _safe_value_prefix(buf: str, strict: bool) -> int:
    """How much of a streamed value can go out: not a possible end tag, nor the newline before one."""
    cut = len(buf)
    lt = buf.rfind("<")
    if lt >= 0 and _is_prefix(buf[lt:], *((_PARAMETER_END,) if strict else (_PARAMETER_END, _PARAMETER, _FUNCTION_END))):
        cut = lt
    return cut - 1 if buf[:cut].endswith("\n") else cut


def feed(state: ToolCallState, text: str, tools: Sequence[Mapping[str, Any]], *, final: bool = False,
         raw_prefix: str = TOOL_CALL_OPEN) -> FeedResult:
    """Consume ``text`` (what follows ``<tool_call>`` so far, with earlier held text in front).

    ``final``: the output ends here; a call whose name was emitted gets its arguments closed with the
    parameters completed so far, one that never named a function falls back to content.
    """
    frags: list[ToolCall] = []
    buf = text
    while True:
        if state.phase == "open":
            s = buf.lstrip()
            if s.startswith(_FUNCTION):
                gt = s.find(">")
                name = s[len(_FUNCTION):gt].strip() if gt >= 0 else ""
                if gt < 0 and len(s) < _MAX_TAG and not final:
                    return FeedResult(state, tuple(frags), held=buf)
                if gt < 0 or not name or "<" in name or "\n" in name or ts.find_function(tools, name) is None:
                    return FeedResult(None, tuple(frags), fallback=raw_prefix + buf)
                state = attrs.evolve(state, phase="params", name=name)
                frags.append(ToolCall(index=state.index, id=state.call_id, name=name, arguments=""))
                buf = s[gt + 1:]
                continue
            if not final and _is_prefix(s, _FUNCTION):
                return FeedResult(state, tuple(frags), held=buf)
            return FeedResult(None, tuple(frags), fallback=raw_prefix + buf)
        if state.phase == "params":
            s = buf.lstrip()
            if s.startswith(_PARAMETER):
                gt = s.find(">")
                if gt < 0 and len(s) < _MAX_TAG and not final:
                    return FeedResult(state, tuple(frags), held=buf)
                param = s[len(_PARAMETER):gt].strip() if gt >= 0 else ""
                if not param:
                    frags.append(_close(state))
                    return FeedResult(None, tuple(frags), rest="" if final else s)
                schema = _param_schema(tools, state.name, param)
                # Free strings stream; an enum / const member is matched whole (whitespace around it dropped).
                if state.strict:
                    streamed = _strict_raw(tools, state.name, param)
                else:
                    streamed = schema is None or (schema.get("type") == "string" and "enum" not in schema
                                                  and "const" not in schema)
                state = attrs.evolve(state, phase="value", param=param, streamed=streamed, started=False)
                if streamed:  # a string value streams as it arrives: open it now
                    frags.append(_fragment(state, f"{_key(state)}\""))
                buf = s[gt + 1:]
                continue
            if s.startswith(_FUNCTION_END):
                frags.append(_close(state))
                state = attrs.evolve(state, phase="close")
                buf = s[len(_FUNCTION_END):]
                continue
            if not final and _is_prefix(s, _PARAMETER, _FUNCTION_END):
                return FeedResult(state, tuple(frags), held=buf)
            # Malformed or cut off: close what was said; anything else is ordinary text.
            frags.append(_close(state))
            return FeedResult(None, tuple(frags), rest=s)
        if state.phase == "value":
            if state.streamed and not state.started:  # the format's newline after the tag is not value
                if not buf:
                    return FeedResult(state, tuple(frags), held=buf)
                buf = buf[1:] if buf.startswith("\n") else buf
                state = attrs.evolve(state, started=True)
            if state.strict and not state.streamed:
                end = _json_value_end(buf)
                if end is None and not final:
                    return FeedResult(state, tuple(frags), held=buf)
                if end is not None:
                    value, pos = end
                    frags.append(_fragment(state, f"{_key(state)}{json.dumps(value, ensure_ascii=False)}"))
                    state = attrs.evolve(state, phase="params", param="", params_done=state.params_done + 1)
                    buf = buf[pos:]
                    continue
            # A value ends at </parameter>; models sometimes omit it before the next tag (not under a constraint).
            tags = (_PARAMETER_END,) if state.strict else (_PARAMETER_END, _PARAMETER, _FUNCTION_END)
            ends = [(pos, tag) for pos, tag in ((buf.find(t), t) for t in tags) if pos >= 0]
            if not ends:
                if state.streamed:
                    cut = len(buf) if final else _safe_value_prefix(buf, state.strict)
                    if cut:
                        frags.append(_fragment(state, _escape(buf[:cut])))
                    if not final:
                        return FeedResult(state, tuple(frags), held=buf[cut:])
                    frags.append(_fragment(state, '"'))  # a streamed string closes with what arrived
                elif not final:
                    return FeedResult(state, tuple(frags), held=buf)
                frags.append(_close(state, done=state.params_done + state.streamed))
                return FeedResult(None, tuple(frags))  # a typed value that never ended is dropped, not guessed
            pos, tag = min(ends)
            if state.streamed:
                value = buf[:pos][:-1] if buf[:pos].endswith("\n") else buf[:pos]
                frags.append(_fragment(state, _escape(value) + '"'))
            else:
                value = _strip_format_newlines(buf[:pos])
                typed = typed_value(value, _param_schema(tools, state.name, state.param))
                frags.append(_fragment(state, f"{_key(state)}{json.dumps(typed, ensure_ascii=False)}"))
            state = attrs.evolve(state, phase="params", param="", params_done=state.params_done + 1, streamed=False)
            buf = buf[pos + len(_PARAMETER_END):] if tag == _PARAMETER_END else buf[pos:]
            continue
        # close: only whitespace and </tool_call> may follow </function>.
        s = buf.lstrip()
        if s.startswith(TOOL_CALL_CLOSE):
            return FeedResult(None, tuple(frags), rest=s[len(TOOL_CALL_CLOSE):])
        if not final and _is_prefix(s, TOOL_CALL_CLOSE):
            return FeedResult(state, tuple(frags), held=buf)
        return FeedResult(None, tuple(frags), rest=s)

