"""``ninfer serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a .ninfer model over an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", help="path to a .ninfer artifact (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-id", help="public model name (default: the artifact's metadata.name)")
    p.add_argument("--max-concurrency", type=int, default=4, choices=range(1, 9), metavar="1..8")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    print("ninfer serve: the generation engine (ninfer.Engine) is not implemented yet; nothing is served",
          file=sys.stderr)
    return 2
