"""PagedProgram: the Program contract composed of the shared parts, for models whose sequences each
hold one StateImage slot (its layout may have no fields) and the pages of one paged KV pool.

A native Program subclasses it: its ``__init__`` calls ``super().__init__`` (which builds the stores
from its StateImageLayout and KVPoolSpec), makes its model's views over ``self.states`` and
``self.pool``, then calls ``start_graphs``; it implements ``forward`` and ``logits`` (its model's
calls) and overrides what its architecture does differently. docs/program.md describes the units,
frontiers, rollback by Replay and reservations this class implements.

A sequence's ``computed`` positions are in the stores; its next input is ``ledger[computed:]``.
``prefill`` runs one chunk of that input and samples the first token when the prompt is complete;
``decode`` runs exactly B rows, one input token each; ``commit`` appends accepted tokens to the
ledgers (``SequenceTable``) and frees the unit's unused reservation (``KVHistoryStore``). The context
cache's save points, checkpoints and restores are ``Checkpointing`` (its ContextStore half).
"""

from __future__ import annotations

import abc
import contextlib
import uuid
from collections.abc import Sequence

import attrs
import torch

from ninfer.contract.batch import LaunchedUnit, PendingBatch, PendingBatchError, RowDecision
from ninfer.contract.config import MAX_CONCURRENCY
from ninfer.contract.constraint import TokenMasks
from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.model import PauseMode, ResourceUsage, SnapshotCost
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.batch_assembly import RowInput, build_forward_batch
from ninfer.core.cuda_graphs import DecodeGraphs
from ninfer.core.device import Device
from ninfer.core.forward_batch import ForwardBatch
from ninfer.core.kv_pool import PagedKVPool, PoolExhausted, pages_for
from ninfer.core.readback import Readback
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.checkpointing import Checkpointing
from ninfer.models.common.context.checkpoints import CheckpointStore
from ninfer.models.common.context.errors import ProgramError
from ninfer.models.common.context.kv_history import KVHistoryStore
from ninfer.models.common.context.resume import PausedStates, ReplayResume
from ninfer.models.common.context.sequence import SequenceRecord
from ninfer.models.common.context.sequence_table import SequenceTable
from ninfer.models.common.sampler import Sampler, pending_rows
from ninfer.models.common.scoring import WindowScores, score_window
from ninfer.models.common.vision_handoff import VisionHandoff, decode_positions
from ninfer.ops.launch import Arrivals, scope


@attrs.frozen(kw_only=True)
class _BatchNative:
    """Private execution metadata of a PendingBatch: which Program made it, and what each row consumed."""

    program_id: int
    consumed: tuple[int, ...]  # input positions each row ran in this unit


@attrs.define(kw_only=True, eq=False)
class _LaunchNative:
    program_id: int
    seqs: tuple[SequenceRecord, ...]
    readback: Readback | None  # None: the sampling waits for the engine's masks (``_sampled``)
    chained: bool  # its rows' inputs are the previous unit's provisional tokens
    logits: torch.Tensor | None = None  # what a waiting sampling draws from, with its rows' draw indices
    indices: tuple[int, ...] = ()
    masks: TokenMasks | None = None


