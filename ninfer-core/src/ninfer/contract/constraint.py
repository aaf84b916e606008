"""Constrained decoding: what a request may ask its output to be, and the masks the Program borrows.

A ``Constraint`` rides on ``GenerationRequest.constraint``. The Frontend compiles it when the engine opens
the request's OutputSession (the submitting thread waits while a bounded, killable worker compiles it, before
the request is queued; a constraint it cannot compile, or one past a ``ConstraintLimits`` bound, raises
``ConstraintError``, which the engine reports as a request rejection); the session holds the matcher and moves
it with the output (preview, commit, and nothing else: pause, resume and Replay keep it). When the prompt
opened a thinking block, the constraint applies to the answer after ``</think>``.

Per unit the Program borrows ``TokenMasks`` from the engine and applies the rows of constrained sequences to
their logits before sampling, all of a unit's rows asked for at once (the engine may fill them in parallel).
A row may carry draft tokens (speculative verification): its mask then has one row per position, the allowed
tokens after the committed output and after each draft prefix.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import attrs

from ninfer.contract.values import JSON

if TYPE_CHECKING:
    import torch

# Hard bounds of the types themselves (no request is ever larger); ConstraintLimits sets the working ones.
MAX_CHOICES = 1024
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, grammar or regex text, or all of a choice's options together


def _json_text(value: JSON) -> str | None:
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


JsonWhitespace = Literal["bounded", "compact"]
JSON_WHITESPACE: tuple[JsonWhitespace, ...] = ("bounded", "compact")
MAX_JSON_INDENT = 20  # spaces or tabs after a newline in "bounded" JSON: 10 levels of 2-space indentation


@attrs.frozen(kw_only=True)
class JsonConstraint:
    """Output one JSON value: any JSON when ``schema`` is None, else an instance of the JSON Schema.

    ``whitespace`` between JSON tokens (docs/constrained-decoding.md, "Whitespace in JSON"): ``"bounded"``, none
    before ``:`` and ``,``, at most one space after ``:``, elsewhere nothing, one space, or one newline and at
    most ``MAX_JSON_INDENT`` spaces or tabs (pretty-printed JSON fits, a model cannot spend its budget on
    whitespace); ``"compact"``, none at all outside strings (``,`` and ``:`` separators); None, the engine's
    default (``EngineConfig.json_whitespace``).
    """

    schema: str | None = attrs.field(default=None, converter=_json_text, validator=_bounded)
    whitespace: JsonWhitespace | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(JSON_WHITESPACE)))

    @property
    def schema_object(self) -> JSON:
        return None if self.schema is None else json.loads(self.schema)


@attrs.frozen(kw_only=True)
class RegexConstraint:
    """Output text that fully matches ``pattern`` (no lookaround or backreferences). Its syntax is checked where
    it compiles, after its size (``regex_syntax_error``): parsing a long regex takes seconds, and constraints are
    made where that must not wait (the gateway's event loop)."""

    pattern: str = attrs.field(validator=_bounded)

    @pattern.validator
    def _check(self, attribute, value):
        if not value:
            raise ValueError("the regex is empty")


def regex_syntax_error(pattern: str) -> str | None:
    """Why Python's ``re`` cannot parse ``pattern`` (None: it parses), e.g. ``"missing ), unterminated
    subpattern at position 0"``."""
    try:
        re.compile(pattern)
    except re.error as e:
        return str(e)
    return None


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
        if sum(map(len, value)) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"choice options hold {sum(map(len, value))} characters together; at most "
                             f"{MAX_CONSTRAINT_CHARS}")


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


class ConstraintLimitExceeded(ConstraintError):
    """The constraint is past one of the ``ConstraintLimits`` (``limit`` names the field); the message names
    the limit and the option that raises it."""

    def __init__(self, limit: str, message: str) -> None:
        self.limit = limit
        self.base_message = message
        super().__init__(f"{message} (limit: {limit_option(limit)})")


class ConstraintBusy(RuntimeError):
    """Every compile worker and queue place is taken, or the live matchers hold the whole memory budget: the
    constraint itself may be fine; retry later (the engine answers Overloaded)."""


class ConstraintCancelled(RuntimeError):
    """The caller's cancel event was set while its constraint compiled; the compile was abandoned."""


class ConstraintClosed(RuntimeError):
    """The Frontend was closed (the engine is shutting down) while the constraint compiled."""


KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def _at_least(lo: int):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ValueError(f"{attribute.name} must be an integer >= {lo}, got {value!r}")
    return check


