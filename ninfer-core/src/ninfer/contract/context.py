"""Context cache contract: the recovery points a Program publishes, and what the engine asks of them.

A checkpoint is an immutable recovery point after ``tokens`` (positions ``[0, len(tokens))``): the whole
recurrent StateImage (GDN state and conv window) and an exact read-only prefix of the KV history, with
a device copy, a host replica in pinned memory, or both. Restoring one gives a sequence whose next input
is the token at ``len(tokens)``, so a checkpoint is usable for a prompt that extends ``tokens`` by at least
one token. The Program's stores are the only physical ledger (slots, pages, host bytes, leases); the
engine's ResourceManager (``ninfer.engine.context_cache``) keeps the policy: which checkpoint a request
restores, which session owns which continuation, and what to evict first under pressure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs

from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.contract.values import JSON

# grid: inside a long prompt; prompt: after every prompt token but the last (its first decode input);
# turn: a finished assistant turn that re-renders as generated; final: another finished continuation.
CheckpointKind = Literal["grid", "prompt", "turn", "final"]
CHECKPOINT_KINDS = ("grid", "prompt", "turn", "final")


@attrs.frozen
class TurnBoundary:
    """A Frontend's preview boundary: where the assistant turn ends inside the accepted span, and the message
    a chat history holds for it.

    Tokens ``[0, end)`` of the accepted span finish the turn (through its end token). Rendering the history
    with ``message`` appended reproduces the generated text; ``exact`` says whether it also reproduces the
    generated token ids (the model may sample a non-canonical tokenization, or the template may drop the
    reasoning), or None when it was not checked. The engine keeps a finished turn as a context-cache
    continuation unless ``exact`` is False: the next turn's prompt would not extend it.
    """

    end: int
    message: Mapping[str, JSON]
    exact: bool | None = None


@attrs.frozen(kw_only=True)
class MediaRun:
    """The identity of a run of media placeholder tokens (they share one token id, so the ids cannot tell two
    images apart): tokens ``start .. start + length`` take rows ``offset ..`` of the item whose ``digest``
    (``VisionItem.digest``) is given. A prefix matches another only when its token ids and its runs agree."""

    start: int
    length: int
    digest: str
    offset: int = 0


def media_runs(prompt: PreparedPrompt) -> tuple[MediaRun, ...]:
    """The runs of a prompt's media spans, in token order."""
    return tuple(MediaRun(start=s.start, length=s.length, digest=prompt.vision[s.item_index].digest, offset=s.offset)
                 for s in sorted(prompt.media_spans, key=lambda s: s.start))


def clip_runs(runs: Sequence[MediaRun], length: int) -> tuple[MediaRun, ...]:
    """The runs as the prefix of ``length`` tokens holds them (a run cut by the end keeps its first part)."""
    return tuple(r if r.start + r.length <= length else attrs.evolve(r, length=length - r.start)
                 for r in runs if r.start < length)


@attrs.frozen(kw_only=True, eq=False)
class CheckpointInfo:
    """One checkpoint as its Program's store holds it now. ``generation`` grows on every publication or
    placement change, so of two infos of one checkpoint the higher generation is current."""

    id: int
    generation: int
    tokens: tuple[int, ...] = attrs.field(converter=tuple, repr=lambda t: f"<{len(t)} tokens>")
    kind: CheckpointKind
    on_device: bool
    on_host: bool
    device_bytes: int  # what dropping the device copy frees now (its state slot, pages nobody else holds)
    host_bytes: int    # what the host replica holds, or would hold once made
    pages_alone: int = 0  # KV pages only this checkpoint holds (what its eviction gives back to the pool)
    media: tuple[MediaRun, ...] = attrs.field(default=(), converter=tuple)  # its tokens' media identity

    @property
    def length(self) -> int:
        return len(self.tokens)


@attrs.frozen(kw_only=True)
class CacheUsage:
    """What a Program's checkpoint store holds right now."""

    checkpoints: int
    device_slots_total: int
    device_slots_used: int
    device_pages: int      # KV pages that some checkpoint references (shared ones count once)
    device_pages_alone: int  # of those, the pages no sequence holds (what evicting everything frees)
    device_bytes: int      # checkpoint state slots in use plus those pages
    host_bytes_used: int
    host_bytes_total: int  # the host budget for replicas
    leases: int

    @property
    def empty(self) -> bool:
        return self.checkpoints == 0 and self.device_slots_used == 0 and self.device_pages == 0 \
            and self.host_bytes_used == 0 and self.leases == 0


@runtime_checkable
class ContextStore(Protocol):
    """Optional Program capability: checkpoints of sequences, restorable into new sequences.

    Engine worker only, like the rest of the Program. Every method is synchronous: a materialization
    (device copy, or host to device) is complete when it returns, so the engine's one resource
    transaction never overlaps another.
    """

    def plan_saves(self, sequence_id: int, positions: Sequence[int]) -> None:
        """Save a checkpoint when the sequence's frontier reaches each of ``positions`` (ascending, each
        beyond the frontier and below the prompt's length): prefill units end there. A save point at
        ``len(prompt) - 1`` makes the prompt's last token the first decode input (its checkpoint is the
        prompt-end recovery point). A save finding no free checkpoint slot is skipped."""

    def published(self) -> list[CheckpointInfo]:
        """Checkpoints saved since the last call, in order (the engine drains this after every unit)."""

    def lease(self, checkpoint_id: int) -> CheckpointInfo | None:
        """Pin a checkpoint against eviction while a request materializes from it (None: it is gone)."""

    def unlease(self, checkpoint_id: int) -> None: ...

    def open_cached(self, prompt: PreparedPrompt, sampling: SamplingParams, checkpoint_id: int) -> int | None:
        """Bind a new sequence for ``prompt`` restored from the leased checkpoint, whose tokens must be a
        proper prefix of the prompt: device copy (StateImage copied, KV prefix shared copy-on-write) or host
        replica (copied into fresh pages). None, nothing taken, when a slot or the pages do not fit now."""

    def save_continuation(self, sequence_id: int, kind: CheckpointKind) -> CheckpointInfo | None:
        """A finished sequence's committed state becomes a checkpoint (its KV pages are shared, not copied);
        call before ``release``. None when there is nothing to keep or no checkpoint slot is free. Its info is
        returned only, not listed by ``published``."""

    def checkpoint(self, checkpoint_id: int) -> CheckpointInfo:
        """The current info of a live checkpoint (byte figures as of now)."""

    def evict(self, checkpoint_id: int, *, to_host: bool) -> CheckpointInfo | None:
        """Drop the device copy of an unleased checkpoint; with ``to_host`` first make its host replica when it
        has none and the host budget has room (an existing replica always stays). Returns the new info, or None
        when nothing remains."""

    def drop_host(self, checkpoint_id: int) -> CheckpointInfo | None:
        """Drop the host replica of an unleased checkpoint; the new info, or None when nothing remains."""

    def retire(self, checkpoint_id: int) -> None:
        """Drop an unleased checkpoint entirely."""

    def cache_usage(self) -> CacheUsage: ...