class PagedProgram(Checkpointing, abc.ABC):
    """Implements ``ninfer.contract.Program`` (and ``PipelinedDecode``, ``ContextStore``) given a subclass's
    ``forward`` / ``logits``."""

    def __init__(self, *, state_layout: StateImageLayout, kv_pool: KVPoolSpec, device: Device | str,
                 max_concurrency: int, capacity: ProgramCapacity, kv_dtype: torch.dtype | str | None = None,
                 vocab_size: int, sampling_defaults: SamplingParams | None = None) -> None:
        """``capacity``: what the runtime granted (``ProgramCapacity``: KV pages, context, the context cache's
        device StateImages and host bytes, the Snapshot host budget, programmatic dependent launch for this
        Program's Triton kernels). A ``calibration`` capacity keeps ``max_model_len`` at the planned context
        although its pages cannot hold it; such a Program never runs a sequence."""
        if not 1 <= max_concurrency <= MAX_CONCURRENCY:  # StartupOptions validated it; a direct build too
            raise ValueError(f"max_concurrency must be in 1..{MAX_CONCURRENCY}, got {max_concurrency}")
        num_pages, host_budget_bytes = capacity.kv_pages, capacity.host_budget_bytes
        self.id = uuid.uuid4().int >> 65  # names this Program in its launches and ResumeStates; no global counter
        self.pdl = capacity.pdl
        self.arrivals = Arrivals()  # the kernels' arrival counters: this Program's, freed with it
        self.device = Device.parse(device)
        self.state_layout = state_layout
        self.kv_pools = (kv_pool,)
        self.max_concurrency = max_concurrency
        self.decode_span = 1  # positions a decode unit writes per row (a speculative Program: more)
        self.vocab_size = vocab_size
        self.sampling_defaults = sampling_defaults
        self.host_budget_bytes = host_budget_bytes
        # One extra slot and page that no sequence owns: graph warmup/capture and padding point there.
        self.states = StateImageStorage(state_layout, max_concurrency + 1, self.device)
        self.pool = PagedKVPool(kv_pool, num_pages + 1, self.device, kv_dtype)
        self._scratch_slot = self.states.allocate()
        (self._scratch_page,) = self.pool.allocator.allocate(1)
        self.page_size = kv_pool.page_size
        limit = capacity.max_model_len or num_pages * self.page_size
        self.max_model_len = limit if capacity.calibration else min(limit, num_pages * self.page_size)
        self.kv = KVHistoryStore(self.pool)
        self.sequences = SequenceTable(self.states, self.kv, max_model_len=self.max_model_len,
                                       vocab_size=vocab_size, sampling_defaults=sampling_defaults)
        self._seqs = self.sequences.records  # read on every step
        self.paused = PausedStates(self.id, self.states, self.kv, host_budget_bytes)
        self.checkpoints = CheckpointStore(self.states, self.kv, slots=capacity.checkpoint_slots,
                                           host_budget_bytes=capacity.cache_host_budget_bytes)
        self.sampler = Sampler(self.device.torch, mask_rows=max_concurrency)
        self.graphs: DecodeGraphs | None = None
        self.graph_error: str | None = None
        # Prompts with media: a subclass with an encoder sets ``vision.encode`` and ``sequences.vision``.
        self.vision = VisionHandoff()

    # -- the native model ---------------------------------------------------------------------------
    @abc.abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden rows [N, H] of every new token of ``batch``, updating the stores through the views."""

    @abc.abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, V] of hidden rows [M, H]."""

    def backing_bytes(self) -> int:
        images = self.checkpoints.images
        return self.states.nbytes + self.pool.nbytes + (images.nbytes if images is not None else 0)

    def release_graphs(self) -> None:
        self.graphs = None  # its captured graphs, their pool and static buffers go with it

    def start_graphs(self, *, cuda_graphs: bool = True, static_decode: bool = False) -> None:
        """Call once the views exist. ``cuda_graphs``: capture decode graphs on CUDA (eager, with the reason in
        ``graph_error``, when capture fails). ``static_decode``: without graphs, still decode through the graphs'
        static input buffers (checks that input path on CPU)."""
        if not (cuda_graphs and self.device.is_cuda) and not static_decode:
            return
        graphs = DecodeGraphs(self._decode_logits, max_batch=self.max_concurrency,
                              max_pages=pages_for(self.max_model_len, self.page_size), page_size=self.page_size,
                              scratch_slot=self._scratch_slot, scratch_page=self._scratch_page,
                              device=self.device.torch)
        if cuda_graphs and self.device.is_cuda:
            self.graph_error = graphs.try_capture(self._launches())
            if self.graph_error is not None:
                return
        self.graphs = graphs

    def _decode_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The graphed part of a decode step: forward + logits of every row."""
        hidden = self.forward(batch)
        if batch.logits_indices.shape[0] != hidden.shape[0]:
            hidden = hidden[batch.logits_indices]
        # else every new token wants logits: the indices are 0..N-1 and the gather (a kernel) is the identity
        return self.logits(hidden)

    def _launches(self):
        return scope(self.pdl, self.arrivals)

    # -- sequences (``SequenceTable``) ------------------------------------------------------------
    def open_sequence(self, prompt: PreparedPrompt, sampling: SamplingParams) -> int:
        """Bind a StateImage slot for a new sequence (no KV pages yet: ``reserve_units`` takes them)."""
        return self.sequences.open(prompt, sampling)

    def fork(self, sequence_id: int, sampling: SamplingParams | None = None) -> int:
        """A new sequence continuing from this one's committed state (StateImage copied, KV pages shared)."""
        return self.sequences.fork(sequence_id, sampling)

    def _seq(self, sequence_id: int) -> SequenceRecord:
        return self.sequences.get(sequence_id)

    def input_remaining(self, sequence_id: int) -> int:
        return self.sequences.get(sequence_id).input_remaining

    def release(self, sequence_id: int) -> None:
        self.sequences.release(sequence_id)
        self.sampler.forget(sequence_id)
        self.vision.drop(sequence_id)

    def reserve_units(self, sequence_id: int, tokens: int) -> bool:
        """Hold the pages positions computed..computed+tokens need; False (nothing taken) when they do not fit."""
        return self.sequences.reserve(sequence_id, tokens)

    # -- execution ---------------------------------------------------------------------------------
    def prefill(self, sequence_id: int, max_tokens: int, *, masks: TokenMasks | None = None) -> PendingBatch | None:
        """Run up to ``max_tokens`` of the sequence's remaining input; sample the first token when the prompt ends
        (``masks``: the engine's token masks)."""
        seq = self.sequences.get(sequence_id)
        self.sequences.check_idle(seq)
        remaining = seq.input_remaining
        if remaining <= 0:
            raise ProgramError(f"sequence {sequence_id} has no input left to prefill (it is decode-ready)")
        if max_tokens < 1:
            raise ValueError(f"prefill needs max_tokens >= 1, got {max_tokens}")
        n = min(max_tokens, remaining)
        if seq.save_points:  # a unit ends at the next save point
            n = min(n, seq.save_points[0] - seq.computed)
        if not self.kv.hold(seq, seq.computed + n):
            raise PoolExhausted(f"sequence {sequence_id}: KV pages for {n} prefill positions are not reserved and "
                                f"do not fit ({self.pool.allocator.num_free} free)")
        sample = n == remaining and seq.generated == 0 and not seq.first_by_decode
        start = seq.computed
        batch = build_forward_batch([RowInput(tokens=seq.ledger[start:start + n], start=start, slot=seq.slot,
                                              pages=seq.pages, want_logits=sample)],
                                    self.page_size, self.device.torch)
        with self._unit([seq]), torch.inference_mode():
            self.vision.fill(batch, seq, start, n)  # a prompt with media: rotary positions, encoder rows
            hidden = self.forward(batch)
            seq.computed += n
            self.vision.passed(seq)
            self.save_point_reached(seq)
            if not sample:
                self._prefilled(seq, batch, hidden, start, None)
                return None
            readback = self.sampler.launch([seq], self.logits(hidden[batch.logits_indices]), [seq.generated], masks)
            self._prefilled(seq, batch, hidden, start, readback.tokens)
            return self._pending("prefill", [seq], range(1), readback, consumed=(n,))

    def _prefilled(self, seq: SequenceRecord, batch: ForwardBatch, hidden: torch.Tensor, start: int,
                   sampled: torch.Tensor | None) -> None:
        """After a prefill chunk's forward (``hidden`` of its positions from ``start``; ``sampled``: the first
        token, on the device, when the chunk ended the prompt): a drafter's pass over it (``SpeculativeProgram``)."""

    def decode(self, sequence_ids: Sequence[int], *, masks: TokenMasks | None = None) -> PendingBatch:
        """One step over exactly these decode-ready sequences (B = len(sequence_ids))."""
        return self.collect(self.launch_decode(sequence_ids, masks=masks))

    def launch_decode(self, sequence_ids: Sequence[int], *, after: LaunchedUnit | None = None,
                      masks: TokenMasks | None = None) -> LaunchedUnit:
        """Queue one decode step (forward, logits, sampling, the tokens' copy to the host) without waiting.

        ``after``: an uncollected unit over the same sequences, in the same order; each row's input is its
        provisional token, still on the device, at the position after it (see ``PipelinedDecode``).
        ``masks`` constraining one of the rows, or a row with a penalty: the sampling waits (``_sampled``)."""
        ids, seqs, prev = self._decode_rows(sequence_ids, after)
        # A chained row's input is on the device: a placeholder goes through the host path, then the copy.
        inputs = [0] * len(seqs) if prev is not None else [s.ledger[s.computed] for s in seqs]
        rope = decode_positions(seqs)  # None unless a row's prompt has media (its MRoPE shift)
        with self._unit(seqs), torch.inference_mode():
            if self.graphs is not None:
                self.graphs.load(inputs, [s.computed for s in seqs], [s.slot for s in seqs], [s.pages for s in seqs],
                                 [(s.id, s.pages_epoch) for s in seqs],
                                 device_tokens=None if prev is None else self._sampled(prev).tokens,
                                 rope_positions=rope)
                logits = self.graphs.replay(len(seqs))
            else:
                batch = build_forward_batch(
                    [RowInput(tokens=[t], start=s.computed, slot=s.slot, pages=s.pages, want_logits=True)
                     for s, t in zip(seqs, inputs, strict=True)], self.page_size, self.device.torch)
                if rope is not None:
                    batch.positions = torch.tensor(rope, dtype=torch.int64, device=self.device.torch)
                if prev is not None:
                    batch.input_ids.copy_(self._sampled(prev).tokens)
                logits = self._decode_logits(batch)
            # The token sampled from input position p is generated token number p + 1 - prompt_len.
            native = _LaunchNative(program_id=self.id, seqs=tuple(seqs), readback=None, chained=prev is not None,
                                   logits=logits, indices=tuple(s.computed + 1 - s.prompt_len for s in seqs),
                                   masks=masks)
            waits = masks is not None and any(masks.constrained(i) for i in ids)
            if not waits and not any(s.sampling.counts_tokens for s in seqs):  # penalties read the step before
                self._sampled(native)
            for seq in seqs:
                seq.computed += 1
                seq.launched += 1
        return LaunchedUnit(kind="decode", sequence_ids=ids, native=native)

    def _sampled(self, native: _LaunchNative) -> Readback:
        """The unit's sampling, queued now if it waited for masks: the engine has committed every earlier unit of
        its sequences by the time anything needs its tokens, so each matcher stands right before them."""
        if native.readback is None:
            with self._launches(), torch.inference_mode():
                native.readback = self.sampler.launch(native.seqs, native.logits, native.indices, native.masks)
            native.logits = native.masks = None
            for seq in native.seqs:  # released while it waited: its row is dropped, and so is its generator
                if self._seqs.get(seq.id) is not seq:
                    self.sampler.forget(seq.id)
        return native.readback

    def _decode_rows(self, sequence_ids: Sequence[int], after: LaunchedUnit | None
                     ) -> tuple[list[int], list[SequenceRecord], _LaunchNative | None]:
        """Check a decode unit's rows (decode-ready, or chained after ``after``) and hold any page they still need:
        ``decode_span`` positions from each row's input, none past max_model_len (the scratch page stands in)."""
        ids = list(sequence_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ProgramError(f"decode needs distinct sequence ids, got {ids}")
        if len(ids) > self.max_concurrency:
            raise ProgramError(f"decode of {len(ids)} rows exceeds max_concurrency {self.max_concurrency}")
        get = self.sequences.get
        seqs = [get(i) for i in ids]
        prev = None
        if after is not None:
            prev = self._launch_native(after)
            if tuple(ids) != after.sequence_ids:
                raise ProgramError(f"a chained decode runs the rows of the unit it follows, {list(after.sequence_ids)}, "
                                   f"in order; got {ids}")
        for seq in seqs:  # per row per step: the frontier arithmetic inline rather than through properties
            n = len(seq.ledger)
            if prev is None:
                self.sequences.check_idle(seq)
                ready = (n > seq.prompt_len or seq.first_by_decode) and seq.computed == n - 1
            else:  # the previous unit's token (not in the ledger yet) is this row's input
                ready = seq.launched == 1 and not seq.pending and seq.computed == n
                n += 1
            if not ready:
                raise ProgramError(f"sequence {seq.id} is not decode-ready ({seq.input_remaining} input positions "
                                   f"remaining, {seq.generated} generated, {seq.launched} launched)")
            if n > self.max_model_len:  # the input goes at position computed = n - 1
                raise ProgramError(f"sequence {seq.id} is at max_model_len {self.max_model_len}")
        ends = [min(s.computed + self.decode_span, self.max_model_len) for s in seqs]
        needs = [self.kv.needed(s, end) for s, end in zip(seqs, ends, strict=True)]  # 0 for rows the engine reserved
        if sum(needs) > self.pool.allocator.num_free:
            raise PoolExhausted(f"decode of {len(ids)} rows writing {self.decode_span} positions each needs "
                                f"{sum(needs)} unreserved KV pages, {self.pool.allocator.num_free} free "
                                f"(reserve_units(id, decode_span) first)")
        for seq, end, need in zip(seqs, ends, needs, strict=True):
            if need:
                self.kv.hold(seq, end)
        return ids, seqs, prev

    def collect(self, unit: LaunchedUnit) -> PendingBatch:
        """Wait for a launched unit's tokens; rows of released or voided sequences are left out."""
        native = self._launch_native(unit)
        unit.collected = True
        live = []
        for seq in native.seqs:
            if self._seqs.get(seq.id) is not seq:  # released while its row was in flight
                continue
            seq.launched -= 1
            if seq.void_ahead and seq.launched == 0:  # its input token was not accepted
                seq.void_ahead = False
                continue
            live.append(seq)
        index = {seq.id: i for i, seq in enumerate(native.seqs)}
        return self._pending("decode", live, [index[s.id] for s in live], self._sampled(native), (1,) * len(live))

    def _launch_native(self, unit: LaunchedUnit) -> _LaunchNative:
        native = unit.native
        if not isinstance(native, _LaunchNative) or native.program_id != self.id:
            raise ProgramError("LaunchedUnit was not produced by this Program")
        if unit.collected:
            raise ProgramError("LaunchedUnit collected twice")
        return native

    @contextlib.contextmanager
    def _unit(self, seqs: list[SequenceRecord]):
        """A unit that fails part way leaves its rows' state half written: roll them back, then re-raise.
        Its launches run in this Program's PDL scope."""
        try:
            with self._launches():
                yield
        except BaseException:
            for seq in seqs:
                seq.pending = False
                self.sequences.rollback(seq)
            raise

    def _pending(self, kind: str, seqs: Sequence[SequenceRecord], rows_at: Sequence[int], readback: Readback,
                 consumed: tuple[int, ...]) -> PendingBatch:
        """The PendingBatch of ``seqs``, whose results are row ``rows_at[k]`` of ``readback`` (waited for here)."""
        tokens, logprobs = self.sampler.wait(readback)
        for seq in seqs:
            seq.pending = True
        return PendingBatch(kind=kind, rows=pending_rows(seqs, rows_at, tokens, logprobs),
                            native=_BatchNative(program_id=self.id, consumed=consumed))

    # -- settlement --------------------------------------------------------------------------------
    def _members(self, batch: PendingBatch) -> list[SequenceRecord]:
        native = batch.native
        if not isinstance(native, _BatchNative) or native.program_id != self.id:
            raise PendingBatchError("PendingBatch was not produced by this Program")
        if batch.consumed:
            raise PendingBatchError("PendingBatch consumed twice")
        seqs = []
        for row in batch.rows:
            seq = self._seqs.get(row.sequence_id)
            if seq is None or not seq.pending:
                raise PendingBatchError(f"PendingBatch row for sequence {row.sequence_id} has no pending sequence")
            seqs.append(seq)
        return seqs

    def commit(self, batch: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        """Append accepted tokens to each ledger; rows that accept nothing roll back (see module doc)."""
        seqs = self._members(batch)
        batch.take(decisions)
        self.sequences.commit(seqs, batch.rows, decisions)

    def abort_pending(self, batch: PendingBatch) -> None:
        """Drop the whole batch: ledgers stay at the pre-batch accepted frontier; state is rebuilt by Replay."""
        seqs = self._members(batch)
        batch.take(None)
        self.sequences.abort(seqs)

    # -- pause / resume ----------------------------------------------------------------------------
    @property
    def host_bytes_used(self) -> int:
        return self.paused.host_bytes_used

    def snapshot_bytes(self, sequence_id: int) -> int:
        return self.paused.snapshot_bytes(self._seq(sequence_id))

    def can_snapshot(self, sequence_id: int) -> bool:
        return self.paused.can_snapshot(self._seq(sequence_id))

    def snapshot_cost(self, sequence_id: int) -> SnapshotCost:
        seq = self._seq(sequence_id)
        return SnapshotCost(host_bytes=self.paused.snapshot_bytes(seq), replay_positions=seq.computed)

    def pause(self, sequence_id: int, mode: PauseMode) -> ReplayResume:
        """Release the sequence's device resources at its committed boundary; returns an owning ResumeState."""
        seq = self.sequences.get(sequence_id)
        self.sequences.check_idle(seq)
        return self.paused.pause(seq, mode, release=lambda: self.release(sequence_id))

    def resume(self, resume_state: ReplayResume) -> int | None:
        """Re-bind a paused sequence; None (state kept) when a slot and the rebuild's pages do not fit now."""
        seq = self.paused.resume(resume_state, self.sequences.new_id)
        return None if seq is None else self.sequences.bind(seq)

    def discard(self, resume_state: ReplayResume) -> None:
        self.paused.discard(resume_state)

    def demote(self, resume_state: ReplayResume) -> ReplayResume:
        """Revoke a Snapshot: drop its host copies, keep the ledger and frontier (Replay rebuilds them exactly)."""
        return self.paused.demote(resume_state)

    # -- accounting and scoring --------------------------------------------------------------------
    def usage(self) -> ResourceUsage:
        """Exact occupancy (the scratch slot and page used by graph capture are not counted)."""
        cache = self.checkpoints.usage()
        return ResourceUsage(state_slots_total=self.states.num_slots - 1, state_slots_used=self.states.num_used - 1,
                             kv_pages_total=self.pool.num_pages - 1, kv_pages_used=self.pool.allocator.num_used - 1,
                             host_bytes_used=self.paused.host_bytes_used,
                             reserved_pages=self.sequences.reserved_pages(),
                             host_bytes_total=self.host_budget_bytes, checkpoints=cache.checkpoints,
                             checkpoint_slots_used=cache.device_slots_used, cache_pages=cache.device_pages_alone,
                             cache_host_bytes=cache.host_bytes_used, leases=cache.leases)

    def score_window(self, token_ids: Sequence[int], score_from: int = 1, *, chunk: int = 1024,
                     logits_rows: int = 256, top: int | None = None) -> torch.Tensor | WindowScores:
        """fp32 log p(token_ids[i] | token_ids[:i]) for i in score_from..n-1, as one fresh causal window
        (``ninfer.models.common.scoring.score_window``: a temporary slot and pages, outside generation)."""
        return score_window(token_ids, score_from, forward=self.forward, logits=self.logits, states=self.states,
                            pool=self.pool, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                            launches=self._launches(), chunk=chunk, logits_rows=logits_rows, top=top)
