"""The engine flags of ``ninfer generate`` and ``ninfer chat`` (one request at a time): device, dtype, chat
template, context, memory, prefill chunk, vision, context cache and speculative decoding."""

from __future__ import annotations

import argparse
import os

from ninfer.cli.cache_args import add_context_cache_arguments, with_context_cache
from ninfer.cli.memory_args import add_memory_arguments, with_memory_options
from ninfer.cli.model_args import add_dtype_argument
from ninfer.cli.speculative_args import add_speculative_arguments, speculative_features
from ninfer.cli.vision_args import add_vision_argument, with_vision
from ninfer.contract.config import EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags ``engine_config_from_args`` reads, the context cache, speculative and vision ones
    included (``generate``, ``chat``)."""
    p.add_argument("--chat-template", help="chat template file (or builtin:qwen3_5) replacing the artifact's")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="read special-token strings in --chat/--system text (e.g. <|im_end|>) as control tokens "
                        "(default: plain text)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    add_dtype_argument(p)
    p.add_argument("--no-verify", action="store_true", help="load without checking the artifact's checksums")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    add_memory_arguments(p)
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                   help="prompt tokens per prefill unit (default: 2048 on a GPU, 512 on the CPU)")
    add_vision_argument(p)
    add_context_cache_arguments(p)
    add_speculative_arguments(p)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig (one request at a time) of ``add_engine_arguments``' flags."""
    config = EngineConfig(max_concurrency=1, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                          chat_template=_template_arg(args.chat_template), prefill_chunk=args.prefill_chunk,
                          verify=not args.no_verify, special_tokens_in_content=args.special_tokens_in_content,
                          features=with_vision(speculative_features(args), args))
    return with_memory_options(with_context_cache(config, args), args)


def _template_arg(arg: str | None) -> str | None:
    if arg is None or arg.startswith("builtin:"):
        return arg
    if not os.path.isfile(arg):
        raise ValueError(f"chat template file not found: {arg}")
    with open(arg, encoding="utf-8") as f:
        return f.read()
