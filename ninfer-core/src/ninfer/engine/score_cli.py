"""``ninfer score MODEL.ninfer TEXT_OR_FILE``: per-token logprobs, total NLL and perplexity (CausalScoring).

The model is started for the CausalScoring purpose only: one temporary State slot and Main KV,
no generation scheduler, no CUDA graphs. Imports stay lazy so ``ninfer --help`` does not load torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_WINDOW = 4096


def add_score_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("score", help="per-token logprobs, total NLL and perplexity of a text",
                              description="Score a text with a model: each token's log-probability given the "
                                          "tokens before it (within a sliding window), the total negative "
                                          "log-likelihood in nats, and the perplexity.")
    p.add_argument("model", help="a .ninfer artifact")
    p.add_argument("text", help="the text to score, a path to a UTF-8 text file, or - for stdin")
    p.add_argument("--window", type=int, default=None,
                   help=f"tokens of context per window (default: min({DEFAULT_WINDOW}, the model's max length))")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window // 2)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the artifact's)")
    p.add_argument("--tokens", action="store_true", help="also print every scored token with its logprob")
    p.add_argument("--json", action="store_true", help="machine-readable output (includes per-token logprobs)")
    p.set_defaults(func=cmd_score)


def _read_text(arg: str) -> str:
    if arg == "-":
        return sys.stdin.read()
    if os.path.isfile(arg):
        try:
            with open(arg, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{arg} is not UTF-8 text: {exc}") from None
    return arg


def cmd_score(args: argparse.Namespace) -> int:
    try:
        text = _read_text(args.text)
        if not text:
            raise ValueError("the text to score is empty")
        return _score(args, text)
    except BrokenPipeError:
        raise  # the reader of stdout left: ninfer.cli.main ends quietly
    except (OSError, ValueError, TypeError, LookupError, RuntimeError) as exc:
        print(f"ninfer score: {exc}", file=sys.stderr)
        return 2


def _score(args: argparse.Namespace, text: str) -> int:
    import torch

    from ninfer.contract.model import StartupFeatures
    from ninfer.contract.prompt import TextInput
    from ninfer.engine.scoring import CausalScoreCore
    from ninfer.engine.startup import build_instance

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = {"cuda_graphs": False}
    if args.dtype:
        options["dtype"] = args.dtype
    # the artifact stays referenced while scoring: loaded weights may borrow its mapping
    instance, name, artifact = build_instance(args.model, device=device, features=StartupFeatures(),
                                              max_concurrency=1, device_budget_bytes=None,
                                              program_options=options, host=args.host)
    program = instance.program
    ids = instance.frontend.prepare(TextInput(text=text)).token_ids
    window = args.window if args.window is not None else min(DEFAULT_WINDOW, program.max_model_len)
    core = CausalScoreCore(program, window=window, stride=args.stride)
    t0 = time.perf_counter()
    result = core.score(ids)
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "model": name, "tokens": len(ids), "scored": result.num_scored, "windows": result.windows,
            "window": core.window, "stride": core.stride, "total_nll": result.total_nll,
            "mean_nll": result.mean_nll, "perplexity": result.perplexity, "device": device, "seconds": seconds,
            "token_ids": list(ids),
            "token_logprobs": [None, *result.logprobs]}))
        return 0
    if args.tokens:
        decode = instance.frontend.tokenizer.decode if hasattr(instance.frontend, "tokenizer") else str
        for tok, lp in zip(ids[1:], result.logprobs, strict=True):
            print(f"{tok:>8}  {lp:>10.4f}  {decode([tok])!r}")
    print(f"model       {name}")
    print(f"tokens      {len(ids)} ({result.num_scored} scored in {result.windows} window(s) of {core.window}, "
          f"stride {core.stride})")
    print(f"total NLL   {result.total_nll:.4f} nats")
    print(f"mean NLL    {result.mean_nll:.4f} nats/token")
    print(f"perplexity  {result.perplexity:.4f}")
    print(f"time        {seconds:.2f} s on {device} ({len(ids) / max(seconds, 1e-9):.0f} tokens/s)")
    return 0
