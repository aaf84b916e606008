"""Speculative decoding's command-line options, one definition for ``ninfer generate`` and ``ninfer serve``:
``--speculative mtp`` and ``--num-draft-tokens K``, read into ``StartupFeatures``.

Light at import (argparse and the config contract only), so ``ninfer --help`` loads no torch.
"""

from __future__ import annotations

import argparse

import attrs

from ninfer.cli.number_args import whole_number
from ninfer.contract.config import MAX_DRAFT_TOKENS, StartupFeatures

# The speculative backends a command line can select (the others have no Startup yet).
CLI_METHODS = ("mtp",)
DEFAULT_DRAFT_TOKENS = attrs.fields(StartupFeatures).num_draft_tokens.default


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (lossless: greedy output is unchanged, sampled "
                                      "output keeps its distribution)")
    group.add_argument("--speculative", choices=CLI_METHODS,
                       help="draft tokens with the model's multi-token-prediction head (mtp) and verify them "
                            "in one step of the model (default: off)")
    group.add_argument("--num-draft-tokens", type=whole_number(1, MAX_DRAFT_TOKENS), metavar=f"1..{MAX_DRAFT_TOKENS}",
                       help=f"draft tokens per step with --speculative (default {DEFAULT_DRAFT_TOKENS})")


def speculative_features(args: argparse.Namespace) -> StartupFeatures:
    """The startup features the options ask for; ``--num-draft-tokens`` alone is a ValueError."""
    if args.speculative is None:
        if args.num_draft_tokens is not None:
            raise ValueError("--num-draft-tokens needs --speculative (e.g. --speculative mtp)")
        return StartupFeatures()
    count = DEFAULT_DRAFT_TOKENS if args.num_draft_tokens is None else args.num_draft_tokens
    return StartupFeatures(speculative=args.speculative, num_draft_tokens=count)
