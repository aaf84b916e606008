"""``ninfer generate [MODEL] --prompt TEXT | --prompt-file PATH | --chat TEXT | --chat-file PATH``.

Streams one generation to the terminal. A raw prompt's continuation is printed as is; chat output is
printed in sections: reasoning apart from the answer (dimmed on a terminal, under its own header), tool
calls as name + JSON arguments. The start prints the memory it took (a short block on stderr,
``memory_report``); the end prints time to first token and tokens/s to stderr, on a line
of its own. Text arguments are always text: files (or stdin, ``-``) are read only through the ``-file``
options. ``--json-schema``, ``--grammar``, ``--regex`` and ``--choice`` constrain the output (constraint_cli);
``--speculative mtp`` decodes with drafts (speculative_cli), and the stats line then adds their acceptance.
``--image`` and ``--video`` put media into the chat message; ``--vision`` selects the encoder (vision_cli).
Imports stay lazy so ``ninfer --help`` does not load torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from ninfer.engine.cache_cli import add_context_cache_arguments, with_context_cache
from ninfer.engine.constraint_cli import add_constraint_arguments, constraint_from_args, constraint_option
from ninfer.engine.plan_cli import add_memory_arguments, with_memory_options
from ninfer.engine.sampling_cli import add_adjustment_arguments, adjustments_from_args
from ninfer.engine.speculative_cli import add_speculative_arguments, speculative_features
from ninfer.engine.vision_cli import (
    add_media_arguments,
    add_vision_argument,
    media_from_args,
    user_content,
    with_vision,
)


def add_generate_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt or a chat message, streamed",
                              description="Generate with a .ninfer model and stream the output to the terminal. "
                                          "--prompt sends raw text; --chat renders one user message (and "
                                          "--system) with the model's chat template.")
    p.add_argument("model", nargs="?", help="a .ninfer artifact, or 'default' (default: the embedded model)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="raw completion prompt, taken literally")
    source.add_argument("--prompt-file", metavar="PATH", help="raw completion prompt from a UTF-8 file (- for stdin)")
    source.add_argument("--chat", metavar="TEXT", help="a user message for the chat template, taken literally")
    source.add_argument("--chat-file", metavar="PATH", help="the user message from a UTF-8 file (- for stdin)")
    p.add_argument("--system", help="system message for --chat or --chat-file")
    p.add_argument("--no-think", action="store_true", help="chat with thinking disabled (enable_thinking=false)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the model's generation config)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: the model's)")
    p.add_argument("--top-k", type=int, help="top-k sampling (default: the model's)")
    p.add_argument("--seed", type=int, help="sampling seed (reproducible output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence tokens")
    add_adjustment_arguments(p)
    p.add_argument("--chat-template", help="chat template file (or builtin:qwen3_5) replacing the artifact's")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="read special-token strings in --chat/--system text (e.g. <|im_end|>) as control tokens "
                        "(default: plain text)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--no-verify", action="store_true", help="load without checking the artifact's checksums")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    add_memory_arguments(p)
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                   help="prompt tokens per prefill unit (default: 2048 on a GPU, 512 on the CPU)")
    add_constraint_arguments(p)
    add_context_cache_arguments(p)
    add_speculative_arguments(p)
    add_vision_argument(p)
    add_media_arguments(p)
    p.set_defaults(func=cmd_generate)


def read_text_file(path: str, option: str) -> str:
    """The UTF-8 text of ``path`` (``-``: stdin) for ``option``; a missing or non-UTF-8 file is a ValueError."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{option}: file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{option}: {path} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None


def _template_arg(arg: str | None) -> str | None:
    if arg is None or arg.startswith("builtin:"):
        return arg
    if not os.path.isfile(arg):
        raise ValueError(f"chat template file not found: {arg}")
    with open(arg, encoding="utf-8") as f:
        return f.read()


