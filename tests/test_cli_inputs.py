"""``generate``, ``score`` and ``inspect`` on the embedded model: explicit file input, the model optional,
plain raw-prompt output, the stats line on its own line, and --max-tokens bounded by the context."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest

import ninfer
from ninfer.cli import main

POEM = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate."
GREEDY = ["--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--device", "cpu"]


@pytest.fixture
def poem_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(POEM, encoding="utf-8")
    return path


def _prompt_tokens(err: str) -> int:
    return int(re.search(r"(\d+) prompt \+", err).group(1))


def test_prompt_is_always_literal_and_files_are_read_only_when_asked(poem_file, capsys, monkeypatch, one_cpu_thread):
    assert main(["generate", "--prompt", POEM, *GREEDY]) == 0
    literal_poem = capsys.readouterr()
    # a --prompt that happens to name a file is still the text itself
    assert main(["generate", "--prompt", str(poem_file), *GREEDY]) == 0
    path_as_text = capsys.readouterr()
    assert _prompt_tokens(path_as_text.err) != _prompt_tokens(literal_poem.err)
    assert main(["generate", "--prompt-file", str(poem_file), *GREEDY]) == 0
    from_file = capsys.readouterr()
    assert from_file.out == literal_poem.out and _prompt_tokens(from_file.err) == _prompt_tokens(literal_poem.err)
    monkeypatch.setattr(sys, "stdin", io.StringIO(POEM))
    assert main(["generate", "--prompt-file", "-", *GREEDY]) == 0
    assert capsys.readouterr().out == literal_poem.out


def test_chat_file_reads_the_message(poem_file, capsys, monkeypatch, one_cpu_thread):
    assert main(["generate", "--chat", POEM, *GREEDY]) == 0
    literal = capsys.readouterr()
    assert main(["generate", "--chat-file", str(poem_file), *GREEDY]) == 0
    assert capsys.readouterr().out == literal.out
    monkeypatch.setattr(sys, "stdin", io.StringIO(POEM))
    assert main(["generate", "--chat-file", "-", *GREEDY]) == 0
    assert capsys.readouterr().out == literal.out
    assert main(["generate", "--chat", str(poem_file), *GREEDY]) == 0
    assert _prompt_tokens(capsys.readouterr().err) != _prompt_tokens(literal.err)


def test_file_options_name_a_missing_or_unreadable_file(tmp_path, capsys):
    assert main(["generate", "--prompt-file", str(tmp_path / "none.txt"), "--device", "cpu"]) == 2
    assert "--prompt-file: file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    assert main(["generate", "--chat-file", str(bad), "--device", "cpu"]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one source only
        main(["generate", "--prompt", "a", "--prompt-file", str(bad)])


def test_raw_prompt_prints_a_plain_continuation_and_piped_chat_the_answer_alone(capsys, one_cpu_thread):
    assert main(["generate", "default", "--prompt", "ROMEO:", *GREEDY]) == 0
    out = capsys.readouterr().out
    assert "[answer]" not in out and "[thinking]" not in out and out.strip()
    assert out.endswith("\n")
    assert main(["generate", "--chat", "Hello", "--no-think", *GREEDY]) == 0
    out = capsys.readouterr().out  # labels are for a terminal (tests/test_generate_pipes.py)
    assert "[answer]" not in out and out.strip() and out.endswith("\n")


def test_stats_line_starts_its_own_line_when_output_and_stats_share_a_stream():
    proc = subprocess.run([sys.executable, "-m", "ninfer", "generate", "--prompt", "ROMEO:", *GREEDY],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    stats = [line for line in proc.stdout.splitlines() if "finish: length" in line]
    assert len(stats) == 1 and stats[0].startswith("finish: length"), proc.stdout


def test_max_tokens_beyond_the_context_is_an_error_before_generating(capsys, one_cpu_thread):
    assert main(["generate", "--prompt", "ROMEO:", "--max-model-len", "64", "--max-tokens", "64",
                 "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--max-tokens 64 exceeds the context: at most 63 tokens" in err
    assert "finish" not in err
    assert main(["generate", "--prompt", "ROMEO:", "--max-tokens", "0", "--device", "cpu"]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
    assert main(["generate", "--prompt", "R", "--max-model-len", "64", "--max-tokens", "63", "--ignore-eos",
                 "--device", "cpu"]) == 0
    assert "finish: length" in capsys.readouterr().err


def test_score_takes_text_literally_the_model_is_optional_and_file_is_explicit(poem_file, capsys, monkeypatch,
                                                                              one_cpu_thread):
    def score(*argv) -> tuple[int, object]:
        rc = main(["score", *argv, "--json", "--device", "cpu"])
        captured = capsys.readouterr()
        if rc:
            return rc, captured.err
        result = json.loads(captured.out)
        return rc, (result["model"], result["token_ids"], result["total_nll"])

    rc, literal = score(POEM)  # the embedded model
    assert rc == 0 and literal[0] == "ninfer-tiny-shakespeare"
    assert score("default", POEM) == (0, literal)
    assert score(ninfer.default_model_path(), POEM) == (0, literal)
    assert score("--file", str(poem_file)) == (0, literal)
    assert score("default", "--file", str(poem_file)) == (0, literal)
    monkeypatch.setattr(sys, "stdin", io.StringIO(POEM))
    assert score("-") == (0, literal)
    rc, path_as_text = score(str(poem_file))
    assert rc == 0 and path_as_text != literal
    rc, err = score()
    assert rc == 2 and "no text to score" in err
    rc, err = score("default", "text", "--file", str(poem_file))
    assert rc == 2 and "not both" in err


def test_inspect_shows_the_embedded_model_without_a_path(capsys):
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{ninfer.default_model_path()}: .ninfer v3")
    assert main(["inspect", "default", "--verify"]) == 0
    assert "all objects verified" in capsys.readouterr().out
