"""``ninfer score [MODEL] TEXT | [MODEL] --file PATH``: per-token logprobs, total NLL and perplexity.

TEXT is always the text itself (``-`` reads stdin); a file is read only through ``--file``. Without a
model (or with ``default``) the embedded model scores.

The model is started for the CausalScoring purpose only: one temporary State slot and Main KV,
no generation scheduler, no CUDA graphs. Imports stay lazy so ``ninfer --help`` does not load torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ninfer import fast_paths
from ninfer.cli.model_args import add_dtype_argument, add_model_argument
from ninfer.cli.text_files import read_text_file
from ninfer.engine.scoring import DEFAULT_WINDOW


def add_score_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("score", help="per-token logprobs, total NLL and perplexity of a text",
                              usage="ninfer score [-h] [options] [MODEL] (TEXT | --file PATH)",
                              description="Score a text with a model: each token's log-probability given the "
                                          "tokens before it (within a sliding window), the total negative "
                                          "log-likelihood in nats, and the perplexity. With one positional "
                                          "argument and no --file, that argument is the text and the embedded "
                                          "model scores it.")
    add_model_argument(p, metavar="MODEL")
    p.add_argument("text", nargs="?", metavar="TEXT", help="the text to score, taken literally (- reads stdin)")
    p.add_argument("--file", metavar="PATH", help="score the contents of this UTF-8 text file (- for stdin)")
    p.add_argument("--window", type=int, default=None,
                   help=f"tokens of context per window (default: min({DEFAULT_WINDOW}, the model's max length))")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window // 2)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    add_dtype_argument(p)
    p.add_argument("--tokens", action="store_true", help="also print every scored token with its logprob")
    p.add_argument("--json", action="store_true", help="machine-readable output (includes per-token logprobs)")
    p.add_argument("--no-verify", action="store_true", help="load without checking the artifact's checksums")
    p.set_defaults(func=cmd_score)


def _model_and_text(args: argparse.Namespace) -> tuple[str | None, str]:
    """Split the positionals: ``[MODEL] TEXT``, or ``[MODEL]`` with ``--file``."""
    if args.file is not None:
        if args.text is not None:
            raise ValueError(f"give the text or --file, not both (extra argument {args.text!r})")
        return args.model, read_text_file(args.file, "--file")
    if args.model is None:
        raise ValueError("no text to score: give TEXT (- reads stdin) or --file PATH")
    model, text = (args.model, args.text) if args.text is not None else (None, args.model)
    return model, sys.stdin.read() if text == "-" else text


def cmd_score(args: argparse.Namespace) -> int:
    try:
        model, text = _model_and_text(args)
        if not text:
            raise ValueError("the text to score is empty")
        import ninfer

        return _score(args, ninfer.resolve_model_path(model), text)
    except BrokenPipeError:
        raise  # the reader of stdout left: ninfer.cli.main ends quietly
    except (OSError, ValueError, TypeError, LookupError, RuntimeError) as exc:
        print(f"ninfer score: {exc}", file=sys.stderr)
        return 2


def _score(args: argparse.Namespace, model: str, text: str) -> int:
    from ninfer.contract.config import StartupOptions
    from ninfer.contract.prompt import TextInput
    from ninfer.engine.engine import default_device
    from ninfer.engine.scoring import CausalScoreCore
    from ninfer.engine.startup import build_instance

    device = args.device or default_device()
    fast_paths.log_unavailable(device)
    options = StartupOptions(device=device, max_concurrency=1, dtype=args.dtype, cuda_graphs=False)
    # the artifact stays referenced while scoring: loaded weights may borrow its mapping
    instance, name, artifact = build_instance(model, options, host=args.host, verify=not args.no_verify)
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
        for tok, lp in zip(ids[1:], result.logprobs, strict=True):
            print(f"{tok:>8}  {lp:>10.4f}  {instance.frontend.token_text(tok)!r}")
    print(f"model       {name}")
    print(f"tokens      {len(ids)} ({result.num_scored} scored in {result.windows} window(s) of {core.window}, "
          f"stride {core.stride})")
    print(f"total NLL   {result.total_nll:.4f} nats")
    print(f"mean NLL    {result.mean_nll:.4f} nats/token")
    print(f"perplexity  {result.perplexity:.4f}")
    print(f"time        {seconds:.2f} s on {device} ({len(ids) / max(seconds, 1e-9):.0f} tokens/s)")
    return 0
