"""``ninfer generate``'s constraint options: each becomes its contract constraint, one kind per run, every bad one
is a usage error (exit 2, a message naming the option, no traceback) before a model is loaded, and on the
embedded model (greedy, CPU) the output is of the kind asked for."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ninfer.cli import main
from ninfer.cli.constraint_args import add_constraint_arguments, constraint_from_args
from ninfer.contract import ChoiceConstraint, GrammarConstraint, JsonConstraint, RegexConstraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def parse(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_constraint_arguments(p)
    return constraint_from_args(p.parse_args(list(argv)))


def test_each_option_becomes_its_constraint(tmp_path, monkeypatch):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA), encoding="utf-8")
    assert parse("--json-schema", str(schema)) == JsonConstraint(schema=SCHEMA)
    assert parse("--json-schema", str(schema), "--json-compact") == JsonConstraint(schema=SCHEMA, whitespace="compact")
    schema.write_text("{}", encoding="utf-8")
    assert parse("--json-schema", str(schema)) == JsonConstraint(schema=None)  # {}: any JSON value
    gbnf, lark = tmp_path / "g.gbnf", tmp_path / "g.LARK"
    gbnf.write_text('root ::= "a"', encoding="utf-8")
    lark.write_text('start: "a"', encoding="utf-8")
    assert parse("--grammar", str(gbnf)) == GrammarConstraint(grammar='root ::= "a"', syntax="gbnf")
    assert parse("--grammar", str(lark)) == GrammarConstraint(grammar='start: "a"', syntax="lark")
    assert parse("--regex", r"\d+") == RegexConstraint(pattern=r"\d+")
    assert parse("--choice", "yes", "--choice", "no") == ChoiceConstraint(choices=("yes", "no"))
    assert parse() is None
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(SCHEMA)))
    assert parse("--json-schema", "-") == JsonConstraint(schema=SCHEMA)


@pytest.mark.parametrize("a,b", [(["--regex", "a"], ["--choice", "b"]), (["--json-schema", "f"], ["--grammar", "g"]),
                                 (["--grammar", "g"], ["--regex", "a"])])
def test_kinds_are_mutually_exclusive(capsys, a, b):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "x", *a, *b])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_bad_constraints_are_usage_errors_naming_the_option(tmp_path, capsys):
    def fails(*argv: str) -> str:
        assert main(["generate", "--prompt", "x", "--device", "cpu", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ninfer generate: ") and "Traceback" not in err
        return err

    assert "--json-schema: file not found" in fails("--json-schema", str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{oops", encoding="utf-8")
    assert "--json-schema: the file is not valid JSON" in fails("--json-schema", str(bad))
    bad.write_text("[1]", encoding="utf-8")
    assert "--json-schema: a JSON Schema must be a JSON object, got list" in fails("--json-schema", str(bad))
    bad.write_bytes(b"\xff\xfe")
    assert "--grammar: " in fails("--grammar", str(bad)) and "not UTF-8" in fails("--grammar", str(bad))
    empty = tmp_path / "empty.gbnf"
    empty.write_text("\n", encoding="utf-8")
    assert "--grammar: the grammar is empty" in fails("--grammar", str(empty))
    assert "--regex: the regex does not parse" in fails("--regex", "(a")
    assert "--regex: the regex is empty" in fails("--regex", "")
    assert "--choice: choice options must be non-empty strings" in fails("--choice", "a", "--choice", "")
    assert "--json-compact: applies to --json-schema only" in fails("--regex", "a", "--json-compact")


GREEDY = ["--temperature", "0", "--device", "cpu", "--max-tokens", "400"]
RATING = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["colour", "stars"], "additionalProperties": False}


def generate(capsys, *argv: str) -> str:
    assert main(["generate", *argv, *GREEDY]) == 0
    out, err = capsys.readouterr()
    assert "finish: stop" in err, err
    return out


def test_constrained_output_on_the_embedded_model(tmp_path, capsys):
    schema = tmp_path / "rating.json"
    schema.write_text(json.dumps(RATING), encoding="utf-8")
    out = generate(capsys, "--chat", "Rate the king.", "--no-think", "--json-schema", str(schema), "--json-compact")
    answer = out.removesuffix("\n")  # stdout is no terminal: the answer alone, no label
    jsonschema.validate(json.loads(answer), RATING)
    assert answer == json.dumps(json.loads(answer), separators=(",", ":"), ensure_ascii=False)  # compact
    out = generate(capsys, "--prompt", "KING.\n", "--regex", "(thou|thee) [a-z]{1,8}")
    assert re.fullmatch("(thou|thee) [a-z]{1,8}\n", out), out
    out = generate(capsys, "--prompt", "KING.\n", "--choice", "ay", "--choice", "nay")
    assert out in ("ay\n", "nay\n")
    lark = tmp_path / "greeting.lark"
    lark.write_text('start: ("hail" | "good morrow") " " /[a-z]{2,8}/', encoding="utf-8")
    out = generate(capsys, "--prompt", "KING.\n", "--grammar", str(lark))
    assert re.fullmatch("(hail|good morrow) [a-z]{2,8}\n", out), out


def test_a_constraint_the_compiler_refuses_is_a_usage_error(tmp_path, capsys):
    grammar = tmp_path / "bad.gbnf"
    grammar.write_text('root ::= "a" missing', encoding="utf-8")
    assert main(["generate", "--prompt", "x", "--grammar", str(grammar), *GREEDY]) == 2
    err = capsys.readouterr().err
    message = err[err.find("ninfer generate: "):]  # what follows the memory block of the engine's start
    assert message.startswith("ninfer generate: --grammar: invalid constraint:") and 'Rule "missing"' in err
    assert "Traceback" not in err
    assert main(["generate", "--prompt", "x", "--regex", "a(?=b)", *GREEDY]) == 2
    assert "--regex: invalid constraint: the regex is not valid" in capsys.readouterr().err
