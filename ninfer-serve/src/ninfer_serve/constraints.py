"""Constrained decoding over HTTP: the OpenAI, vLLM and llama.cpp request fields -> one ``Constraint``.

A request carries at most one constraint, so two fields that each ask for one answer a 400 naming both.
``structured_outputs.disable_any_whitespace`` sets the whitespace of whichever field asks for JSON (vLLM lets it
stand alone beside ``response_format``); unset, the server's default applies (``ninfer serve --json-compact``).
Whatever the contract classes refuse (an empty regex, a schema that is not JSON) answers a 400 naming the
field; what only the grammar compiler can judge (an unsupported schema keyword, a GBNF syntax error) the
engine rejects when the request is submitted, which the gateway also answers with a 400.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import attrs

from ninfer.contract.constraint import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    JsonConstraint,
    JsonWhitespace,
    RegexConstraint,
    ToolCallConstraint,
)
from ninfer.contract.values import JSON, JSONObject
from ninfer_serve.errors import bad_request
from ninfer_serve.schemas import (
    GenerationBody,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    ToolChoice,
)

# OpenAI's rule for response_format.json_schema.name.
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A Lark grammar has a ``start`` rule (``start:``, ``?start:``); a GBNF one writes rules as ``name ::= ...``.
_LARK_START = re.compile(r"^[ \t]*[?!]?start[ \t]*:(?![:=])", re.MULTILINE)
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@attrs.frozen
class Asked:
    """A constraint one request field asks for; ``what`` names the field in a conflict message."""

    param: str
    what: str
    constraint: Constraint

    @property
    def compiled_from(self) -> str:
        """The parameter a compile failure is about: the tools' schemas for tool calls, else the field itself."""
        return "tools" if isinstance(self.constraint, ToolCallConstraint) else self.param


def _build(param: str, factory: Callable[..., Constraint], **fields: JSON) -> Constraint:
    """A contract constraint; its validators' refusals become a 400 naming ``param``."""
    try:
        return factory(**fields)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"invalid value for '{param}': {exc}", param=param) from None


def grammar_syntax(grammar: str) -> str:
    """``"lark"`` for a grammar with a Lark ``start`` rule, else ``"gbnf"`` (llama.cpp's, root rule ``root``)."""
    return "lark" if _LARK_START.search(grammar) else "gbnf"


