"""The Qwen3.5 Program: its state layout, pool and forward wiring over the shared parts (``PagedProgram``)."""

from ninfer.models.common.context import ProgramError, ReplayResume, SnapshotResume
from ninfer_qwen35.program.program import Qwen35Program

__all__ = ["ProgramError", "Qwen35Program", "ReplayResume", "SnapshotResume"]
