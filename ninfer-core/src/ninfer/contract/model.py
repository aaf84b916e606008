"""Behavioural contracts an architecture plugin implements natively.

Startup builds a ModelInstance (Model, Parameters, Frontend, Program) from an artifact and typed
``StartupOptions`` (features, device, budgets, model knobs). The Program owns every mutable physical
resource (StateImage slots, KV pages, host copies, workspaces, CUDA graphs) and is called only from
the engine worker. The Frontend owns tokenizer, template and one OutputSession per request.
Every attribute and method the engine uses is declared here; the engine never probes for others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, runtime_checkable

import attrs

from ninfer.contract.batch import LaunchedUnit, PendingBatch, RowDecision
from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer.contract.constraint import Constraint, TokenMasks
from ninfer.contract.events import FinishReason, OutputDelta
from ninfer.contract.memory import MemorySummary, ModelProfile, ProgramCapacity, WeightPlacement
from ninfer.contract.prompt import ChatInput, PreparedPrompt, TextInput
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, ResumeState, StateImageLayout

if TYPE_CHECKING:
    import threading

    import torch

    from ninfer.artifact import Artifact
    from ninfer.contract.context import TurnBoundary

__all__ = ["Frontend", "ModelInstance", "OutputSession", "PauseMode", "PipelinedDecode", "Preview", "Program",
           "ResourceUsage", "SnapshotCost", "Startup", "StartupFeatures", "StartupOptions"]

PauseMode = Literal["snapshot", "replay"]


@attrs.frozen(kw_only=True)
class ResourceUsage:
    """What a Program's stores hold right now (the only physical ledger)."""

    state_slots_total: int
    state_slots_used: int
    kv_pages_total: int
    kv_pages_used: int
    host_bytes_used: int = 0
    reserved_pages: int = 0
    host_bytes_total: int = 0  # the host budget for paused Snapshots (0: every pause is a Replay)
    # The context cache's share (``ContextStore``): checkpoints, their device slots, the KV pages only they
    # hold (counted in kv_pages_used too; reclaimable on demand), their host replicas' bytes, reader leases.
    checkpoints: int = 0
    checkpoint_slots_used: int = 0
    cache_pages: int = 0
    cache_host_bytes: int = 0
    leases: int = 0

    @property
    def idle(self) -> bool:
        """No sequence and no paused request holds anything: every page in use belongs to the context cache."""
        return self.state_slots_used == 0 and self.kv_pages_used == self.cache_pages and self.host_bytes_used == 0 \
            and self.reserved_pages == 0 and self.leases == 0

    @property
    def all_free(self) -> bool:
        """Nothing held at all, the context cache included."""
        return self.idle and self.kv_pages_used == 0 and self.checkpoints == 0 and self.checkpoint_slots_used == 0 \
            and self.cache_host_bytes == 0


@attrs.frozen(kw_only=True)
class SnapshotCost:
    """What one Snapshot holds on the host, and the Replay work it saves (the engine weighs revocations by it)."""

    host_bytes: int        # host memory the Snapshot holds (StateImage + KV pages of its frontier)
    replay_positions: int  # positions a Replay resume would re-run instead (the frontier at pause)


