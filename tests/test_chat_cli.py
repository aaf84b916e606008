"""``ninfer chat`` on the embedded model (CPU, fp32): through a pseudo-terminal as a person uses it (answers
stream, the history is kept and restored from the context cache, ``/reset`` clears it, Ctrl-C stops an answer
and not the session, ``/exit`` and Ctrl-C at the prompt leave), and through pipes as a script uses it (the
answers alone on stdout, the thinking folded or shown, commands)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ninfer.testing.terminal import Terminal

CPU = ["--device", "cpu", "--verbose"]
STATS = r"finish: (\w+) \| (\d+) prompt \+ (\d+) generated tokens( \| (\d+) prompt tokens from the context cache)?"


def chat_env() -> dict[str, str]:
    # one thread: tiny CPU models run fastest so, above all on a shared, loaded machine
    return {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb"}


def chat_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ninfer", "chat", *args]


def turn(term: Terminal, message: str) -> tuple[str, re.Match[str]]:
    """Send one message at the prompt; what showed before the answer's stats line (``--verbose``), and that
    line."""
    term.expect(r">>> ")
    term.send(message + "\n")
    term.expect(re.escape(message))  # the terminal's echo
    start = term.mark
    stats = term.expect(STATS)
    return term.text[start:stats.start()], stats


def test_a_conversation_keeps_its_history_until_reset():
    with Terminal(chat_command("--max-tokens", "24", "--temperature", "0", *CPU), env=chat_env()) as term:
        term.expect(r"ninfer chat: ninfer-tiny-shakespeare .* /help")
        answer, first = turn(term, "Hello there")
        assert answer.strip()  # the answer showed, before its stats
        prompt1, generated1 = int(first.group(2)), int(first.group(3))
        _, second = turn(term, "Who are you?")
        # the template renders the whole conversation: the first message, its answer, the new message
        assert int(second.group(2)) > prompt1 + generated1 // 2, (first.group(0), second.group(0))
        assert second.group(5) is not None and int(second.group(5)) > 0  # the history came from the cache
        term.send("/reset\n")
        term.expect("history cleared")
        _, third = turn(term, "Hello there")
        assert int(third.group(2)) == prompt1  # a fresh conversation again
        term.expect(r">>> ")
        term.send("/exit\n")
        assert term.wait() == 0


def test_ctrl_c_stops_the_answer_not_the_session():
    args = ["--max-tokens", "1500", "--ignore-eos", "--temperature", "0", *CPU]
    with Terminal(chat_command(*args), env=chat_env()) as term:
        stopped = []
        for _ in range(2):
            term.expect(r">>> ")
            term.send("Tell me a story\n")
            term.expect("Tell me a story")
            term.expect_output(30)  # the answer is streaming
            term.send("\x03")
            stats = term.expect(STATS)
            term.expect(r"\[stopped; this turn is left out of the history\]")
            stopped.append(stats)
        for stats in stopped:
            assert stats.group(1) == "cancelled" and 0 < int(stats.group(3)) < 1500, stats.group(0)
        # the stopped turn was left out: the second prompt is the first one again, not a longer history
        assert stopped[1].group(2) == stopped[0].group(2)
        term.expect(r">>> ")
        assert ctrl_c_at_the_prompt(term) == 0  # leaves


def ctrl_c_at_the_prompt(term: Terminal) -> int:
    """Press Ctrl-C at the prompt until the chat exits; its exit status. CPython's readline looks for a signal
    only once it waits on the terminal, so a Ctrl-C that lands while the prompt is still being drawn (a loaded
    machine) counts at the next key: a person would press again, and so does this."""
    for _ in range(12):
        term.send("\x03")
        try:
            return term.wait(5)
        except subprocess.TimeoutExpired:
            continue
    raise AssertionError(f"Ctrl-C at the prompt did not end the chat:\n{term.text[-2000:]}")


@pytest.fixture(scope="module")
def think_close_id(embedded_model) -> int:
    from ninfer.artifact import open_artifact
    from ninfer.models.common.qwen.frontend import QwenFrontend

    with open_artifact(embedded_model) as art:
        return QwenFrontend.from_resources(art.frontend).tokenizer.token_id("</think>")


def test_piped_chat_prints_answers_alone_and_folds_or_shows_the_thinking(think_close_id):
    # "</think>" banned and EOS ignored: every token of each answer is thinking
    args = ["--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--logit-bias", f"{think_close_id}=-100", *CPU]
    script = "Hello there\n/think\nHello there\n/bogus\n/help\n"
    proc = subprocess.run(chat_command(*args), input=script, capture_output=True, text=True, env=chat_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""  # no answer text came: stdout carries nothing else (no label, no prompt)
    err = proc.stderr
    assert re.search(r"^\[thinking\.\.\. 8 tokens\]$", err, re.M), err  # folded: one line
    assert "thinking is shown" in err
    shown = err[err.index("thinking is shown"):]
    assert re.search(r"^\[thinking\]\n\S", shown, re.M), err  # then the text itself, under its label
    assert "unknown command /bogus; /help lists the commands" in err
    assert "/reset " in err and "/exit, /quit " in err
    assert ">>>" not in proc.stdout + err  # no prompt when stdin is not a terminal


def test_piped_chat_answers_on_stdout_and_bad_options_fail_before_loading(tmp_path):
    proc = subprocess.run(chat_command("--max-tokens", "16", "--temperature", "0", "--no-think", *CPU),
                          input="Hello there\n", capture_output=True, text=True, env=chat_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "[answer]" not in proc.stdout and "finish:" in proc.stderr
    proc = subprocess.run(chat_command(str(tmp_path / "none.ninfer")), capture_output=True, text=True,
                          env=chat_env(), timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("ninfer chat: ") and "Traceback" not in proc.stderr