def response_format(rf: ResponseFormat | None) -> Asked | None:
    """OpenAI ``response_format``: text (nothing), json_object (any object, or llama.cpp's ``schema``),
    json_schema (``json_schema.schema``)."""
    if rf is None:
        return None
    if rf.json_schema is not None and rf.type != "json_schema":
        raise bad_request(f"'response_format.json_schema' goes with type 'json_schema', not '{rf.type}'",
                          param="response_format.json_schema")
    if rf.schema is not None and rf.type != "json_object":
        hint = " (put the schema in 'response_format.json_schema.schema')" if rf.type == "json_schema" else ""
        raise bad_request(f"'response_format.schema' goes with type 'json_object'{hint}", param="response_format.schema")
    if rf.type == "structural_tag":
        raise bad_request("'response_format' of type 'structural_tag' is not supported by this server; use 'tools' "
                          "with 'tool_choice', or a 'json_schema'", param="response_format.type")
    for name in ("format", "structures", "triggers"):
        if getattr(rf, name) is not None:
            raise bad_request(f"'response_format.{name}' belongs to type 'structural_tag', which this server does "
                              "not support", param=f"response_format.{name}")
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        schema = rf.schema if rf.schema is not None else {"type": "object"}
        param = "response_format.schema" if rf.schema is not None else "response_format"
        return Asked(param, "'response_format' (json_object)", _build(param, JsonConstraint, schema=schema))
    spec = rf.json_schema
    if spec is None:
        raise bad_request("'response_format' of type 'json_schema' needs 'json_schema' (with a 'schema')",
                          param="response_format.json_schema")
    if spec.name is not None and not _SCHEMA_NAME.fullmatch(spec.name):
        raise bad_request("'response_format.json_schema.name' must be 1 to 64 characters of a-z, A-Z, 0-9, '_' "
                          f"and '-', got {spec.name[:80]!r}", param="response_format.json_schema.name")
    if spec.schema is None:
        raise bad_request("'response_format.json_schema' needs 'schema' (a JSON Schema object)",
                          param="response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    return Asked(param, "'response_format' (json_schema)", _build(param, JsonConstraint, schema=spec.schema))


def structured_outputs(so: StructuredOutputs | None) -> Asked | None:
    """vLLM's ``structured_outputs``: exactly one kind; ``disable_any_whitespace`` for the JSON kinds."""
    if so is None:
        return None
    if so.structural_tag is not None:
        raise bad_request("'structured_outputs.structural_tag' is not supported by this server; use 'tools' with "
                          "'tool_choice', or 'json'", param="structured_outputs.structural_tag")
    kinds = [k for k in _STRUCTURED_KINDS if getattr(so, k) not in (None, False)]
    if not kinds and so.disable_any_whitespace is not None:
        return None  # the whitespace option alone: it applies to another field's JSON (json_whitespace)
    if not kinds:
        raise bad_request("'structured_outputs' needs one of 'json', 'regex', 'choice', 'grammar' or "
                          "'json_object'", param="structured_outputs")
    if len(kinds) > 1:
        raise bad_request(f"'structured_outputs' takes one kind of constraint, got both '{kinds[0]}' and "
                          f"'{kinds[1]}'", param=f"structured_outputs.{kinds[1]}")
    (kind,) = kinds
    param = f"structured_outputs.{kind}"
    what = f"'structured_outputs' ({kind})"
    if kind == "json":
        return Asked(param, what, _build(param, JsonConstraint, schema=so.json))
    if kind == "json_object":
        return Asked(param, what, _build(param, JsonConstraint, schema={"type": "object"}))
    if kind == "regex":
        return Asked(param, what, _build(param, RegexConstraint, pattern=so.regex))
    if kind == "choice":
        return Asked(param, what, _build(param, ChoiceConstraint, choices=so.choice))
    assert so.grammar is not None
    return Asked(param, what, _build(param, GrammarConstraint, grammar=so.grammar, syntax=grammar_syntax(so.grammar)))


def llama_cpp_fields(grammar: str | None, json_schema: JSONObject | None) -> list[Asked]:
    """llama.cpp's top-level ``grammar`` (GBNF) and ``json_schema`` (``{}``: any JSON value)."""
    asked = []
    if json_schema is not None:
        constraint = _build("json_schema", JsonConstraint, schema=json_schema or None)
        asked.append(Asked("json_schema", "'json_schema'", constraint))
    if grammar is not None:
        asked.append(Asked("grammar", "'grammar'", _build("grammar", GrammarConstraint, grammar=grammar)))
    return asked


def tool_calls(tools: Sequence[JSONObject], tool_choice: ToolChoice, parallel_tool_calls: bool | None) -> Asked | None:
    """``tool_choice`` over the rendered ``tools``: required or a named function constrain the output to tool
    calls; auto (OpenAI's default with tools) does only when a tool asks for ``strict`` arguments (vLLM's rule)."""
    if not tools or tool_choice == "none":
        return None
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        known = [t["function"]["name"] for t in tools]
        if name not in known:
            raise bad_request(f"'tool_choice' names the function '{name[:80]}', which is not among 'tools' "
                              f"({', '.join(known)[:400]})", param="tool_choice.function.name")
        return Asked("tool_choice", f"'tool_choice' (function '{name}')",
                     _build("tool_choice", ToolCallConstraint, tool_choice=name, parallel=parallel))
    if tool_choice == "required":
        return Asked("tool_choice", "'tool_choice' (required)",
                     _build("tool_choice", ToolCallConstraint, tool_choice="required", parallel=parallel))
    if any(t["function"].get("strict") is True for t in tools):
        return Asked("tool_choice", "'tool_choice' (auto, with a strict tool)",
                     _build("tool_choice", ToolCallConstraint, tool_choice="auto", parallel=parallel))
    return None


def json_whitespace(asked: Asked | None, so: StructuredOutputs | None) -> Asked | None:
    """``asked`` with ``structured_outputs.disable_any_whitespace`` applied: true, compact JSON; false, bounded
    whitespace; unset, the server's default. Compact JSON asked of output that is not JSON is a 400."""
    if so is None or so.disable_any_whitespace is None:
        return asked
    if asked is None or not isinstance(asked.constraint, JsonConstraint):
        if not so.disable_any_whitespace:
            return asked  # bounded whitespace asked of output that is not JSON: nothing to change
        raise bad_request("'structured_outputs.disable_any_whitespace' applies to JSON output: 'structured_outputs' "
                          "'json' and 'json_object' only, or 'response_format' of type 'json_object' or "
                          "'json_schema'", param="structured_outputs.disable_any_whitespace")
    whitespace: JsonWhitespace = "compact" if so.disable_any_whitespace else "bounded"
    return attrs.evolve(asked, constraint=attrs.evolve(asked.constraint, whitespace=whitespace))


def one_constraint(asked: Sequence[Asked | None]) -> Asked | None:
    """The request's constraint: at most one field may ask for one."""
    given = [a for a in asked if a is not None]
    if len(given) > 1:
        first, second = given[0], given[1]
        raise bad_request(f"{first.what} and {second.what} each constrain the output; a request takes one of them",
                          param=second.param)
    return given[0] if given else None


def request_constraint(req: GenerationBody, tools: Sequence[JSONObject] = (), tool_choice: ToolChoice = None,
                       parallel_tool_calls: bool | None = None) -> Asked | None:
    """The constraint the fields of a chat or text completion request ask for, if any (``tools`` already
    rendered: empty for text completions and for ``tool_choice: none``)."""
    asked = one_constraint([tool_calls(tools, tool_choice, parallel_tool_calls), response_format(req.response_format),
                            structured_outputs(req.structured_outputs),
                            *llama_cpp_fields(req.grammar, req.json_schema)])
    return json_whitespace(asked, req.structured_outputs)
