"""``ninfer generate``'s constrained-decoding options: ``--json-schema FILE``, ``--grammar FILE``, ``--regex
PATTERN`` and ``--choice TEXT`` (repeatable), one kind per run; ``--json-compact`` writes the JSON without
whitespace outside strings.

Light at import (argparse and the constraint contract only), so ``ninfer --help`` loads no torch. A file that
cannot be read, a constraint the contract refuses, or one whose grammar does not build (``check_constraint_builds``,
before the model loads) is a ValueError naming the option, which the command reports as a usage error; what only
the compiler can judge against the model's vocabulary (and the engine's size limits) is rejected at submit.
"""

from __future__ import annotations

import argparse
import json

from ninfer.cli.text_files import read_text_file
from ninfer.contract.constraint import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    JsonConstraint,
    RegexConstraint,
    regex_syntax_error,
)


def add_constraint_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("constrained decoding (one kind per run; docs/constrained-decoding.md)")
    kinds = group.add_mutually_exclusive_group()
    kinds.add_argument("--json-schema", metavar="FILE",
                       help="output one JSON value valid against the JSON Schema in FILE (- for stdin); a file "
                            "holding {} allows any JSON value")
    kinds.add_argument("--grammar", metavar="FILE",
                       help="output a sentence of the grammar in FILE: GBNF (root rule 'root'), or Lark (rule "
                            "'start') when FILE ends in .lark")
    kinds.add_argument("--regex", metavar="PATTERN", help="output text that fully matches PATTERN")
    kinds.add_argument("--choice", metavar="TEXT", action="append",
                       help="output exactly one of the --choice texts (repeat it for each option)")
    group.add_argument("--json-compact", action="store_true",
                       help="with --json-schema: no whitespace outside strings (default: at most one space after ':', "
                            "and a space or a newline and up to 20 spaces or tabs between values)")


def constraint_option(args: argparse.Namespace) -> str | None:
    """The constraint option given (they are mutually exclusive), or None."""
    given = {"--json-schema": args.json_schema, "--grammar": args.grammar, "--regex": args.regex,
             "--choice": args.choice}
    return next((option for option, value in given.items() if value is not None), None)


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The constraint the options ask for (None: none); a bad one is a ValueError naming its option."""
    if args.json_compact and args.json_schema is None:
        raise ValueError("--json-compact: applies to --json-schema only")
    if args.json_schema is not None:
        option, make = "--json-schema", lambda: _json_schema(read_text_file(args.json_schema, "--json-schema"),
                                                             compact=args.json_compact)
    elif args.grammar is not None:
        syntax = "lark" if args.grammar.lower().endswith(".lark") else "gbnf"
        option, make = "--grammar", lambda: GrammarConstraint(grammar=read_text_file(args.grammar, "--grammar"), syntax=syntax)
    elif args.regex is not None:
        option, make = "--regex", lambda: _regex(args.regex)
    elif args.choice is not None:
        option, make = "--choice", lambda: ChoiceConstraint(choices=args.choice)
    else:
        return None
    try:
        return make()
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(option) else f"{option}: {message}") from None


def _regex(pattern: str) -> RegexConstraint:
    constraint = RegexConstraint(pattern=pattern)
    error = regex_syntax_error(pattern)
    if error is not None:
        raise ValueError(f"the regex does not parse: {error}")
    return constraint


def _json_schema(text: str, *, compact: bool) -> JsonConstraint:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the file is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON Schema must be a JSON object, got {type(schema).__name__}")
    return JsonConstraint(schema=schema or None, whitespace="compact" if compact else None)


def check_constraint_builds(constraint: Constraint | None, args: argparse.Namespace) -> None:
    """What can be judged of ``constraint`` without the model's vocabulary: its grammar builds (the grammar
    syntax, the regex, the JSON Schema's keywords) and derives a sentence. Run before the weights load; a
    failure is a ValueError naming the option. The engine checks it again, with its limits, when it compiles."""
    if constraint is None:
        return
    from ninfer.contract.constraint import ConstraintError
    from ninfer.models.common.grammar.build import build_grammar, kind_of
    from ninfer.models.common.grammar.productive import derives_a_sentence, grammar_shape

    try:
        grammar = build_grammar(constraint, reasoning_open=False, tools=())
        if not derives_a_sentence(grammar_shape(grammar)):
            raise ConstraintError(f"{kind_of(constraint)} derives no sentence: every derivation of its start rule "
                                  f"recurses forever, so no output could complete it")
    except ConstraintError as exc:
        raise ValueError(f"{constraint_option(args)}: invalid constraint: {exc}") from None
