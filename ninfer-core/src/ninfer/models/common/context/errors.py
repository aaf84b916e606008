"""The error a Program's shared parts raise when a caller breaks the Program contract."""

from __future__ import annotations


class ProgramError(RuntimeError):
    """The Program was called in a way that breaks its contract (unknown sequence, unit while pending, ...)."""
