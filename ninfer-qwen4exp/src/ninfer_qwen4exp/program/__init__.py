"""The Qwen4Exp Program: its StateImage, its pool and forward wiring over the shared parts (``PagedProgram``)."""

from ninfer.models.common.context import ProgramError, ReplayResume, SnapshotResume
from ninfer_qwen4exp.program.program import Qwen4ExpProgram

__all__ = ["ProgramError", "Qwen4ExpProgram", "ReplayResume", "SnapshotResume"]
