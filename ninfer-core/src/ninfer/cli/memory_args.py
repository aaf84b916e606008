"""The memory flags of ``plan``, ``generate``, ``chat`` and ``serve``: ``--vram-budget``, ``--placement`` and
``--expert-cache``, one definition for all."""

from __future__ import annotations

import argparse
from typing import TypeVar

import attrs

from ninfer.cli.number_args import whole_number
from ninfer.contract.config import EngineConfig, StartupOptions
from ninfer.engine.memory_report import MIB

_Options = TypeVar("_Options", EngineConfig, StartupOptions)


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vram-budget", type=whole_number(1, unit=" of MiB"), metavar="MIB",
                        help="device MiB the engine may use in all: weights, StateImages, KV, workspace, CUDA "
                             "graphs (default: the device's memory; NINFER_VRAM_BUDGET_MIB also sets it; free "
                             "memory is the other bound)")
    parser.add_argument("--placement", metavar="NAME",
                        help="weight placement to use, e.g. host-experts (a MoE model's routed experts in host "
                             "memory; default: the first placement that fits the budget)")
    parser.add_argument("--expert-cache", type=whole_number(0, unit=" of MiB"), metavar="MIB",
                        help="device MiB for the cache of host-resident MoE experts (default: sized from the "
                             "budget; 0: none)")


def with_memory_options(config: _Options, args: argparse.Namespace) -> _Options:
    """``config`` (an EngineConfig or StartupOptions) with what ``add_memory_arguments``' flags ask for."""
    return attrs.evolve(config, device_budget_bytes=None if args.vram_budget is None else args.vram_budget * MIB,
                        placement=args.placement,
                        expert_cache_bytes=None if args.expert_cache is None else args.expert_cache * MIB)
