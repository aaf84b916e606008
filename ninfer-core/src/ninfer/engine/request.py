"""The request record: everything the engine worker knows about one request (worker-owned).

States follow the design document's lifecycle diagram, less the states nothing needs yet.
``Materializing`` is folded into the binding call (``open_sequence`` / ``resume`` complete synchronously).
Capture needs no state: a prefill unit publishes its save points itself and the worker
adopts them after the unit (``reuse.py``), and a prompt that a resident's pending save would cover waits
in ``WAITING``. ControlReady does not exist: there is no forced control (tokens the Frontend supplies
instead of the sampler); every token is sampled, so a ``PendingBatch`` row's ``forced`` is never set.
"""

from __future__ import annotations

import enum

import attrs

from ninfer.contract.context import TurnBoundary
from ninfer.contract.events import FinishReason, OutputDelta, TokenLogprob, ToolCall
from ninfer.contract.model import OutputSession, SnapshotCost
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.contract.state import ResumeState
from ninfer.engine.errors import InvariantBroken
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
    resume_state: ResumeState | None = None
    snapshot: SnapshotCost | None = None  # while paused by Snapshot: the host bytes its ResumeState holds
    # Output accounting: what was committed and published (never re-counted after a resume).
    generated: int = 0
    token_ids: list[int] = attrs.field(factory=list)
    content: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    tool_calls: list[ToolCall] = attrs.field(factory=list)
    held_logprobs: dict[int, TokenLogprob] = attrs.field(factory=dict)  # by output index, until their text goes
    preemptions: int = 0
    bypassed: int = 0              # fresh admissions that overtook this request while it waited to resume
    # Timing (time.monotonic()).
    submitted_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    deadline_at: float | None = None
    queue_deadline_at: float | None = None
    frontend_error: BaseException | None = None  # the OutputSession failed on this request's output
    cached_tokens: int = 0  # prompt tokens restored from the context cache at admission
    boundary: TurnBoundary | None = None    # the Frontend's boundary of the last committed row (a TurnBoundary ends a turn)

    @property
    def request_id(self) -> str:
        return self.channel.request_id

    @property
    def resident(self) -> bool:
        return self.state in RESIDENT

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.max_tokens

    def generation_room(self, max_model_len: int) -> int:
        """Tokens this request may still generate: its budget and the context limit (never 0 when a unit runs)."""
        room = max_model_len - len(self.prompt) - self.generated
        if self.max_tokens is not None:
            room = min(room, self.max_tokens - self.generated)
        if room < 1:
            raise InvariantBroken(f"request {self.request_id} ran a unit with no generation room left")
        return room

    def interrupted(self, now: float) -> FinishReason | None:
        """CANCELLED once its consumer cancelled, DEADLINE once its deadline passed, else None."""
        if self.channel.cancel_requested:
            return FinishReason.CANCELLED
        if self.deadline_at is not None and now >= self.deadline_at:
            return FinishReason.DEADLINE
        return None

    def publish_output(self, delta: OutputDelta, *, final: bool = False) -> None:
        """Add committed output to what the final result reports, and publish it (nothing when it is empty).
        With ``token_spans``, the held logprobs of those tokens go with it, each with the text it added; a held
        token that added no visible text (a stop token, a think marker) goes in order with empty text and
        channel "none", so every generated token has an entry (legacy completions list each one: lm-eval reads
        the last entry as the generated token). ``final``: the output ended, every held entry goes."""
        held = self.held_logprobs
        if held and (delta.token_spans or final):
            by_index: dict[int, list] = {}
            for span in delta.token_spans or ():
                by_index.setdefault(span.index, []).append(span)
            last = max(held) if final else delta.token_spans[-1].index
            entries = []
            for index in sorted(i for i in held if i <= last):
                lp = held.pop(index)
                spans = by_index.get(index)
                if spans is None:
                    entries.append(attrs.evolve(lp, token="", channel="none", part=False))
                    continue
                entries.extend(attrs.evolve(lp, token=s.text, channel=s.channel, part=s.part) for s in spans)
            delta = attrs.evolve(delta, logprobs=delta.logprobs + tuple(entries))
        if not (delta.content or delta.reasoning or delta.token_ids or delta.tool_calls or delta.logprobs):
            return
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        self.tool_calls.extend(delta.tool_calls)
        self.channel.publish(delta)
