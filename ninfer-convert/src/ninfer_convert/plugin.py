"""ninfer-convert plugin: the ``convert``, ``pull`` and ``list`` subcommands, and models named by Hugging Face id
(kept free of heavy imports)."""

import argparse

from ninfer import hookimpl, looks_like_model_id


@hookimpl
def ninfer_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from ninfer_convert.cli import add_convert_command
    from ninfer_convert.hub_cli import add_hub_commands

    add_convert_command(subparsers)
    add_hub_commands(subparsers)


@hookimpl
def ninfer_resolve_model(name: str) -> str | None:
    """A Hugging Face id: fetched (or found in the Hugging Face cache) and converted once into the ninfer cache."""
    if not looks_like_model_id(name):
        return None
    from ninfer_convert.hub_cache import resolve

    return resolve(name).path
