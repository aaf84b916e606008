"""Numeric command-line values (argparse ``type=``), one parser per kind for every ``ninfer`` subcommand: the
error names what was expected and the bound it broke."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def whole_number(lo: int, hi: int | None = None, unit: str = "") -> Callable[[str], int]:
    """An argparse type: an int in ``lo..hi`` (``hi`` None: no upper bound); ``unit`` names what it counts in the
    error (e.g. " of MiB")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number{unit}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, frames per second)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text}")
    return value
