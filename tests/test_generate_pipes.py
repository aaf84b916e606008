"""``ninfer generate``'s output pipes: with stdout not a terminal it carries the answer alone (``| jq .`` reads
a constrained answer), while a terminal shows labelled sections; and bad options (a constraint that does not
build, media for a text-only model) are one line on stderr before the model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from ninfer.cli import main
from ninfer.testing.terminal import Terminal

GREEDY = ["--temperature", "0", "--device", "cpu"]
RATING = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["colour", "stars"], "additionalProperties": False}


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb"}  # tiny CPU models run fastest on one thread


def test_a_piped_constrained_answer_is_exactly_the_json(tmp_path):
    schema = tmp_path / "rating.json"
    schema.write_text(json.dumps(RATING), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "ninfer", "generate", "--chat", "Rate the king.",
                           "--json-schema", str(schema), "--max-tokens", "400", *GREEDY],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), RATING)  # what `| jq .` reads: no label, no reasoning
    assert "finish: stop" in proc.stderr and "memory: " in proc.stderr


def test_a_terminal_shows_the_labels():
    argv = [sys.executable, "-m", "ninfer", "generate", "--chat", "Hello", "--no-think", "--max-tokens", "4",
            "--ignore-eos", *GREEDY]
    with Terminal(argv, env=env()) as term:
        term.expect(r"\[answer\]\n\S")
        term.expect(r"\nfinish: length \| \d+ prompt \+ 4 generated tokens")  # the stats on their own line
        assert term.wait() == 0


def bad(capsys, *argv: str) -> str:
    """Run ``generate`` with a bad option; its one-line error, checked to come before the model loads."""
    assert main(["generate", "--chat", "x", *GREEDY, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("ninfer generate: "), err
    assert "memory:" not in err and "Traceback" not in err  # the engine never started
    return err


def test_bad_constraints_fail_before_the_model_loads(tmp_path, capsys):
    assert "--json-schema: file not found" in bad(capsys, "--json-schema", str(tmp_path / "none.json"))
    schema = tmp_path / "s.json"
    schema.write_text("{oops", encoding="utf-8")
    assert "--json-schema: the file is not valid JSON" in bad(capsys, "--json-schema", str(schema))
    schema.write_text('{"type": "integer", "minimum": "one"}', encoding="utf-8")
    assert "--json-schema: invalid constraint: the JSON schema" in bad(capsys, "--json-schema", str(schema))
    assert "--grammar: file not found" in bad(capsys, "--grammar", str(tmp_path / "none.gbnf"))
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "a" missing', encoding="utf-8")
    err = bad(capsys, "--grammar", str(grammar))
    assert err.startswith("ninfer generate: --grammar: invalid constraint:") and 'Rule "missing"' in err
    grammar.write_text("root ::= x\nx ::= x", encoding="utf-8")
    assert "--grammar: invalid constraint: the grammar derives no sentence" in bad(capsys, "--grammar", str(grammar))
    assert "--regex: invalid constraint: the regex is not valid" in bad(capsys, "--regex", "a(?=b)")


@pytest.mark.parametrize("option", [["--image"], ["--video"]])
def test_media_for_a_text_only_model_fails_before_the_model_loads(tmp_path, capsys, option):
    picture = tmp_path / "picture.png"
    picture.write_bytes(b"\x89PNG not decoded: the header check comes first")
    err = bad(capsys, *option, str(picture))
    assert f"{option[0]}: " in err and "is a text-only model (its artifact has no vision tower)" in err