def _seconds(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


@attrs.frozen(kw_only=True)
class ConstraintLimits:
    """What one constrained request may cost, and all of them together (docs/constrained-decoding.md, "Limits").

    A constraint past a size, rule, compile or probe bound is refused with ``ConstraintLimitExceeded`` (HTTP 400
    naming the limit and its ``ninfer serve`` flag); a full compile queue or matcher budget is ``ConstraintBusy``
    (HTTP 429). The defaults leave every compilable schema of the JSONSchemaBench sample
    (``benchmarks/data``) far inside each bound.
    """

    max_schema_bytes: int = attrs.field(default=512 * KIB, validator=_at_least(1))
    """UTF-8 bytes of a JSON schema (for tool calls: of the request's tools)."""
    max_grammar_bytes: int = attrs.field(default=128 * KIB, validator=_at_least(1))
    """UTF-8 bytes of a GBNF or Lark grammar."""
    max_regex_bytes: int = attrs.field(default=16 * KIB, validator=_at_least(1))
    """UTF-8 bytes of a regex."""
    max_choices: int = attrs.field(default=MAX_CHOICES, validator=_at_least(1))
    """Options of a ``choice`` (the type's own bound, MAX_CHOICES, is the most)."""
    max_choice_bytes: int = attrs.field(default=64 * KIB, validator=_at_least(1))
    """UTF-8 bytes of a ``choice``'s options together."""
    max_grammar_rules: int = attrs.field(default=8192, validator=_at_least(1))
    """Rules of the grammar built from the constraint, checked before it is compiled."""
    max_compiled_bytes: int = attrs.field(default=64 * MIB, validator=_at_least(1))
    """Bytes of one compiled grammar (its token-mask cache)."""
    compile_timeout_s: float = attrs.field(default=30.0, validator=_seconds)
    """Wall seconds a compile worker may take to build, compile and probe one grammar (it is killed after); the
    engine then compiles a grammar that passed in about the worker's compile time again."""
    compile_memory_bytes: int = attrs.field(default=1 * GIB, validator=_at_least(64 * MIB))
    """Address space a compile worker may add to what it holds idle (its ``RLIMIT_AS``)."""
    matcher_memory_bytes: int = attrs.field(default=64 * MIB, validator=_at_least(1 * MIB))
    """Memory one request's matcher may grow by: probed at compile time, then checked as it runs."""
    token_time_s: float = attrs.field(default=0.05, validator=_seconds)
    """CPU seconds one matcher step (a token's mask or its acceptance) may take: probed, then checked."""
    compile_workers: int = attrs.field(default=2, validator=_at_least(1))
    """Compile worker processes (started when the first constraint arrives, or at warmup)."""
    compile_queue: int = attrs.field(default=16, validator=_at_least(0))
    """Distinct constraints waiting for a compile worker; one more is ConstraintBusy. A constraint that waits
    longer than ``compile_timeout_s`` for a worker is ConstraintBusy too."""
    total_matcher_bytes: int = attrs.field(default=1 * GIB, validator=_at_least(1 * MIB))
    """Memory all live matchers together may hold (each counted at least at its probed size); a request that
    would pass it is ConstraintBusy, a matcher that grows past it ends its request."""


# The ``ninfer serve`` flag that sets each limit (named in every refusal).
LIMIT_FLAGS = {
    "max_schema_bytes": "--constraint-schema-bytes", "max_grammar_bytes": "--constraint-grammar-bytes",
    "max_regex_bytes": "--constraint-regex-bytes", "max_choices": "--constraint-choices",
    "max_choice_bytes": "--constraint-choice-bytes", "max_grammar_rules": "--constraint-rules",
    "max_compiled_bytes": "--constraint-compiled-bytes", "compile_timeout_s": "--constraint-compile-timeout",
    "compile_memory_bytes": "--constraint-compile-memory", "matcher_memory_bytes": "--constraint-matcher-memory",
    "token_time_s": "--constraint-token-time", "compile_workers": "--constraint-workers",
    "compile_queue": "--constraint-queue", "total_matcher_bytes": "--constraint-total-memory",
}


def limit_option(limit: str) -> str:
    """How an operator raises ``limit``: its ConstraintLimits field and its serve flag."""
    flag = LIMIT_FLAGS.get(limit)
    return f"ConstraintLimits.{limit}" + (f", ninfer serve {flag}" if flag else "")


def mask_words(vocab_size: int) -> int:
    """int32 words of one mask row over ``vocab_size`` logits (bit ``t % 32`` of word ``t // 32``: token t)."""
    return (vocab_size + 31) // 32


@attrs.frozen(kw_only=True, eq=False)
class MaskFill:
    """One constrained sequence's rows of a unit's mask: ``out`` is an int32 host tensor
    [1 + len(drafts), mask_words(V)] to write the tokens allowed after the committed output, then after each
    prefix of ``drafts`` (rows after a draft the constraint refuses, or after a stop token, are all zero)."""

    sequence_id: int
    out: torch.Tensor
    drafts: tuple[int, ...] = attrs.field(default=(), converter=tuple)


@runtime_checkable
class TokenMasks(Protocol):
    """What the engine lends the Program for one unit: the allowed-token bitmask of each constrained row."""

    def constrained(self, sequence_id: int) -> bool:
        """Whether the sequence's next tokens are restricted (False: sample it without a mask)."""

    def fill(self, fills: Sequence[MaskFill]) -> None:
        """Write every ``MaskFill`` (each of a distinct constrained sequence); returns when all are written."""
