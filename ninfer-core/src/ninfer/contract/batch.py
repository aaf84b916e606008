"""PendingBatch: provisional model output that the engine must commit or abort as a whole.

Order (design document): Frontend preview -> Program.commit of accepted state ->
budget and scheduling accounting -> OutputSession commit -> publish.
For every non-cancelled row ``1 <= accepted <= produced``; a non-terminal row accepts
everything it produced; a cancelled row accepts zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from ninfer.contract.context import TurnBoundary


class PendingBatchError(RuntimeError):
    """A PendingBatch was consumed twice, partially, or with decisions that break its invariants."""


@attrs.frozen(kw_only=True, eq=False)
class PendingRow:
    """One sequence's provisional output: one or more tokens (several with speculative decoding)."""

    sequence_id: int
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # True when this row's tokens were forced (control), not sampled.
    forced: bool = False
    # Draft tokens this row verified (speculative decoding): the first ``produced - 1`` of them were accepted.
    drafted: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.tokens:
            raise PendingBatchError(f"row for sequence {self.sequence_id} produced no tokens")
        if self.drafted and len(self.tokens) > self.drafted + 1:
            raise PendingBatchError(f"row for sequence {self.sequence_id} produced {len(self.tokens)} tokens from "
                                    f"{self.drafted} drafts")

    @property
    def produced(self) -> int:
        return len(self.tokens)


@attrs.frozen(kw_only=True)
class RowDecision:
    """What the engine accepts of one row. ``boundary`` is Frontend metadata relative to the accepted span."""

    accepted: int
    terminal: bool = False
    cancelled: bool = False
    boundary: TurnBoundary | None = None


@attrs.define(eq=False)
class PendingBatch:
    """Frozen membership plus provisional tokens; move-only: consumed exactly once."""

    kind: str  # "prefill", "decode", "control" or "verify"
    rows: tuple[PendingRow, ...] = attrs.field(converter=tuple)
    native: object = attrs.field(default=None, repr=False)  # the Program's private execution metadata
    consumed: bool = attrs.field(default=False, init=False)

    def sequence_ids(self) -> tuple[int, ...]:
        return tuple(r.sequence_id for r in self.rows)

    def take(self, decisions: Sequence[RowDecision] | None) -> None:
        """Mark the batch consumed, validating decisions against the invariants; called by the Program."""
        if self.consumed:
            raise PendingBatchError("PendingBatch consumed twice")
        if decisions is not None:
            if len(decisions) != len(self.rows):
                raise PendingBatchError(f"{len(decisions)} decisions for {len(self.rows)} rows")
            for row, d in zip(self.rows, decisions, strict=True):
                check_decision(row, d)
        self.consumed = True


@attrs.define(eq=False)
class LaunchedUnit:
    """A decode unit queued on the device whose provisional tokens the host has not read yet.

    ``Program.collect`` turns it into a PendingBatch exactly once (waiting for the tokens). While it is
    outstanding the next step can already be queued behind it (``Program.launch_decode(after=...)``),
    its input being this unit's device-resident tokens: the host settles step n while step n+1 runs.
    """

    kind: str
    sequence_ids: tuple[int, ...] = attrs.field(converter=tuple)
    native: object = attrs.field(default=None, repr=False)  # the Program's own, opaque to the engine
    collected: bool = attrs.field(default=False, init=False)


def check_decision(row: PendingRow, d: RowDecision) -> None:
    if d.cancelled:
        if d.accepted != 0:
            raise PendingBatchError(f"cancelled row {row.sequence_id} must accept 0 tokens, got {d.accepted}")
        return
    if not 1 <= d.accepted <= row.produced:
        raise PendingBatchError(
            f"row {row.sequence_id}: accepted {d.accepted} outside 1..{row.produced}")
    if not d.terminal and d.accepted != row.produced:
        raise PendingBatchError(
            f"non-terminal row {row.sequence_id} must accept all {row.produced} tokens, got {d.accepted}")
