"""``--dtype``, shared by the commands that start a model (generate, score, plan, serve)."""

from __future__ import annotations

import argparse

from ninfer.contract.config import DTYPES


def add_dtype_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``args.dtype``: the compute dtype (None: the artifact's), for ``EngineConfig`` / ``StartupOptions.dtype``."""
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="compute dtype of the weights, KV and state (default: the artifact's stored dtype, "
                             "bfloat16 for converted Hugging Face checkpoints)")
