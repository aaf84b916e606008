"""Byte units and the one way sizes read in messages, startup blocks and ``ninfer plan`` (no torch import)."""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


def format_bytes(n: int | float) -> str:
    """``16.70 GiB``, ``512.0 MiB``, ``12.0 KiB``, ``100 B``; signed figures (growth) keep their sign."""
    size = abs(n)
    if size >= GIB:
        return f"{n / GIB:.2f} GiB"
    if size >= MIB:
        return f"{n / MIB:.1f} MiB"
    if size >= KIB:
        return f"{n / KIB:.1f} KiB"
    return f"{int(n)} B"
