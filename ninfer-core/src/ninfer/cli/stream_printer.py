"""Printing one streamed generation for a person at a terminal or for a pipe.

On a terminal the output comes in sections: reasoning under ``[thinking]`` (dimmed), the answer (under
``[answer]`` when the command labels it, or when another section came before), tool calls under ``[tool call]``
as name + JSON arguments. When stdout is not a terminal it carries the output alone (the answer text and the
tool calls' lines, no label, no style), so ``ninfer generate --chat ... --json-schema s.json | jq .`` reads
exactly the answer; the reasoning then goes to stderr, under its label.

Folded reasoning (``ninfer chat`` without ``--show-thinking``) prints no reasoning text, only a
``[thinking... N tokens]`` line: updated in place on a terminal, written once the reasoning ends elsewhere.

Light at import (the event contracts only), so ``ninfer --help`` loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

from ninfer.contract.events import GenerationResult, OutputDelta, ToolCall

if TYPE_CHECKING:
    from ninfer.engine.handle import Event, GenerationHandle

HEADERS = {"reasoning": "[thinking]", "content": "[answer]", "tool": "[tool call]"}
BOLD, DIM, RESET, CLEAR_LINE = "\x1b[1m", "\x1b[2m", "\x1b[0m", "\r\x1b[2K"
POLL_S = 0.05  # how often a stream that can be stopped looks at its stop flag while no event comes


def _isatty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


class _Stream:
    """One text stream and whether its cursor is at the start of a line."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.tty = _isatty(file)
        self.at_line_start = True

    def write(self, text: str) -> None:
        if text:
            self.file.write(text)
            self.at_line_start = text.endswith("\n")

    def styled(self, style: str, text: str) -> None:
        self.write(f"{style}{text}{RESET}" if self.tty else text)

    def end_line(self) -> None:
        if not self.at_line_start:
            self.write("\n")

    def flush(self) -> None:
        self.file.flush()


class StreamPrinter:
    """Writes one generation's reasoning, answer and tool calls (see the module's docstring).

    ``labels``: head the answer with ``[answer]`` on a terminal even when it comes first (``generate --chat``);
    without it the answer is a plain continuation unless a shown section came before. ``fold_reasoning``:
    count the reasoning instead of printing it."""

    def __init__(self, out: TextIO, err: TextIO, *, labels: bool = True, fold_reasoning: bool = False) -> None:
        self.out = _Stream(out)
        self.aside = self.out if self.out.tty else _Stream(err)  # where reasoning and its label go
        self.labels = labels
        self.fold_reasoning = fold_reasoning
        self.section: str | None = None
        self.shown: str | None = None  # the last section whose text (not a folded count) was printed
        self.reasoning_tokens = 0

    def _enter(self, section: str) -> None:
        if section == self.section:
            return
        self._close_section()
        if section == "reasoning":
            self.aside.end_line()  # the folded line is redrawn in place: it must have its line to itself
            if not self.fold_reasoning:
                self.aside.styled(BOLD, HEADERS["reasoning"])
                self.aside.write("\n")
        else:
            self.out.end_line()
            if self.out.tty and (section == "tool" or self.labels or self.shown is not None):
                self.out.styled(BOLD, HEADERS[section])
                self.out.write("\n")
        self.section = section

    def _close_section(self) -> None:
        if self.section == "reasoning" and self.fold_reasoning:
            self._draw_fold_line()  # its final count
            self.aside.write("\n")
            self.aside.flush()
        elif self.section is not None:
            self.shown = self.section

    def _draw_fold_line(self) -> None:
        """The folded line with the count so far: redrawn in place on a terminal, written once elsewhere (when
        the reasoning ends)."""
        if self.aside.tty:
            self.aside.write(CLEAR_LINE)
        self.aside.styled(DIM, f"[thinking... {self.reasoning_tokens} tokens]")

    def _count(self, tokens: int) -> None:
        self.reasoning_tokens += tokens
        if self.section == "reasoning" and self.fold_reasoning and self.aside.tty:
            self._draw_fold_line()
            self.aside.flush()

    def reasoning(self, text: str, tokens: int = 0) -> None:
        """Reasoning text, and how many tokens it took (counted for the folded line)."""
        self._enter("reasoning")
        if not self.fold_reasoning:
            self.aside.styled(DIM, text)
        self._count(tokens)
        self.aside.flush()

    def content(self, text: str) -> None:
        self._enter("content")
        self.out.write(text)
        self.out.flush()

    def delta(self, event: OutputDelta) -> None:
        """One delta's text. Its tokens count as reasoning when it carries no answer text and the answer has
        not begun (a token whose text is held back, or the end of the thinking block, has none)."""
        if event.content:
            if event.reasoning:
                self.reasoning(event.reasoning)
            self.content(event.content)
        elif event.reasoning:
            self.reasoning(event.reasoning, len(event.token_ids))
        elif self.section in (None, "reasoning"):
            self._count(len(event.token_ids))

    def tool_calls(self, calls: Sequence[ToolCall]) -> None:
        for call in calls:
            self._enter("tool")
            self.out.write(f"{call.name} {call.arguments}\n")
        self.out.flush()

    def end(self) -> None:
        """Close the last section and finish both streams' lines, so what comes next (the stats on stderr)
        starts its own line."""
        self._close_section()
        self.section = None
        self.out.end_line()
        self.aside.end_line()
        self.out.flush()
        self.aside.flush()


def follow(handle: GenerationHandle, printer: StreamPrinter, *, stop: Callable[[], bool] | None = None) -> GenerationResult | None:
    """Print ``handle``'s output as it comes and return its final result (None if the stream ended without one).

    ``stop`` is asked between events (at least every ``POLL_S`` seconds); once it answers True the request is
    cancelled (once) and the stream is followed to its final result, whose finish reason then says cancelled.
    Leaving early (an exception, KeyboardInterrupt) cancels the request and releases the handle."""
    try:
        for event in handle if stop is None else _until_stopped(handle, stop):
            if isinstance(event, OutputDelta):
                printer.delta(event)
            elif isinstance(event, GenerationResult):
                printer.tool_calls(event.tool_calls)  # complete calls (the deltas carry fragments)
                return event
    finally:
        printer.end()  # also when interrupted: a message on stderr starts its own line
    return None


def _until_stopped(handle: GenerationHandle, stop: Callable[[], bool]) -> Iterator[Event]:
    """``handle``'s events, cancelling the request once ``stop()`` says so; the handle is released at the end."""
    cancelled = False
    try:
        while True:
            if not cancelled and stop():
                handle.cancel()
                cancelled = True
            try:
                event = handle.next_event(timeout=POLL_S)
            except TimeoutError:
                continue
            if event is None:
                return
            yield event
    finally:
        handle.close()  # cancels a request still running (the caller left early), then releases it