class _Printer:
    """Writes reasoning, answer and tool calls as separate sections; styles only on a terminal.

    ``labels=False`` (a raw prompt) prints the answer as a plain continuation, without a header, unless
    another section came before it."""

    def __init__(self, out: TextIO, *, labels: bool = True) -> None:
        self.out = out
        self.tty = out.isatty()
        self.labels = labels
        self.section: str | None = None
        self.at_line_start = True

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.at_line_start = text.endswith("\n")

    def _enter(self, section: str) -> None:
        if section == self.section:
            return
        if not self.at_line_start:
            self._write("\n")
        if self.labels or self.section is not None or section != "content":
            header = {"reasoning": "[thinking]", "content": "[answer]", "tool": "[tool call]"}[section]
            self._write(f"\x1b[1m{header}\x1b[0m\n" if self.tty else f"{header}\n")
        self.section = section

    def reasoning(self, text: str) -> None:
        self._enter("reasoning")
        self._write(f"\x1b[2m{text}\x1b[0m" if self.tty else text)
        self.out.flush()

    def content(self, text: str) -> None:
        self._enter("content")
        self._write(text)
        self.out.flush()

    def tool_call(self, name: str, arguments: str) -> None:
        self._enter("tool")
        self._write(f"{name} {arguments}\n")
        self.out.flush()

    def end(self) -> None:
        """Finish the last line, so what comes next on the terminal (the stats on stderr) starts its own."""
        if not self.at_line_start:
            self._write("\n")
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
    import ninfer
    from ninfer.contract import (
        ChatInput,
        GenerationRequest,
        GenerationResult,
        OutputDelta,
        SamplingParams,
        TextInput,
    )
    from ninfer.contract.config import EngineConfig
    from ninfer.contract.events import merge_tool_call_fragments
    from ninfer.engine.engine import Engine
    from ninfer.engine.errors import EngineError, InvalidConstraint
    from ninfer.engine.memory_report import summary_text

    model = ninfer.resolve_model_path(args.model)
    chat = args.chat is not None or args.chat_file is not None
    if args.image or args.video:
        if args.vision == "off":
            raise ValueError("--image and --video need the vision feature, which --vision off turns off")
        if not chat:
            raise ValueError("--image and --video go into a chat message: use --chat or --chat-file")
    media = media_from_args(args)
    if chat:
        message = args.chat if args.chat is not None else read_text_file(args.chat_file, "--chat-file")
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": user_content(message, media)}]
        kwargs = {"enable_thinking": False} if args.no_think else {}
        request_input = ChatInput(messages=messages, template_kwargs=kwargs, media=media)
    else:
        if args.system or args.no_think:
            raise ValueError("--system and --no-think apply to --chat only (and --chat-file)")
        prompt = args.prompt if args.prompt is not None else read_text_file(args.prompt_file, "--prompt-file")
        request_input = TextInput(text=prompt)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    constraint = constraint_from_args(args)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                              **adjustments_from_args(args))
    config = EngineConfig(max_concurrency=1, device=args.device, max_model_len=args.max_model_len,
                          chat_template=_template_arg(args.chat_template), prefill_chunk=args.prefill_chunk,
                          verify=not args.no_verify, special_tokens_in_content=args.special_tokens_in_content,
                          features=with_vision(speculative_features(args), args))
    try:
        with Engine(model, config=with_memory_options(with_context_cache(config, args), args)) as engine:
            if engine.memory is not None:
                print(summary_text(engine.memory), file=sys.stderr, flush=True)
            check_max_tokens(args.max_tokens, engine.max_model_len)
            handle = engine.submit(GenerationRequest(input=request_input, sampling=sampling, constraint=constraint))
            result = _stream(handle, sys.stdout, GenerationResult, OutputDelta, merge_tool_call_fragments,
                             labels=chat)
            # The engine ran this one request: its speculative counters are the request's.
            return 1 if result is None else _report(result, engine.metrics().speculative)
    except InvalidConstraint as exc:  # bad input, as a constraint option the contract refuses
        print(f"ninfer generate: {constraint_option(args)}: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"ninfer generate: {exc}", file=sys.stderr)
        return 1


def check_max_tokens(max_tokens: int, max_model_len: int) -> None:
    """The server's rule (400 there): at least one context position must hold the prompt."""
    if max_tokens > max_model_len - 1:
        raise ValueError(f"--max-tokens {max_tokens} exceeds the context: at most {max_model_len - 1} tokens can "
                         f"be generated (context limit {max_model_len}; --max-model-len sets it)")


def _stream(handle, out: TextIO, result_type, delta_type, merge, *, labels: bool):
    """Print the handle's output as it comes; returns the final result (None if the stream ended without one)."""
    printer = _Printer(out, labels=labels)
    fragments = []
    try:
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
                return event
    finally:
        printer.end()  # also when interrupted: a message on stderr starts its own line
    return None


def _report(result, speculative=None) -> int:
    """The stats line on stderr: finish, tokens, speed and, when drafts were verified (``speculative``, the
    engine's ``SpeculativeStats``), the mean acceptance length and the draft acceptance rate."""
    if result.error is not None:
        print(f"ninfer generate: {result.error}", file=sys.stderr)
        return 1
    t = result.timings
    n = result.usage.completion_tokens
    parts = [f"finish: {result.finish_reason.value}", f"{result.usage.prompt_tokens} prompt + {n} generated tokens"]
    if result.usage.cached_tokens > 0:
        parts.append(f"{result.usage.cached_tokens} prompt tokens from the context cache")
    if t.time_to_first_token_s is not None:
        parts.append(f"TTFT {t.time_to_first_token_s * 1000:.1f} ms")
        decode_s = t.end_to_end_s - t.time_to_first_token_s
        if n > 1 and decode_s > 0:
            parts.append(f"{(n - 1) / decode_s:.1f} tokens/s")
    if t.end_to_end_s > 0:
        parts.append(f"{n / t.end_to_end_s:.1f} tokens/s end to end")
    if speculative is not None and speculative.drafts:
        parts.append(f"mean acceptance length {speculative.mean_acceptance_length:.2f}")
        parts.append(f"draft acceptance rate {speculative.acceptance_rate:.1%}")
    print(" | ".join(parts), file=sys.stderr)
    return 0
