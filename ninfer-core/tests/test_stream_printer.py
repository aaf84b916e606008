"""StreamPrinter: on a terminal (a real pseudo-terminal) a generation prints in labelled, styled sections and
folded thinking is one line redrawn in place; when stdout is not a terminal it gets the output alone and the
reasoning goes to stderr under its label, folded or not."""

from __future__ import annotations

import io
import os
import re
import select

import pytest

from ninfer.cli.stream_printer import StreamPrinter
from ninfer.contract.events import OutputDelta, ToolCall

EVENTS = [OutputDelta(token_ids=(1,)),  # a token whose text is held back
          OutputDelta(reasoning="Let me", token_ids=(2, 3)),
          OutputDelta(reasoning=" think.", token_ids=(4,)),
          OutputDelta(token_ids=(5,)),  # the end of the thinking block: no text
          OutputDelta(content='{"a": 1}', token_ids=(6, 7))]
CALL = ToolCall(id="call-1", name="lookup", arguments='{"q": "x"}')


def play(printer: StreamPrinter, *, call: bool = False) -> None:
    for event in EVENTS:
        printer.delta(event)
    if call:
        printer.tool_calls([CALL])
    printer.end()


@pytest.fixture
def terminal():
    """A text stream on a pseudo-terminal, and a function returning what the terminal received so far."""
    master, slave = os.openpty()
    stream = open(slave, "w", encoding="utf-8")  # noqa: SIM115 - closed below

    def received() -> str:
        stream.flush()
        chunks = []
        while select.select([master], [], [], 0.5)[0]:
            chunks.append(os.read(master, 65536))
        return b"".join(chunks).decode().replace("\r\n", "\n")

    yield stream, received
    stream.close()
    os.close(master)


def test_a_pipe_gets_the_output_alone_and_the_reasoning_goes_to_stderr():
    out, err = io.StringIO(), io.StringIO()
    play(StreamPrinter(out, err, labels=True), call=True)
    assert out.getvalue() == '{"a": 1}\nlookup {"q": "x"}\n'
    assert err.getvalue() == "[thinking]\nLet me think.\n"
    out, err = io.StringIO(), io.StringIO()
    play(StreamPrinter(out, err, labels=False, fold_reasoning=True))
    assert out.getvalue() == '{"a": 1}\n'
    assert err.getvalue() == "[thinking... 5 tokens]\n"  # every token before the answer, written once


def test_a_terminal_gets_labelled_styled_sections(terminal):
    stream, received = terminal
    play(StreamPrinter(stream, io.StringIO(), labels=True), call=True)
    shown = received()
    plain = re.sub(r"\x1b\[[0-9;]*m", "", shown)
    assert plain == '[thinking]\nLet me think.\n[answer]\n{"a": 1}\n[tool call]\nlookup {"q": "x"}\n'
    assert "\x1b[2mLet me\x1b[0m" in shown and "\x1b[1m[answer]\x1b[0m" in shown  # dim thinking, bold labels


def test_a_terminal_redraws_the_folded_thinking_line_in_place(terminal):
    stream, received = terminal
    play(StreamPrinter(stream, io.StringIO(), labels=False, fold_reasoning=True))
    shown = re.sub(r"\x1b\[[0-9;]*m", "", received())
    lines = shown.split("\n")
    assert lines[0].split("\r\x1b[2K")[1:] == ["[thinking... 3 tokens]", "[thinking... 4 tokens]",
                                               "[thinking... 5 tokens]", "[thinking... 5 tokens]"]
    assert lines[1:] == ['{"a": 1}', ""]  # no [answer] label: nothing was shown before it
