"""The request record: everything the engine worker knows about one request (worker-owned).

States follow the design document's lifecycle diagram. ``Materializing`` is folded into the
binding call (``open_sequence`` / ``resume`` complete synchronously); Capture and ControlReady
arrive with prefix reuse and forced control.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from ninfer.contract.events import FinishReason, ToolCall
from ninfer.contract.model import OutputSession, SnapshotCost
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.handle import ResponseChannel


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"            # resident, prompt input still to run
    REPLAY = "replay"              # resident, rebuilding accepted history after a Replay resume
    DECODE_READY = "decode_ready"  # resident, next unit is one decode step
    PAUSED = "paused"              # holds a ResumeState, no lane
    FINISHED = "finished"          # terminal: response published, resources settled


RESIDENT = (RequestState.PREFILL, RequestState.REPLAY, RequestState.DECODE_READY)


@attrs.define(eq=False, kw_only=True)
class RequestRecord:
    """Worker-owned state of one request; ``ticket`` is its submission order (lower = older)."""

    ticket: int
    request: GenerationRequest
    prompt: PreparedPrompt
    sampling: SamplingParams
    channel: ResponseChannel
    session: OutputSession | None = None
    state: RequestState = RequestState.WAITING
    sequence_id: int | None = None
    resume_state: Any = None
    snapshot: SnapshotCost | None = None  # while paused by Snapshot: the host bytes its ResumeState holds
    # Output accounting: what was committed and published (never re-counted after a resume).
    generated: int = 0
    token_ids: list[int] = attrs.field(factory=list)
    content: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    tool_calls: list[ToolCall] = attrs.field(factory=list)
    started: bool = False          # GenerationStart published
    preemptions: int = 0
    bypassed: int = 0              # fresh admissions that overtook this request while it waited to resume
    protected: bool = False        # the one protected recovery in progress
    # Timing (time.monotonic()).
    submitted_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    deadline_at: float | None = None
    queue_deadline_at: float | None = None
    cancel_reason: FinishReason | None = None
    frontend_error: BaseException | None = None  # the OutputSession failed on this request's output

    @property
    def request_id(self) -> str:
        return self.channel.request_id

    @property
    def resident(self) -> bool:
        return self.state in RESIDENT

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.max_tokens
