"""The model a command runs and its ``--dtype``, shared by the commands that start one (generate, chat, score,
plan, serve)."""

from __future__ import annotations

import argparse

from ninfer.contract.config import DTYPES


def add_model_argument(p: argparse.ArgumentParser, *, metavar: str | None = None) -> None:
    """The optional MODEL positional (``args.model``), read by ``ninfer.resolve_model_path``."""
    p.add_argument("model", nargs="?", metavar=metavar, help="a .ninfer artifact, a Hugging Face id "
                   "(org/name[@revision]), or 'default' (default: the embedded model)")


def add_dtype_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``args.dtype``: the compute dtype (None: the artifact's), for ``EngineConfig`` / ``StartupOptions.dtype``."""
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="compute dtype of the weights, KV and state (default: the artifact's stored dtype, "
                             "bfloat16 for converted Hugging Face checkpoints)")
