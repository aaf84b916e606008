"""Logical context storage shared by native Programs: sequence ledgers, KV block tables, ResumeStates."""

from ninfer.models.common.context.errors import ProgramError
from ninfer.models.common.context.kv_tables import SequencePages
from ninfer.models.common.context.resume import PausedStates, ReplayResume, SnapshotResume
from ninfer.models.common.context.sequence import RowSampling, SequenceRecord, draw_seed
from ninfer.models.common.context.sequence_table import SequenceTable

__all__ = ["PausedStates", "ProgramError", "ReplayResume", "RowSampling", "SequencePages", "SequenceRecord",
           "SequenceTable", "SnapshotResume", "draw_seed"]
