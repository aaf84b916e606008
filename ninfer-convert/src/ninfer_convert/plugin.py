"""ninfer-convert plugin: contributes the ``convert`` subcommand (kept free of heavy imports)."""

import argparse

from ninfer import hookimpl


@hookimpl
def ninfer_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from ninfer_convert.cli import add_convert_command

    add_convert_command(subparsers)
