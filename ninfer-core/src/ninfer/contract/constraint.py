"""Constrained decoding: what a request may ask its output to be, and the masks the Program borrows.

A ``Constraint`` rides on ``GenerationRequest.constraint``. The Frontend compiles it when the engine opens
the request's OutputSession (on the submitting thread, before the request is queued; a constraint it cannot
compile raises ``ConstraintError``, which the engine reports as a request rejection); the session holds the
matcher and moves it with the output (preview, commit, and nothing else: pause, resume and Replay keep it).
When the prompt opened a thinking block, the constraint applies to the answer after ``</think>``.

Per unit the Program borrows ``TokenMasks`` from the engine and applies the rows of constrained sequences to
their logits before sampling, all of a unit's rows asked for at once (the engine may fill them in parallel).
A row may carry draft tokens (speculative verification): its mask then has one row per position, the allowed
tokens after the committed output and after each draft prefix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

MAX_CHOICES = 1024
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, grammar or regex text; far above any real one


def _json_text(value: Any) -> str | None:
    """A schema given as a mapping or as JSON text, kept as JSON text (hashable; the compile cache's key)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    else:
        parsed = value
    if not isinstance(parsed, Mapping | bool):
        raise ValueError(f"a JSON schema must be an object (or a boolean), got {type(parsed).__name__}")
    try:
        return json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"the JSON schema cannot be written as JSON: {e}") from e


def _bounded(instance, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and len(value) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{attribute.name} holds {len(value)} characters; at most {MAX_CONSTRAINT_CHARS}")


@attrs.frozen(kw_only=True)
class JsonConstraint:
    """Output one JSON value: any JSON when ``schema`` is None, else an instance of the JSON Schema.

    ``any_whitespace=False`` writes JSON compactly, with ``", "`` and ``": "`` separators; True allows
    whitespace between tokens (each run bounded, so a model cannot spin on spaces).
    """

    schema: str | None = attrs.field(default=None, converter=_json_text, validator=_bounded)
    any_whitespace: bool = True

    @property
    def schema_object(self) -> Any:
        return None if self.schema is None else json.loads(self.schema)


@attrs.frozen(kw_only=True)
class RegexConstraint:
    """Output text that fully matches ``pattern`` (no lookaround or backreferences)."""

    pattern: str = attrs.field(validator=_bounded)

    @pattern.validator
    def _check(self, attribute, value):
        if not value:
            raise ValueError("the regex is empty")
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"the regex does not parse: {e}") from e


@attrs.frozen(kw_only=True)
class ChoiceConstraint:
    """Output exactly one of ``choices`` (literal strings, not patterns)."""

    choices: tuple[str, ...] = attrs.field(converter=tuple)

    @choices.validator
    def _check(self, attribute, value):
        if not value:
            raise ValueError("choice needs at least one option")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"choice allows at most {MAX_CHOICES} options, got {len(value)}")
        for c in value:
            if not isinstance(c, str) or not c:
                raise ValueError(f"choice options must be non-empty strings, got {c!r}")


@attrs.frozen(kw_only=True)
class GrammarConstraint:
    """Output a sentence of a context-free grammar: GBNF (llama.cpp's, root rule ``root``) or Lark (rule ``start``)."""

    grammar: str = attrs.field(validator=_bounded)
    syntax: Literal["gbnf", "lark"] = attrs.field(default="gbnf", validator=attrs.validators.in_(("gbnf", "lark")))

    @grammar.validator
    def _check(self, attribute, value):
        if not value.strip():
            raise ValueError("the grammar is empty")


@attrs.frozen(kw_only=True)
class ToolCallConstraint:
    """Tool calls in the model's own format over the request's tools (``ChatInput.tools``).

    ``tool_choice``: ``"required"`` (at least one call), ``"auto"`` (free text or calls, each call's arguments
    held to its tool's schema) or the name of the one function to call. ``parallel``: more than one call allowed.
    """

    tool_choice: str = attrs.field(default="required")
    parallel: bool = True

    @tool_choice.validator
    def _check(self, attribute, value):
        if not isinstance(value, str) or not value:
            raise ValueError(f"tool_choice must be 'required', 'auto' or a function name, got {value!r}")


Constraint = JsonConstraint | RegexConstraint | ChoiceConstraint | GrammarConstraint | ToolCallConstraint
CONSTRAINT_TYPES = (JsonConstraint, RegexConstraint, ChoiceConstraint, GrammarConstraint, ToolCallConstraint)


class ConstraintError(ValueError):
    """The Frontend cannot compile a constraint (syntax, an unsupported schema feature, an unknown tool);
    the message names the problem. The engine rejects the request with it."""


def mask_words(vocab_size: int) -> int:
    """int32 words of one mask row over ``vocab_size`` logits (bit ``t % 32`` of word ``t // 32``: token t)."""
    return (vocab_size + 31) // 32


@attrs.frozen(kw_only=True, eq=False)
class MaskFill:
    """One constrained sequence's rows of a unit's mask: ``out`` is an int32 host tensor
    [1 + len(drafts), mask_words(V)] to write the tokens allowed after the committed output, then after each
    prefix of ``drafts`` (rows after a draft the constraint refuses, or after a stop token, are all zero)."""

    sequence_id: int
    out: Any
    drafts: tuple[int, ...] = attrs.field(default=(), converter=tuple)


@runtime_checkable
class TokenMasks(Protocol):
    """What the engine lends the Program for one unit: the allowed-token bitmask of each constrained row."""

    def constrained(self, sequence_id: int) -> bool:
        """Whether the sequence's next tokens are restricted (False: sample it without a mask)."""

    def fill(self, fills: Sequence[MaskFill]) -> None:
        """Write every ``MaskFill`` (each of a distinct constrained sequence); returns when all are written."""
