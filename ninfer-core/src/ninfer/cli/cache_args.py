"""The context cache's command-line options, one definition for ``ninfer generate`` and ``ninfer serve``.

Light at import (argparse and the config contract only), so ``ninfer --help`` loads no torch.
"""

from __future__ import annotations

import argparse

import attrs

from ninfer.cli.number_args import whole_number
from ninfer.contract.config import EngineConfig

MIB = 1 << 20


def add_context_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("context cache (prefix reuse and session continuations)")
    group.add_argument("--no-context-cache", action="store_true",
                       help="turn the context cache off: every request computes its whole prompt (outputs are "
                            "the same either way)")
    group.add_argument("--checkpoint-grid", type=whole_number(1), metavar="N",
                       help="prompt positions between checkpoints inside a long prompt (default: the prefill "
                            "chunk)")
    group.add_argument("--checkpoint-slots", type=whole_number(0), metavar="N",
                       help="device slots for checkpoints (default: sized from the memory budget; 0 keeps "
                            "checkpoints on the host only)")
    group.add_argument("--cache-host-budget-mib", type=whole_number(0), metavar="N",
                       help="pinned host MiB for checkpoint replicas (default: the model's; "
                            "NINFER_CACHE_HOST_BUDGET_MIB also sets it; 0: no host replicas)")


def with_context_cache(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """``config`` with the context-cache options ``add_context_cache_arguments`` parsed into ``args``."""
    budget = args.cache_host_budget_mib
    return attrs.evolve(config, context_cache=not args.no_context_cache, checkpoint_grid=args.checkpoint_grid,
                        checkpoint_slots=args.checkpoint_slots,
                        cache_host_budget_bytes=None if budget is None else budget * MIB)
