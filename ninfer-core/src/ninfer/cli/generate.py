"""``ninfer generate [MODEL] --prompt TEXT | --prompt-file PATH | --chat TEXT | --chat-file PATH``.

Streams one generation (``stream_printer``). A raw prompt's continuation is printed as is; on a terminal, chat
output is printed in sections: reasoning apart from the answer (dimmed, under its own header), tool calls as
name + JSON arguments. When stdout is not a terminal it gets the output alone (no label: it pipes into ``jq``)
and the reasoning goes to stderr. The start prints the memory it took (a short block on stderr,
``memory_report``); the end prints time to first token and tokens/s to stderr, on a line of its own. Text
arguments are always text: files (or stdin, ``-``) are read only through the ``-file`` options.
``--json-schema``, ``--grammar``, ``--regex`` and ``--choice`` constrain the output (``constraint_args``);
``--speculative mtp`` decodes with drafts (``speculative_args``), and the stats line then adds their acceptance.
``--image`` and ``--video`` put media into the chat message; ``--vision`` selects the encoder (``vision_args``).
Bad options (a constraint that does not build, media for a text-only model) are reported before the weights
load. ``ninfer chat`` shares the sampling and engine flags (``sampling_args``, ``engine_args``) and the stats
line. Imports stay lazy so ``ninfer --help`` does not load torch.
"""

from __future__ import annotations

import argparse
import sys

from ninfer.cli.command_errors import run_reporting_errors
from ninfer.cli.constraint_args import (
    add_constraint_arguments,
    check_constraint_builds,
    constraint_from_args,
    constraint_option,
)
from ninfer.cli.engine_args import add_engine_arguments, engine_config_from_args
from ninfer.cli.model_args import add_model_argument
from ninfer.cli.sampling_args import add_sampling_arguments, sampling_from_args
from ninfer.cli.stream_printer import StreamPrinter, follow
from ninfer.cli.text_files import read_text_file
from ninfer.cli.vision_args import add_media_arguments, check_model_sees, media_from_args, user_content


def add_generate_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt or a chat message, streamed",
                              description="Generate with a .ninfer model and stream the output to the terminal. "
                                          "--prompt sends raw text; --chat renders one user message (and "
                                          "--system) with the model's chat template.")
    add_model_argument(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="raw completion prompt, taken literally")
    source.add_argument("--prompt-file", metavar="PATH", help="raw completion prompt from a UTF-8 file (- for stdin)")
    source.add_argument("--chat", metavar="TEXT", help="a user message for the chat template, taken literally")
    source.add_argument("--chat-file", metavar="PATH", help="the user message from a UTF-8 file (- for stdin)")
    p.add_argument("--system", help="system message for --chat or --chat-file")
    p.add_argument("--no-think", action="store_true", help="chat with thinking disabled (enable_thinking=false)")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    add_constraint_arguments(p)
    add_media_arguments(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    return run_reporting_errors("generate", _generate, args)


def _generate(args: argparse.Namespace) -> int:
    import ninfer
    from ninfer.contract import ChatInput, GenerationRequest, TextInput
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
    check_model_sees(model, args)
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
    sampling = sampling_from_args(args)
    constraint = constraint_from_args(args)
    check_constraint_builds(constraint, args)  # what needs no vocabulary is judged before the weights load
    config = engine_config_from_args(args)
    try:
        with Engine(model, config=config) as engine:
            if engine.memory is not None:
                print(summary_text(engine.memory), file=sys.stderr, flush=True)
            check_max_tokens(args.max_tokens, engine.max_model_len)
            handle = engine.submit(GenerationRequest(input=request_input, sampling=sampling, constraint=constraint))
            result = follow(handle, StreamPrinter(sys.stdout, sys.stderr, labels=chat))
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


def _report(result, speculative=None) -> int:
    """The stats line on stderr (``stats_line``), or the error that ended the request."""
    if result.error is not None:
        print(f"ninfer generate: {result.error}", file=sys.stderr)
        return 1
    print(stats_line(result, speculative), file=sys.stderr)
    return 0


def stats_line(result, speculative=None) -> str:
    """Finish, tokens, speed and, when drafts were verified (``speculative``, the engine's
    ``SpeculativeStats``), the mean acceptance length and the draft acceptance rate."""
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
    return " | ".join(parts)
