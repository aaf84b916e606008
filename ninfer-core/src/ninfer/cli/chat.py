"""``ninfer chat [MODEL]``: an interactive chat in the terminal, on any model with a chat template.

Each line read is a user message; the whole conversation so far is rendered by the model's chat template and
the answer streams as it comes (``stream_printer``): the model's thinking is folded into a
``[thinking... N tokens]`` line unless ``--show-thinking`` (or the ``/think`` command) shows it. Every turn
carries the session's ``session_key``, so the context cache restores the history already computed and only the
new message (and the last answer) is prefilled (docs/context-cache.md).

Ctrl-C while an answer streams stops that answer, not the session: the request is cancelled and the unfinished
turn (the message and the partial answer) is dropped from the history, so the conversation goes on as it stood
before that message (a cut answer would otherwise read to the model as a finished one). Ctrl-C at the prompt,
Ctrl-D, ``/exit`` and ``/quit`` leave; ``/reset`` forgets the conversation; ``/help`` lists the commands.

Stdout carries the answers alone; notices, the folded thinking line when stdout is not a terminal, and the
``--verbose`` stats go to stderr. When stdin is not a terminal, lines are read without a prompt, so a chat can
be scripted (``printf 'Hi\\nAnd then?\\n' | ninfer chat``). The model, sampling and engine flags are
``ninfer generate``'s (``sampling_args``, ``engine_args``). Imports stay lazy so ``ninfer --help`` does not load torch.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import uuid
from typing import TYPE_CHECKING, Any

from ninfer.cli.command_errors import run_reporting_errors
from ninfer.cli.engine_args import add_engine_arguments, engine_config_from_args
from ninfer.cli.generate import check_max_tokens, stats_line
from ninfer.cli.model_args import add_model_argument
from ninfer.cli.sampling_args import add_sampling_arguments, sampling_from_args
from ninfer.cli.stream_printer import StreamPrinter, follow

if TYPE_CHECKING:
    from ninfer.contract import ChatInput, SamplingParams
    from ninfer.engine.engine import Engine

PROMPT = ">>> "
HELP = """\
/think         show or fold the model's thinking
/reset         forget the conversation and start a new one
/exit, /quit   leave (so do Ctrl-D, and Ctrl-C at the prompt)
/help          this list
Ctrl-C while an answer streams stops it; the unfinished turn is left out of the history."""


def add_chat_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with a model in the terminal (history kept, answers streamed)",
                              description="An interactive chat: each line is a user message, the conversation "
                                          "so far is rendered with the model's chat template, and the answer "
                                          "streams. Commands: /help, /think, /reset, /exit. Ctrl-C stops an "
                                          "answer; Ctrl-D (or Ctrl-C at the prompt) leaves. Reads plain lines "
                                          "when stdin is not a terminal.")
    add_model_argument(p)
    p.add_argument("--system", help="a system message that opens the conversation")
    p.add_argument("--no-think", action="store_true", help="chat with thinking disabled (enable_thinking=false)")
    p.add_argument("--show-thinking", action="store_true",
                   help="print the model's thinking as it streams (default: one folded line; /think toggles)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="print the memory plan at the start and each turn's stats (prompt, cached and generated "
                        "tokens, speed) on stderr")
    add_sampling_arguments(p, max_tokens=1024)
    add_engine_arguments(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    # Ctrl-C gets here only while the model loads: the chat handles it at the prompt and during answers
    return run_reporting_errors("chat", _chat, args)


def _chat(args: argparse.Namespace) -> int:
    import ninfer
    from ninfer.engine.engine import Engine
    from ninfer.engine.errors import EngineError
    from ninfer.engine.memory_report import summary_text

    model = ninfer.resolve_model_path(args.model)
    sampling = sampling_from_args(args)
    config = engine_config_from_args(args)
    try:
        with Engine(model, config=config) as engine:
            if args.verbose and engine.memory is not None:
                print(summary_text(engine.memory), file=sys.stderr, flush=True)
            check_max_tokens(args.max_tokens, engine.max_model_len)
            chat = Chat(engine, sampling, system=args.system, thinking=not args.no_think,
                        show_thinking=args.show_thinking, verbose=args.verbose)
            chat.check_template()
            return chat.run()
    except EngineError as exc:
        print(f"ninfer chat: {exc}", file=sys.stderr)
        return 1


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class StopRequests:
    """While a turn streams, Ctrl-C (SIGINT) asks to stop the answer instead of raising KeyboardInterrupt."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> StopRequests:
        self._previous = signal.signal(signal.SIGINT, self._on_interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _on_interrupt(self, signum: int, frame: object) -> None:
        self._requested.set()

    def requested(self) -> bool:
        return self._requested.is_set()


class Chat:
    """One conversation with one engine: its history, its context-cache session and the terminal loop."""

    def __init__(self, engine: Engine, sampling: SamplingParams, *, system: str | None = None, thinking: bool = True,
                 show_thinking: bool = False, verbose: bool = False) -> None:
        self.engine = engine
        self.sampling = sampling
        self.system = [{"role": "system", "content": system}] if system else []
        self.template_kwargs = {} if thinking else {"enable_thinking": False}
        self.show_thinking = show_thinking
        self.verbose = verbose
        self.interactive = sys.stdin.isatty()
        self.history: list[dict[str, Any]] = []
        self.session_key = _new_session_key()

    def _input(self, messages: list[dict[str, Any]]) -> ChatInput:
        from ninfer.contract import ChatInput

        return ChatInput(messages=[*self.system, *messages], template_kwargs=self.template_kwargs)

    def check_template(self) -> None:
        """Fail at the start, not at the first message, when the model cannot render a chat."""
        self.engine.prepare(self._input([{"role": "user", "content": "Hello"}]))

    def run(self) -> int:
        """Read messages and commands until the user leaves; 0 then."""
        if self.interactive:
            _enable_line_editing()
            _say(f"ninfer chat: {self.engine.model_name} · /help lists the commands · Ctrl-C stops an answer, "
                 f"Ctrl-D leaves")
        while True:
            try:
                line = self._read()
            except KeyboardInterrupt:  # Ctrl-C at the prompt leaves
                _say("")
                return 0
            if line is None:  # end of input (Ctrl-D)
                if self.interactive:
                    _say("")
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return 0
                continue
            self.turn(text)

    def _read(self) -> str | None:
        if not self.interactive:
            line = sys.stdin.readline()
            return None if line == "" else line.rstrip("\n")
        try:
            if sys.stdout.isatty():
                return input(PROMPT)
            sys.stderr.write(PROMPT)  # stdout is for the answers alone
            sys.stderr.flush()
            return input()
        except EOFError:
            return None

    def command(self, text: str) -> bool:
        """Run one slash command; False when it ends the chat."""
        name = text.split()[0].lower()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            _say(HELP)
        elif name == "/think":
            self.show_thinking = not self.show_thinking
            _say("thinking is shown" if self.show_thinking else "thinking is folded")
        elif name == "/reset":
            self.reset()
            _say("history cleared")
        else:
            _say(f"unknown command {name}; /help lists the commands")
        return True

    def reset(self) -> None:
        self.history = []
        self.session_key = _new_session_key()  # the old conversation's continuation is of no use to the new one

    def turn(self, message: str) -> None:
        """Send ``message`` with the history and stream the answer; a finished answer joins the history."""
        from ninfer.contract import FinishReason, GenerationRequest
        from ninfer.engine.errors import InputTooLong, RequestRejected

        messages = [*self.history, {"role": "user", "content": message}]
        request = GenerationRequest(input=self._input(messages), sampling=self.sampling,
                                    session_key=self.session_key)
        with StopRequests() as stop:
            try:
                handle = self.engine.submit(request)
            except RequestRejected as exc:
                hint = "; /reset starts a new conversation" if isinstance(exc, InputTooLong) else ""
                _say(f"ninfer chat: {exc}{hint}")
                return
            printer = StreamPrinter(sys.stdout, sys.stderr, labels=False, fold_reasoning=not self.show_thinking)
            result = follow(handle, printer, stop=stop.requested)
        if result is None:
            raise RuntimeError("the answer's stream ended without a result")
        if self.verbose:
            _say(stats_line(result))
        if result.finish_reason is FinishReason.CANCELLED:
            _say("[stopped; this turn is left out of the history]")
        elif result.error is not None:
            _say(f"ninfer chat: {result.error}")
        else:
            if result.finish_reason is FinishReason.LENGTH:
                _say("[the answer reached --max-tokens or the context limit]")
            self.history = [*messages, {"role": "assistant", "content": result.content}]


def _new_session_key() -> str:
    return f"chat-{uuid.uuid4().hex}"


def _enable_line_editing() -> None:
    """Line editing and history at the prompt, where the platform has readline."""
    try:
        import readline  # noqa: F401 - importing it is what makes input() edit lines
    except ImportError:
        pass
