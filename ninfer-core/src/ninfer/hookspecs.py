"""Hook specifications: what a plugin may contribute to ninfer.

Architecture plugins describe their native implementations with an
:class:`~ninfer.plugins.ArchitectureSpec` (lazy ``"module:attr"`` targets, so that
plugin modules never import torch at import time). Ownership of an architecture is
decided by the core registry, never by hook call order.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from ninfer._markers import hookspec

if TYPE_CHECKING:
    from ninfer.plugins import ArchitectureSpec


@hookspec
def ninfer_register_architectures(register: Callable[[ArchitectureSpec], None]) -> None:
    """Call ``register(ArchitectureSpec(...))`` once for each architecture this plugin implements.

    The spec names the Hugging Face architecture strings it handles and where its
    config parser, Startup, Program, Frontend, StateImage layout and converter
    source mapping live. A plugin whose architecture is not implemented registers nothing.
    """


@hookspec(firstresult=True)
def ninfer_resolve_model(name: str) -> str | None:
    """The path of a local .ninfer artifact for a model name that is not a file, such as a Hugging Face id
    (``org/name`` or ``org/name@revision``): fetch and convert it first if need be. Return None for a name this
    plugin does not serve; raise ValueError with a one-line message fit for the user when the name is one it
    serves but cannot provide (offline and not cached, no such model). The first answer wins.
    """


@hookspec(firstresult=True)
def ninfer_default_model() -> str | None:
    """The path of the small model this plugin ships as the installation's default (``ninfer generate`` with no
    model, ``ninfer.default_model_path()``), or None when it ships none. The first answer wins.
    """


@hookspec
def ninfer_add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``ninfer`` CLI subcommands: ``p = subparsers.add_parser(...); p.set_defaults(func=handler)``.

    Handlers receive the parsed ``argparse.Namespace`` and return an exit code; they
    import heavy modules inside the handler so ``ninfer --help`` stays fast.
    """
