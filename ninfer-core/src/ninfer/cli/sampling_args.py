"""The sampling flags of ``ninfer generate`` and ``ninfer chat``: max tokens, temperature, top-p/k, seed, stop
strings, and the logit adjustments (min-p, penalties, logit bias, min tokens, stop token ids)."""

from __future__ import annotations

import argparse
from typing import Any

from ninfer.contract.request import SamplingParams


def _bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 151645=-100), got {text!r}") from None


def add_adjustment_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-p", type=float, help="drop tokens below this fraction of the top token's probability")
    p.add_argument("--presence-penalty", type=float,
                   help="subtract from the logit of every token already generated, once (-2..2)")
    p.add_argument("--frequency-penalty", type=float,
                   help="subtract from the logit of every token already generated, per occurrence (-2..2)")
    p.add_argument("--repetition-penalty", type=float,
                   help="divide the positive logits (multiply the negative ones) of tokens in the prompt or output "
                        "(> 0; 1 = off)")
    p.add_argument("--logit-bias", type=_bias, action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (-100..100) to a token's logit (repeatable; -100 bans it)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="refuse the end tokens (EOS, --stop-token-id) until this many tokens are generated")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], metavar="ID",
                   help="stop at this token id (repeatable)")


def adjustments_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams fields of the flags above (their ranges are the contract's to check)."""
    return {"min_p": args.min_p, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "repetition_penalty": args.repetition_penalty,
            "logit_bias": dict(args.logit_bias), "min_tokens": args.min_tokens,
            "stop_token_ids": tuple(args.stop_token_id)}


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_tokens: int = 256) -> None:
    """The sampling flags ``sampling_from_args`` reads (``generate``, ``chat``)."""
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate at most (default {max_tokens})")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the model's generation config)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: the model's)")
    p.add_argument("--top-k", type=int, help="top-k sampling (default: the model's)")
    p.add_argument("--seed", type=int, help="sampling seed (reproducible output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence tokens")
    add_adjustment_arguments(p)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of ``add_sampling_arguments``' flags; a bad value is a ValueError naming it."""
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                          **adjustments_from_args(args))
