"""``ninfer generate``'s logit adjustment flags: min-p, penalties, logit bias, min tokens, stop token ids."""

from __future__ import annotations

import argparse
from typing import Any


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
