"""Logical context storage shared by native Programs: sequence ledgers, KV block tables, ResumeStates."""

from ninfer.models.common.context.errors import ProgramError
from ninfer.models.common.context.kv_history import KVHistoryStore, KVPrefixRef
from ninfer.models.common.context.resume import PausedStates, ReplayResume, SnapshotResume
from ninfer.models.common.context.sequence import RowSampling, SequenceRecord, draw_seed
from ninfer.models.common.context.sequence_table import SequenceTable

__all__ = ["KVHistoryStore", "KVPrefixRef", "PausedStates", "ProgramError", "ReplayResume", "RowSampling", "SequenceRecord",
           "SequenceTable", "SnapshotResume", "draw_seed"]
