"""The Qwen3.5 Program: sequences, reservations, prefill chunks, exact-B decode, commit/rollback, pause/resume."""

from ninfer_qwen35.program.program import ProgramError, Qwen35Program
from ninfer_qwen35.program.resume import ReplayResume, SnapshotResume

__all__ = ["ProgramError", "Qwen35Program", "ReplayResume", "SnapshotResume"]