@runtime_checkable
class Program(Protocol):
    """Physical resources, state and execution for one resident model (engine worker only)."""

    state_layout: StateImageLayout
    kv_pools: tuple[KVPoolSpec, ...]
    max_concurrency: int  # sequences it can hold at once (the engine runs at most this many residents)
    max_model_len: int    # the longest history (prompt + generated) one sequence can reach
    # Positions one decode unit writes per row (1; 2k with k speculative drafts: verify k + 1, chained drafts
    # k - 1): the engine reserves that many (fewer at max_model_len) and chains no decode step when above 1.
    decode_span: int
    graph_error: str | None  # why decode runs without CUDA graphs (capture failed), None when they run or are off

    def backing_bytes(self) -> int:
        """Bytes of its explicit device backing: StateImages, KV pages, checkpoint slots, verify records (not the
        weights, workspaces or CUDA graphs)."""

    def release_graphs(self) -> None:
        """Destroy its CUDA graphs (graph calibration measures what they held); later units run eagerly."""

    def open_sequence(self, prompt: PreparedPrompt, sampling: SamplingParams) -> int:
        """Bind a StateImage slot for a new sequence; returns its sequence id."""

    def reserve_units(self, sequence_id: int, tokens: int) -> bool:
        """Atomically reserve what the next unit of ``tokens`` input positions needs; False if it does not fit."""
    # Engine usage: a reservation covers positions frontier..frontier+tokens, so asking again for the
    # same or fewer tokens before the unit runs is a no-op that returns True.

    def input_remaining(self, sequence_id: int) -> int:
        """Input positions (prompt, or accepted history under Replay) still to run before decode; 0 = decode-ready."""

    def prefill(self, sequence_id: int, max_tokens: int, *, masks: TokenMasks | None = None) -> PendingBatch | None:
        """Run one prefill chunk; returns the first sampled token when the prompt is complete.
        ``masks``: the engine's token masks, applied before sampling to the rows they constrain."""

    def decode(self, sequence_ids: Sequence[int], *, masks: TokenMasks | None = None) -> PendingBatch:
        """One compact decode step over exactly these sequences (B = len(sequence_ids))."""

    def commit(self, batch: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        """Commit accepted tokens' state (KV, recurrent state, RNG); roll back the rest."""

    def abort_pending(self, batch: PendingBatch) -> None:
        """Drop a whole PendingBatch; every row returns to its pre-batch frontier."""

    def pause(self, sequence_id: int, mode: PauseMode) -> ResumeState:
        """Release device resources at a committed boundary; returns an owning ResumeState."""

    def resume(self, resume_state: ResumeState) -> int | None:
        """Re-bind a paused sequence (Snapshot restore, or Replay of its accepted history).

        Reserves the rebuild up to the old frontier plus the first new unit, held across chunks;
        returns None (and keeps ``resume_state`` valid) when that does not fit now.
        """

    def can_snapshot(self, sequence_id: int) -> bool:
        """Whether host room allows pausing this sequence by Snapshot now (else the engine uses Replay)."""

    def discard(self, resume_state: ResumeState) -> None:
        """Free what a paused request's ResumeState holds (host bytes) without resuming it."""

    def snapshot_cost(self, sequence_id: int) -> SnapshotCost:
        """What pausing this resident sequence by Snapshot would hold on the host now, and the Replay it saves."""

    def demote(self, resume_state: ResumeState) -> ResumeState:
        """Revoke a Snapshot ResumeState: free its host copy and return a Replay ResumeState of the same
        accepted ledger, so the request still resumes exactly. ``resume_state`` is invalid afterwards."""

    def release(self, sequence_id: int) -> None:
        """Free everything the sequence holds."""

    def usage(self) -> ResourceUsage: ...


@runtime_checkable
class PipelinedDecode(Protocol):
    """Optional Program capability: decode steps queued ahead of the host reading their tokens.

    With it the engine keeps the device busy while it settles the previous step (preview, commit,
    publish): in a steady decode phase step n+1 is launched on step n's device-resident tokens before
    step n is collected. A row whose step-n token turns out terminal (or is rolled back) makes its
    step-n+1 row void; ``collect`` leaves void rows and rows of released sequences out of the batch.
    """

    def launch_decode(self, sequence_ids: Sequence[int], *, after: LaunchedUnit | None = None,
                      masks: TokenMasks | None = None) -> LaunchedUnit:
        """Queue one decode step over exactly these sequences. Without ``after`` every sequence must be
        decode-ready and idle; with it, ``sequence_ids`` equal ``after.sequence_ids`` and each row's input is
        ``after``'s (uncollected) provisional token. Positions must be reserved (``reserve_units``) first.

        With ``masks`` constraining a row, the step's sampling waits for its mask: the forward is queued now,
        the mask is filled and the sampling queued when the unit's tokens are first needed (``collect``, or a
        launch ``after`` it), by which time the engine has committed the previous step's tokens."""

    def collect(self, unit: LaunchedUnit) -> PendingBatch:
        """Wait for a launched unit's tokens; its rows for sequences still live and not voided."""


@attrs.frozen(kw_only=True)
class Preview:
    """The semantic effect of one row's provisional tokens, computed without changing the session.

    ``accepted``: how many of the row's tokens the output keeps (fewer when a stop ends it inside them; 0 only
    with a ``finish_reason``, when the request's constraint refuses the first of them);
    ``finish_reason``: set when these tokens end the output (then ``delta`` already holds the released
    held-back text); ``delta``: exactly what ``commit`` publishes. ``boundary``: Frontend metadata relative to
    the accepted span (the Qwen frontend gives a ``TurnBoundary`` when the tokens close the assistant turn);
    ``native``: the session's private next state. A preview is valid only for the state it was made from.
    """

    accepted: int
    finish_reason: FinishReason | None
    delta: OutputDelta
    boundary: TurnBoundary | None = None
    native: object = None  # the session's own, opaque to the engine


@runtime_checkable
class OutputSession(Protocol):
    """Per-request output interpretation: stop handling, channels, detokenization, tool calls, and the
    constraint's matcher (``constrained``), which previews and commits with the output."""

    constrained: bool  # the request carries a constraint: the engine lends its masks to the Program

    def fill_token_mask(self, out: torch.Tensor, drafts: Sequence[int] = ()) -> None:
        """``TokenMasks.fill`` for this session's committed state (only called when ``constrained``)."""

    def preview(self, tokens: Sequence[int], *, at_length_limit: bool = False) -> Preview: ...

    def commit(self, preview: Preview) -> OutputDelta: ...

    def finish(self, reason: FinishReason) -> OutputDelta:
        """Flush held-back text at a terminal state and return the last delta."""


@runtime_checkable
class Frontend(Protocol):
    """Tokenizer, chat template and PreparedPrompt construction for one model."""

    def prepare(self, input: TextInput | ChatInput | PreparedPrompt, *, max_tokens: int | None = None
                ) -> PreparedPrompt:
        """Tokenize (and render) ``input``. A prompt of more than ``max_tokens`` tokens raises
        ``ninfer.contract.errors.PromptTooLong``, preferably before tokenizing all of it."""

    def sampling_defaults(self) -> SamplingParams:
        """The model's generation defaults (from the artifact, never from the architecture name)."""

    def end_token_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        """The token ids that end an output under ``sampling``: its ``stop_token_ids``, and the model's EOS unless
        ``ignore_eos`` (what ``min_tokens`` refuses)."""

    def open_session(self, prompt: PreparedPrompt, sampling: SamplingParams, constraint: Constraint | None = None,
                     *, cancel: threading.Event | None = None) -> OutputSession:
        """The request's OutputSession; compiles ``constraint`` (``ConstraintError`` when it cannot, or when it is
        past the Frontend's ``ConstraintLimits``; ``ConstraintBusy`` when its compilers are full). ``cancel``: the
        engine passes its caller's event when there is one; once it is set, a compile in progress is abandoned
        and ``ConstraintCancelled`` raised. A Frontend that closes meanwhile raises ``ConstraintClosed``."""

    eos_token_ids: tuple[int, ...]  # the tokens that end generation (unless ignore_eos)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (logprob reports name each token by it)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a token sequence decoded together (special tokens included), as a detokenizer gives it."""

    def close(self) -> None:
        """Stop any threads of its own (media preparation) once accepted work is done, and end compiles in
        progress (their ``open_session`` raises ``ConstraintClosed``); text still prepares. The Engine calls it
        when it closes, before it waits for its worker."""


@attrs.frozen(kw_only=True, eq=False)
class ModelInstance:
    """Holds Model (config, bindings, read-only resources), Parameters, Frontend and Program. ``config``, ``model``
    and ``parameters`` are the plugin's own (its tests and tools read them); the runtime reads only the Frontend,
    the Program, ``memory`` and ``features``."""

    architecture: str
    config: object
    model: object
    parameters: object
    frontend: Frontend
    program: Program | None
    memory: MemorySummary | None = None  # what the start took (set by the runtime's startup)
    features: tuple[str, ...] = attrs.field(default=("text",), converter=tuple)  # bound: "text", "vision", "mtp"


Loaded = TypeVar("Loaded")  # a Startup's loaded model: what its ``load`` returns and its ``instance`` takes


@runtime_checkable
class Startup(Protocol[Loaded]):
    """Native startup, in the three steps the runtime's planner drives (docs/memory.md): ``profile`` (what the
    model needs, from the artifact's header alone: no weight byte is read), ``load`` (weights for one placement
    candidate, Parameters and the Frontend) and ``instance`` (a Program of exactly the granted capacity; called
    once for graph calibration with a few KV pages, then for the formal Program, and once more at most when a
    capacity correction rebuild shrinks the automatic KV pool).

    An architecture's ``startup`` slot names a class of this shape, made with no arguments (Qwen3.5:
    ``ninfer_qwen35.startup.Qwen35Startup``). Every method receives every option, always.
    """

    def profile(self, artifact: Artifact, options: StartupOptions) -> ModelProfile:
        """The model's needs under ``options`` (features, dtype, concurrency, page size). Refuses (``ValueError``
        naming the problem) what it cannot run: unknown features, a missing head, a bad dtype."""

    def load(self, artifact: Artifact, options: StartupOptions, placement: WeightPlacement) -> Loaded:
        """Read the selected features' weights as ``placement`` says and prepare Parameters and the Frontend;
        returns the loaded model that ``instance`` takes (opaque to the runtime)."""

    def instance(self, loaded: Loaded, options: StartupOptions, capacity: ProgramCapacity) -> ModelInstance:
        """A ModelInstance whose Program holds exactly ``capacity`` (CUDA graphs captured when
        ``options.cuda_graphs`` asks and the device is CUDA)."""
