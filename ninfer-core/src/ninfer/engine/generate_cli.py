"""``ninfer generate [MODEL] --prompt TEXT | --chat TEXT``: stream one generation to the terminal.

Reasoning is printed apart from the answer (dimmed on a terminal, under its own header), tool calls as
name + JSON arguments; the end prints time to first token and tokens/s to stderr. Imports stay lazy so
``ninfer --help`` does not load torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO


def add_generate_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt or a chat message, streamed",
                              description="Generate with a .ninfer model and stream the output to the terminal. "
                                          "--prompt sends raw text; --chat renders one user message (and "
                                          "--system) with the model's chat template.")
    p.add_argument("model", nargs="?", help="a .ninfer artifact (default: the embedded model, when installed)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw completion prompt (text, a UTF-8 file path, or - for stdin)")
    source.add_argument("--chat", help="a user message for the chat template (text, file path, or -)")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--no-think", action="store_true", help="chat with thinking disabled (enable_thinking=false)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the model's generation config)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: the model's)")
    p.add_argument("--top-k", type=int, help="top-k sampling (default: the model's)")
    p.add_argument("--seed", type=int, help="sampling seed (reproducible output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence tokens")
    p.add_argument("--chat-template", help="chat template file (or builtin:qwen3_5) replacing the artifact's")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="read special-token strings in --chat/--system text (e.g. <|im_end|>) as control tokens "
                        "(default: plain text)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                   help="prompt tokens per prefill unit (default: 2048 on a GPU, 512 on the CPU)")
    p.set_defaults(func=cmd_generate)


def _read(arg: str) -> str:
    if arg == "-":
        return sys.stdin.read()
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            return f.read()
    return arg


def _template_arg(arg: str | None) -> str | None:
    if arg is None or arg.startswith("builtin:"):
        return arg
    if not os.path.isfile(arg):
        raise ValueError(f"chat template file not found: {arg}")
    with open(arg, encoding="utf-8") as f:
        return f.read()


def _default_model() -> str | None:
    import ninfer

    helper = getattr(ninfer, "default_model_path", None)
    return helper() if callable(helper) else None


class _Printer:
    """Writes reasoning and answer as separate sections; styles only on a terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.section: str | None = None

    def _enter(self, section: str) -> None:
        if section == self.section:
            return
        if self.section is not None:
            self.out.write("\n")
        header = {"reasoning": "[thinking]", "content": "[answer]", "tool": "[tool call]"}[section]
        self.out.write(f"\x1b[1m{header}\x1b[0m\n" if self.tty else f"{header}\n")
        self.section = section

    def reasoning(self, text: str) -> None:
        self._enter("reasoning")
        self.out.write(f"\x1b[2m{text}\x1b[0m" if self.tty else text)
        self.out.flush()

    def content(self, text: str) -> None:
        self._enter("content")
        self.out.write(text)
        self.out.flush()

    def tool_call(self, name: str, arguments: str) -> None:
        self._enter("tool")
        self.out.write(f"{name} {arguments}\n")
        self.out.flush()

    def end(self) -> None:
        if self.section is not None:
            self.out.write("\n")
            self.out.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except KeyboardInterrupt:
        print("\nninfer generate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise  # the reader of stdout left: ninfer.cli.main ends quietly
    except (OSError, ValueError, TypeError, LookupError, RuntimeError) as exc:
        print(f"ninfer generate: {exc}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from ninfer.contract import (
        ChatInput,
        GenerationRequest,
        GenerationResult,
        OutputDelta,
        SamplingParams,
        TextInput,
    )
    from ninfer.contract.events import merge_tool_call_fragments
    from ninfer.engine.engine import Engine
    from ninfer.engine.errors import EngineError

    model = args.model or _default_model()
    if model is None:
        raise ValueError("no model given and no embedded default model is available in this installation")
    if not os.path.exists(model):
        raise ValueError(f"model file not found: {model}")
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": _read(args.chat)}]
        kwargs = {"enable_thinking": False} if args.no_think else {}
        request_input = ChatInput(messages=messages, template_kwargs=kwargs)
    else:
        if args.system or args.no_think:
            raise ValueError("--system and --no-think apply to --chat only")
        request_input = TextInput(text=_read(args.prompt))
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    options = {"max_concurrency": 1, "device": args.device, "max_model_len": args.max_model_len,
               "chat_template": _template_arg(args.chat_template), "prefill_chunk": args.prefill_chunk,
               "special_tokens_in_content": args.special_tokens_in_content or None}
    try:
        with Engine(model, **{k: v for k, v in options.items() if v is not None}) as engine:
            handle = engine.submit(GenerationRequest(input=request_input, sampling=sampling))
            return _stream(handle, sys.stdout, GenerationResult, OutputDelta, merge_tool_call_fragments)
    except EngineError as exc:
        print(f"ninfer generate: {exc}", file=sys.stderr)
        return 1


def _stream(handle, out: TextIO, result_type, delta_type, merge) -> int:
    printer = _Printer(out)
    fragments = []
    for event in handle:
        if isinstance(event, delta_type):
            if event.reasoning:
                printer.reasoning(event.reasoning)
            if event.content:
                printer.content(event.content)
            fragments.extend(event.tool_calls)
        elif isinstance(event, result_type):
            for call in merge(fragments):
                printer.tool_call(call.name, call.arguments)
            printer.end()
            return _report(event)
    return 1


def _report(result) -> int:
    if result.error is not None:
        print(f"ninfer generate: {result.error}", file=sys.stderr)
        return 1
    t = result.timings
    n = result.usage.completion_tokens
    parts = [f"finish: {result.finish_reason.value}", f"{result.usage.prompt_tokens} prompt + {n} generated tokens"]
    if t.time_to_first_token_s is not None:
        parts.append(f"TTFT {t.time_to_first_token_s * 1000:.1f} ms")
        decode_s = t.end_to_end_s - t.time_to_first_token_s
        if n > 1 and decode_s > 0:
            parts.append(f"{(n - 1) / decode_s:.1f} tokens/s")
    if t.end_to_end_s > 0:
        parts.append(f"{n / t.end_to_end_s:.1f} tokens/s end to end")
    print(" | ".join(parts), file=sys.stderr)
    return 0
