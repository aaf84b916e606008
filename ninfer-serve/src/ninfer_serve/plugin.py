"""ninfer-serve plugin: contributes the ``serve`` subcommand (kept free of heavy imports)."""

import argparse

from ninfer import hookimpl


@hookimpl
def ninfer_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from ninfer_serve.cli import add_serve_command

    add_serve_command(subparsers)
