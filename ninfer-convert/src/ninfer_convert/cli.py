"""``ninfer convert``: Hugging Face checkpoint directory to a .ninfer v3 artifact."""

from __future__ import annotations

import argparse
import sys


def add_convert_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("convert", help="convert a Hugging Face checkpoint directory into a .ninfer file")
    p.add_argument("src", help="checkpoint directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("out", help="output .ninfer path")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    print("ninfer convert: the v3 artifact writer is not implemented yet; nothing was written", file=sys.stderr)
    return 2
