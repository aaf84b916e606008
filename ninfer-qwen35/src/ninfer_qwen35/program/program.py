"""Qwen35Program: the physical side of one resident Qwen3.5 model (engine worker only).

It owns the StateImage slots (conv + recurrent state of every GDN layer, one contiguous image per
slot), the typed paged KV pool of the attention layers, host copies of paused sequences, the
decode CUDA graphs, and every sequence's accepted ledger.

Units and frontiers. A sequence's ``computed`` positions are in the stores; its next input is
``ledger[computed:]``. ``prefill`` runs one chunk of that input and, when the prompt is complete,
samples the first token into a PendingBatch. ``decode`` runs exactly B rows, one input token each,
and samples one provisional token per row (a row's tuple can hold several tokens later, for
speculative decoding). ``commit`` appends accepted tokens to the ledger and frees the unit's unused
reservation.

Rollback. Ordinary decode updates the recurrent state in place and keeps no pre-step copy (that
would cost a whole StateImage copy per step for a rare event). A row that is aborted, cancelled,
or accepts fewer tokens than it consumed therefore keeps its accepted ledger but drops its
physical frontier to zero: ``input_remaining`` then reports its accepted history, which the engine
re-runs through ``prefill`` (Replay) before the next decode — exact, since every draw depends only
on (seed, token index). Speculative rows will instead keep per-step state copies
(``StateImageLayout.steps``) and select the accepted step.

Reservations. ``reserve_units(seq, n)`` allocates the KV pages that positions computed..computed+n
need (never the rest of the generation); a unit settlement (commit / abort) frees pages beyond the
committed frontier. ``resume`` reserves the rebuild up to the old frontier plus the first new unit.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ninfer.contract.batch import LaunchedUnit, PendingBatch, PendingBatchError, PendingRow, RowDecision
from ninfer.contract.model import PauseMode, ResourceUsage, SnapshotCost
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.device import Device
from ninfer.core.kv_pool import PagedKVPool, PoolExhausted, pages_for
from ninfer.core.state_store import StateImageStorage
from ninfer_qwen35.execution.forward_batch import ForwardBatch, ModelStateViews
from ninfer_qwen35.program.batching import RowInput, build_forward_batch
from ninfer_qwen35.program.resume import ReplayResume, SnapshotResume
from ninfer_qwen35.program.sequence import RowSampling, SequenceRecord, draw_seed

log = logging.getLogger(__name__)
_program_ids = itertools.count(1)


class ProgramError(RuntimeError):
    """The Program was called in a way that breaks its contract (unknown sequence, unit while pending, ...)."""


@attrs.frozen(kw_only=True)
class _BatchNative:
    """Private execution metadata of a PendingBatch: which Program made it, and what each row consumed."""

    program_id: int
    consumed: tuple[int, ...]  # input positions each row ran in this unit


@attrs.frozen(kw_only=True)
class _Readback:
    """A unit's sampled tokens (and logprobs) on their way to the host: one copy, one event."""

    tokens: torch.Tensor            # device [B] int64: the next step's inputs when it is chained
    host: torch.Tensor              # the host copy (pinned on CUDA) of tokens, or of the fp64 pack with logprobs
    event: torch.cuda.Event | None  # recorded after the copy (CUDA)
    want: tuple[int, ...]           # rows that report logprobs
    top_n: int


@attrs.frozen(kw_only=True)
class _LaunchNative:
    program_id: int
    seqs: tuple[SequenceRecord, ...]
    readback: _Readback
    chained: bool  # its rows' inputs are the previous unit's provisional tokens


_TOPK_PATH = 1024  # largest top_k sampled from its top-k candidates; wider (or none) sorts the vocabulary


def _upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on ``dev`` without waiting for the device: pinned, then an async copy (a copy
    from pageable memory may synchronize with the stream, which would stall a pipelined launch)."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


class Qwen35Program:
    """Implements ``ninfer.contract.Program`` for Qwen3.5 over the native model (``forward`` / ``logits``)."""

    def __init__(self, model: Any, *, state_layout: StateImageLayout, kv_pool: KVPoolSpec, device: Device | str,
                 max_concurrency: int, num_pages: int, kv_dtype: torch.dtype | str | None = None,
                 vocab_size: int, host_budget_bytes: int = 0, sampling_defaults: SamplingParams | None = None,
                 max_model_len: int | None = None, cuda_graphs: bool = True, static_decode: bool = False,
                 pdl: bool = False) -> None:
        """``cuda_graphs``: capture decode graphs on CUDA. ``static_decode``: without graphs, still decode
        through the graphs' static input buffers (checks that input path on CPU). ``pdl``: launch this
        Program's Triton kernels with programmatic dependent launch (``ops.triton._pdl``). ``max_concurrency``
        comes validated from ``StartupOptions`` (1..8)."""
        self.id = next(_program_ids)
        self.pdl = pdl
        self.model = model
        self.device = Device.parse(device)
        self.state_layout = state_layout
        self.kv_pools = (kv_pool,)
        self.max_concurrency = max_concurrency
        self.vocab_size = vocab_size
        self.sampling_defaults = sampling_defaults
        self.host_budget_bytes = host_budget_bytes
        # One extra slot and page that no sequence owns: graph warmup/capture and padding point there.
        self.states = StateImageStorage(state_layout, max_concurrency + 1, self.device)
        self.pool = PagedKVPool(kv_pool, num_pages + 1, self.device, kv_dtype)
        self._scratch_slot = self.states.allocate()
        (self._scratch_page,) = self.pool.allocator.allocate(1)
        self.page_size = kv_pool.page_size
        capacity = num_pages * self.page_size
        self.max_model_len = min(max_model_len or capacity, capacity)
        self.views = ModelStateViews(conv=self.states.view("conv"), recurrent=self.states.view("recurrent"),
                                     kv=self.pool.caches(), page_size=self.page_size)
        self._seqs: dict[int, SequenceRecord] = {}
        self._paused: dict[int, ReplayResume] = {}
        self._ids = itertools.count(1)
        self._generators: dict[int, torch.Generator] = {}
        self.host_bytes_used = 0
        self.plan: Any = None  # the Startup's CapacityPlan, when built by Startup
        self.graphs = None
        self.graph_error: str | None = None
        if cuda_graphs and self.device.is_cuda:
            self._capture_graphs()
        elif static_decode:
            self.graphs = self._decode_graphs()

    # -- sequences ---------------------------------------------------------------------------------
    def open_sequence(self, prompt: PreparedPrompt, sampling: SamplingParams) -> int:
        """Bind a StateImage slot for a new sequence (no KV pages yet: ``reserve_units`` takes them)."""
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len {self.max_model_len}")
        bad = [t for t in prompt.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the model vocabulary 0..{self.vocab_size - 1}")
        if prompt.media:
            raise ValueError("this Program runs text only: the prompt carries media")
        try:
            slot = self.states.allocate()
        except PoolExhausted as exc:
            raise ProgramError(f"no free StateImage slot for a new sequence: {exc}") from None
        return self._bind(SequenceRecord(id=next(self._ids), slot=slot, prompt_len=len(prompt),
                                         ledger=list(prompt.token_ids),
                                         sampling=RowSampling.resolve(sampling, self.sampling_defaults)))

    def fork(self, sequence_id: int, sampling: SamplingParams | None = None) -> int:
        """A new sequence continuing from this one's committed state: the StateImage is copied whole,
        the KV pages covering the frontier are shared (copy-on-write on the first write to a shared page)."""
        src = self._seq(sequence_id)
        self._check_idle(src)
        try:
            slot = self.states.allocate()
        except PoolExhausted as exc:
            raise ProgramError(f"no free StateImage slot to fork sequence {sequence_id}: {exc}") from None
        self.states.copy_slot(src.slot, slot)
        pages = src.pages[:pages_for(src.computed, self.page_size)]
        self.pool.allocator.share(pages)
        resolved = src.sampling if sampling is None else RowSampling.resolve(sampling, self.sampling_defaults)
        return self._bind(SequenceRecord(id=next(self._ids), slot=slot, prompt_len=src.prompt_len,
                                         ledger=list(src.ledger), sampling=resolved, computed=src.computed,
                                         pages=list(pages)))

    def _bind(self, seq: SequenceRecord) -> int:
        self._seqs[seq.id] = seq
        return seq.id

    def _seq(self, sequence_id: int) -> SequenceRecord:
        try:
            return self._seqs[sequence_id]
        except KeyError:
            raise ProgramError(f"unknown sequence id {sequence_id}") from None

    def input_remaining(self, sequence_id: int) -> int:
        return self._seq(sequence_id).input_remaining

    def release(self, sequence_id: int) -> None:
        seq = self._seq(sequence_id)
        if seq.pending:
            raise ProgramError(f"sequence {sequence_id} has an unconsumed PendingBatch row; commit or abort it first")
        # A launched (uncollected) row may still be in flight: its writes to this slot and these pages are
        # queued before any later use of them on the same stream, and collect leaves the row out.
        self.pool.allocator.free(seq.pages)
        self.states.free(seq.slot)
        self._generators.pop(seq.id, None)
        del self._seqs[sequence_id]

    # -- reservations ------------------------------------------------------------------------------
    def reserve_units(self, sequence_id: int, tokens: int) -> bool:
        """Hold the pages positions computed..computed+tokens need; False (nothing taken) when they do not fit."""
        seq = self._seq(sequence_id)
        if tokens < 1:
            raise ValueError(f"reserve_units needs at least one token, got {tokens}")
        end = seq.computed + tokens
        if end > self.max_model_len:
            raise ValueError(f"sequence {sequence_id}: {end} positions exceed max_model_len {self.max_model_len}")
        return self._hold_pages(seq, end)

    def _pages_needed(self, seq: SequenceRecord, positions: int) -> int:
        """Fresh pages a unit writing computed..positions needs: new pages plus private copies of shared ones."""
        first = seq.computed // self.page_size
        refcount = self.pool.allocator.refcount
        cow = sum(1 for p in seq.pages[first:pages_for(positions, self.page_size)] if refcount(p) > 1)
        return max(0, pages_for(positions, self.page_size) - len(seq.pages)) + cow

    def _hold_pages(self, seq: SequenceRecord, positions: int) -> bool:
        """Own every page positions computed..positions touch (allocate, or copy-on-write a shared one)."""
        need = self._pages_needed(seq, positions)
        if need == 0:
            return True
        if need > self.pool.allocator.num_free:
            return False
        first = seq.computed // self.page_size
        for i in range(first, min(len(seq.pages), pages_for(positions, self.page_size))):
            private = self.pool.writable(seq.pages[i])
            if private != seq.pages[i]:
                seq.pages[i] = private
                seq.pages_epoch += 1  # an entry changed: cached graph block-table rows are stale
        seq.pages.extend(self.pool.allocator.allocate(pages_for(positions, self.page_size) - len(seq.pages)))
        return True

    def _settle_pages(self, seq: SequenceRecord) -> None:
        """End of a unit: free the unused reservation beyond the committed frontier."""
        keep = pages_for(seq.computed, self.page_size)
        if len(seq.pages) > keep:
            self.pool.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
            seq.pages_epoch += 1

    # -- execution ---------------------------------------------------------------------------------
    def prefill(self, sequence_id: int, max_tokens: int) -> PendingBatch | None:
        """Run up to ``max_tokens`` of the sequence's remaining input; sample the first token when the prompt ends."""
        seq = self._seq(sequence_id)
        self._check_idle(seq)
        remaining = seq.input_remaining
        if remaining <= 0:
            raise ProgramError(f"sequence {sequence_id} has no input left to prefill (it is decode-ready)")
        if max_tokens < 1:
            raise ValueError(f"prefill needs max_tokens >= 1, got {max_tokens}")
        n = min(max_tokens, remaining)
        if not self._hold_pages(seq, seq.computed + n):
            raise PoolExhausted(f"sequence {sequence_id}: KV pages for {n} prefill positions are not reserved and "
                                f"do not fit ({self.pool.allocator.num_free} free)")
        sample = n == remaining and seq.generated == 0
        start = seq.computed
        batch = build_forward_batch([RowInput(tokens=seq.ledger[start:start + n], start=start, slot=seq.slot,
                                              pages=seq.pages, want_logits=sample)],
                                    self.page_size, self.device.torch)
        with self._unit([seq]), torch.inference_mode():
            hidden = self.model.forward(batch, self.views)
            seq.computed += n
            if not sample:
                return None
            logits = self.model.logits(hidden[batch.logits_indices])
            return self._sample("prefill", [seq], logits, consumed=(n,))

    def decode(self, sequence_ids: Sequence[int]) -> PendingBatch:
        """One step over exactly these decode-ready sequences (B = len(sequence_ids))."""
        return self.collect(self.launch_decode(sequence_ids))

    def launch_decode(self, sequence_ids: Sequence[int], *, after: LaunchedUnit | None = None) -> LaunchedUnit:
        """Queue one decode step (forward, logits, sampling, the tokens' copy to the host) without waiting.

        ``after``: an uncollected unit over the same sequences, in the same order; each row's input is its
        provisional token, still on the device, at the position after it (see ``PipelinedDecode``).
        """
        ids = list(sequence_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ProgramError(f"decode needs distinct sequence ids, got {ids}")
        if len(ids) > self.max_concurrency:
            raise ProgramError(f"decode of {len(ids)} rows exceeds max_concurrency {self.max_concurrency}")
        seqs = [self._seq(i) for i in ids]
        prev = None
        if after is not None:
            prev = self._launch_native(after)
            if tuple(ids) != after.sequence_ids:
                raise ProgramError(f"a chained decode runs the rows of the unit it follows, {list(after.sequence_ids)}, "
                                   f"in order; got {ids}")
        for seq in seqs:  # per row per step: the frontier arithmetic inline rather than through properties
            n = len(seq.ledger)
            if prev is None:
                self._check_idle(seq)
                ready = n > seq.prompt_len and seq.computed == n - 1
            else:  # the previous unit's token (not in the ledger yet) is this row's input
                ready = seq.launched == 1 and not seq.pending and seq.computed == n
                n += 1
            if not ready:
                raise ProgramError(f"sequence {seq.id} is not decode-ready ({seq.input_remaining} input positions "
                                   f"remaining, {seq.generated} generated, {seq.launched} launched)")
            if n > self.max_model_len:  # the input goes at position computed = n - 1
                raise ProgramError(f"sequence {seq.id} is at max_model_len {self.max_model_len}")
        needs = [self._pages_needed(s, s.computed + 1) for s in seqs]  # 0 for rows the engine reserved
        if sum(needs) > self.pool.allocator.num_free:
            raise PoolExhausted(f"decode of {len(ids)} rows needs {sum(needs)} unreserved KV pages, "
                                f"{self.pool.allocator.num_free} free")
        for seq, need in zip(seqs, needs, strict=True):
            if need:
                self._hold_pages(seq, seq.computed + 1)
        # A chained row's input is on the device: a placeholder goes through the host path, then the copy.
        inputs = [0] * len(seqs) if prev is not None else [s.ledger[s.computed] for s in seqs]
        with self._unit(seqs), torch.inference_mode():
            if self.graphs is not None:
                self.graphs.load(inputs, [s.computed for s in seqs], [s.slot for s in seqs], [s.pages for s in seqs],
                                 [(s.id, s.pages_epoch) for s in seqs],
                                 device_tokens=None if prev is None else prev.readback.tokens)
                logits = self.graphs.replay(len(seqs))
            else:
                batch = build_forward_batch(
                    [RowInput(tokens=[t], start=s.computed, slot=s.slot, pages=s.pages, want_logits=True)
                     for s, t in zip(seqs, inputs, strict=True)], self.page_size, self.device.torch)
                if prev is not None:
                    batch.input_ids.copy_(prev.readback.tokens)
                logits = self._decode_logits(batch)
            # The token sampled from input position p is generated token number p + 1 - prompt_len.
            readback = self._sample_launch(seqs, logits, [s.computed + 1 - s.prompt_len for s in seqs])
            for seq in seqs:
                seq.computed += 1
                seq.launched += 1
        return LaunchedUnit(kind="decode", sequence_ids=ids,
                            native=_LaunchNative(program_id=self.id, seqs=tuple(seqs), readback=readback,
                                                 chained=prev is not None))

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
        token_list, lp = self._sample_collect(native.readback)
        index = {seq.id: i for i, seq in enumerate(native.seqs)}
        return self._pending("decode", live, [index[s.id] for s in live], token_list, lp, (1,) * len(live))

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
                self._rollback(seq)
            raise

    def _launches(self):
        from ninfer.ops.triton._pdl import scope

        return scope(self.pdl)

    def _decode_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The graphed part of a decode step: forward + logits of every row."""
        hidden = self.model.forward(batch, self.views)
        if batch.logits_indices.shape[0] != hidden.shape[0]:
            hidden = hidden[batch.logits_indices]
        # else every new token wants logits: the indices are 0..N-1 and the gather (a kernel) is the identity
        return self.model.logits(hidden)

    def _check_idle(self, seq: SequenceRecord) -> None:
        if seq.pending or seq.launched:
            raise ProgramError(f"sequence {seq.id} has an unconsumed PendingBatch or LaunchedUnit row")

    def _generator(self, seq: SequenceRecord, index: int) -> torch.Generator:
        """The generator of the sequence's ``index``-th sampled token (counter-based: see ``draw_seed``)."""
        gen = self._generators.get(seq.id)
        if gen is None:
            gen = self._generators[seq.id] = torch.Generator(device=self.device.torch)
        gen.manual_seed(draw_seed(seq.sampling.seed, index))
        return gen

    def _sample(self, kind: str, seqs: list[SequenceRecord], logits: torch.Tensor,
                consumed: tuple[int, ...]) -> PendingBatch:
        """Sample and read back at once (prefill's first token)."""
        readback = self._sample_launch(seqs, logits, [s.generated for s in seqs])
        token_list, lp = self._sample_collect(readback)
        return self._pending(kind, seqs, range(len(seqs)), token_list, lp, consumed)

    def _sample_launch(self, seqs: Sequence[SequenceRecord], logits: torch.Tensor,
                       indices: Sequence[int]) -> _Readback:
        """Queue sampling (and logprobs) of every row, then one device->host copy of the results."""
        from ninfer.ops.sampling import greedy, logprobs, sample

        dev = logits.device
        sp = [s.sampling for s in seqs]
        if all(p.greedy for p in sp):
            tokens = greedy(logits)  # what sample() does for temperature 0, without its per-row setup
        else:
            # one host->device copy for every row's knobs (top_k is exact in fp32 below 2**24)
            knobs = _upload(torch.tensor([[p.temperature, p.top_p, p.min_p, min(p.top_k, 1 << 24)] for p in sp],
                                         dtype=torch.float32), dev)
            drawn = [p for p in sp if not p.greedy]
            narrow = all(0 < p.top_k <= _TOPK_PATH for p in drawn)  # filter top-k candidates, no vocabulary sort
            tokens = sample(logits, knobs[:, 0], knobs[:, 3].long(), knobs[:, 1], knobs[:, 2],
                            [None if p.greedy else self._generator(s, i)
                             for s, p, i in zip(seqs, sp, indices, strict=True)],
                            max_top_k=max(p.top_k for p in drawn) if narrow else None)
        want = tuple(i for i, p in enumerate(sp) if p.logprobs)
        top_n = max((sp[i].top_logprobs for i in want), default=0)
        if want:
            if len(want) == len(sp):
                chosen, top_ids, top_lp = logprobs(logits, tokens, top_n)
            else:
                idx = _upload(torch.tensor(want), dev)
                chosen, top_ids, top_lp = logprobs(logits[idx], tokens[idx], top_n)
            # One copy for the tokens and every logprob: fp64 holds the ids and the fp32 logprobs exactly.
            pack = torch.cat([tokens.double(), chosen.double(), top_ids.double().flatten(), top_lp.double().flatten()])
        else:
            pack = tokens
        event = None
        if dev.type == "cuda":
            host = torch.empty(pack.shape, dtype=pack.dtype, pin_memory=True)
            host.copy_(pack, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = pack
        return _Readback(tokens=tokens, host=host, event=event, want=want, top_n=top_n)

    @staticmethod
    def _sample_collect(rb: _Readback) -> tuple[list[int], dict[int, tuple[float, tuple[tuple[int, float], ...]]]]:
        """Wait for a readback: every row's token, and (chosen logprob, top list) of the rows that want them."""
        if rb.event is not None:
            rb.event.synchronize()
        flat = rb.host.tolist()
        B = rb.tokens.shape[0]
        if not rb.want:
            return flat, {}
        W, top_n = len(rb.want), rb.top_n
        chosen_l, ids_l, lps_l = flat[B:B + W], flat[B + W:B + W + W * top_n], flat[B + W + W * top_n:]
        lp = {}
        for j, i in enumerate(rb.want):
            a = j * top_n
            lp[i] = (chosen_l[j], (ids_l[a:a + top_n], lps_l[a:a + top_n]))
        return [int(t) for t in flat[:B]], lp

    def _pending(self, kind: str, seqs: Sequence[SequenceRecord], rows_at: Sequence[int], token_list: list[int],
                 lp: dict, consumed: tuple[int, ...]) -> PendingBatch:
        """The PendingBatch of ``seqs``, whose results are row ``rows_at[k]`` of the sampled unit."""
        rows = []
        for seq, i in zip(seqs, rows_at, strict=True):
            seq.pending = True
            if i in lp:
                chosen, (ids, lps) = lp[i]
                n = seq.sampling.top_logprobs
                top = tuple(zip([int(t) for t in ids[:n]], lps[:n], strict=True))
                rows.append(PendingRow(sequence_id=seq.id, tokens=(token_list[i],), logprobs=(chosen,),
                                       top_logprobs=(top,)))
            else:
                rows.append(PendingRow(sequence_id=seq.id, tokens=(token_list[i],)))
        return PendingBatch(kind=kind, rows=rows, native=_BatchNative(program_id=self.id, consumed=consumed))

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
        for seq, row, d in zip(seqs, batch.rows, decisions, strict=True):
            seq.pending = False
            if seq.launched and (d.accepted < row.produced or d.terminal):
                seq.void_ahead = True  # the chained row's input is not (or is the last) accepted token
            if d.accepted == 0:
                self._rollback(seq)
                continue
            seq.ledger.extend(row.tokens[:d.accepted])
            # The unit consumed inputs up to the last produced token; each accepted token but the last
            # is an input the state already holds. Fewer accepted than produced (terminal, several
            # tokens) leaves state past the accepted prefix: roll back physically.
            if d.accepted < row.produced:
                self._rollback(seq)
            self._settle_pages(seq)

    def abort_pending(self, batch: PendingBatch) -> None:
        """Drop the whole batch: ledgers stay at the pre-batch accepted frontier; state is rebuilt by Replay."""
        seqs = self._members(batch)
        batch.take(None)
        for seq in seqs:
            seq.pending = False
            seq.void_ahead = seq.launched > 0
            self._rollback(seq)

    def _rollback(self, seq: SequenceRecord) -> None:
        seq.computed = 0
        self._settle_pages(seq)

    # -- pause / resume ----------------------------------------------------------------------------
    def snapshot_bytes(self, sequence_id: int) -> int:
        seq = self._seq(sequence_id)
        return self.states.image_bytes + pages_for(seq.computed, self.page_size) * self.pool.nbytes_per_page

    def can_snapshot(self, sequence_id: int) -> bool:
        return self.host_bytes_used + self.snapshot_bytes(sequence_id) <= self.host_budget_bytes

    def snapshot_cost(self, sequence_id: int) -> SnapshotCost:
        return SnapshotCost(host_bytes=self.snapshot_bytes(sequence_id), replay_positions=self._seq(sequence_id).computed)

    def pause(self, sequence_id: int, mode: PauseMode) -> ReplayResume:
        """Release the sequence's device resources at its committed boundary; returns an owning ResumeState."""
        seq = self._seq(sequence_id)
        self._check_idle(seq)
        common = dict(program_id=self.id, ledger=tuple(seq.ledger), prompt_len=seq.prompt_len,
                      sampling=seq.sampling, frontier=seq.computed)
        if mode == "snapshot":
            if not self.can_snapshot(sequence_id):
                raise ProgramError(f"sequence {sequence_id}: snapshot needs {self.snapshot_bytes(sequence_id)} host "
                                   f"bytes, {self.host_budget_bytes - self.host_bytes_used} of the budget left")
            n = pages_for(seq.computed, self.page_size)
            kv = torch.empty(self.pool.host_shape(n), dtype=self.pool.dtype, pin_memory=self.device.is_cuda)
            self.pool.read_pages(seq.pages[:n], kv)
            state = SnapshotResume(**common, state_image=self.states.save(seq.slot), kv_pages=kv)
        elif mode == "replay":
            state = ReplayResume(**common)
        else:
            raise ValueError(f"pause mode must be 'snapshot' or 'replay', got {mode!r}")
        self.release(sequence_id)
        self.host_bytes_used += state.host_bytes
        self._paused[id(state)] = state
        return state

    def resume(self, resume_state: ReplayResume) -> int | None:
        """Re-bind a paused sequence; None (state kept) when a slot and the rebuild's pages do not fit now."""
        state = self._take_paused(resume_state, remove=False)
        positions = min(state.frontier + 1, len(state.ledger))
        need = pages_for(positions, self.page_size)
        if self.states.num_free == 0 or need > self.pool.allocator.num_free:
            return None
        del self._paused[id(state)]
        self.host_bytes_used -= state.host_bytes
        seq = SequenceRecord(id=next(self._ids), slot=self.states.allocate(), prompt_len=state.prompt_len,
                             ledger=list(state.ledger), sampling=state.sampling,
                             pages=self.pool.allocator.allocate(need))
        if isinstance(state, SnapshotResume):
            self.states.restore(seq.slot, state.state_image)
            self.pool.write_pages(seq.pages[:state.kv_pages.shape[2]], state.kv_pages)
            seq.computed = state.frontier
        return self._bind(seq)

    def discard(self, resume_state: ReplayResume) -> None:
        state = self._take_paused(resume_state, remove=True)
        self.host_bytes_used -= state.host_bytes

    def demote(self, resume_state: ReplayResume) -> ReplayResume:
        """Revoke a Snapshot: drop its host copies, keep the ledger and frontier (Replay rebuilds them exactly)."""
        state = self._take_paused(resume_state, remove=False)
        if not isinstance(state, SnapshotResume):
            raise ProgramError("ResumeState holds no Snapshot to revoke (it already resumes by Replay)")
        del self._paused[id(state)]
        self.host_bytes_used -= state.host_bytes
        replay = state.as_replay()
        self._paused[id(replay)] = replay
        return replay

    def _take_paused(self, resume_state: Any, *, remove: bool) -> ReplayResume:
        if not isinstance(resume_state, ReplayResume) or resume_state.program_id != self.id:
            raise ProgramError("ResumeState was not produced by this Program")
        if id(resume_state) not in self._paused:
            raise ProgramError("ResumeState was already resumed or discarded")
        if remove:
            del self._paused[id(resume_state)]
        return resume_state

    # -- accounting --------------------------------------------------------------------------------
    def usage(self) -> ResourceUsage:
        """Exact occupancy (the scratch slot and page used by graph capture are not counted)."""
        reserved = sum(max(0, len(s.pages) - pages_for(s.computed, self.page_size)) for s in self._seqs.values())
        return ResourceUsage(state_slots_total=self.states.num_slots - 1, state_slots_used=self.states.num_used - 1,
                             kv_pages_total=self.pool.num_pages - 1, kv_pages_used=self.pool.allocator.num_used - 1,
                             host_bytes_used=self.host_bytes_used, reserved_pages=reserved,
                             host_bytes_total=self.host_budget_bytes)

    # -- causal scoring ----------------------------------------------------------------------------
    def score_window(self, token_ids: Sequence[int], score_from: int = 1, *, chunk: int = 1024,
                     logits_rows: int = 256) -> torch.Tensor:
        """fp32 log p(token_ids[i] | token_ids[:i]) for i in score_from..n-1, as one fresh causal window.

        Runs outside the generation path on a temporary StateImage slot and Main KV pages, in
        prefill chunks of ``chunk`` positions; logits are formed ``logits_rows`` at a time, so the
        scoring staging ([logits_rows, vocab] fp32) exists only during this call.
        """
        n = len(token_ids)
        if not 1 <= score_from <= n:
            raise ValueError(f"score_from must be in 1..{n}, got {score_from}")
        if n > self.max_model_len:
            raise ValueError(f"scoring window of {n} tokens exceeds max_model_len {self.max_model_len}")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the model vocabulary 0..{self.vocab_size - 1}")
        need = pages_for(n, self.page_size)
        if self.states.num_free == 0 or need > self.pool.allocator.num_free:
            raise ProgramError(f"scoring window of {n} tokens needs a free StateImage slot and {need} KV pages "
                               f"({self.states.num_free} slots, {self.pool.allocator.num_free} pages free)")
        slot = self.states.allocate()
        pages = self.pool.allocator.allocate(need)
        dev = self.device.torch
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=dev)
        out = torch.empty(n - score_from, dtype=torch.float32, device=dev)
        try:
            with torch.inference_mode(), self._launches():
                for start in range(0, n, chunk):
                    end = min(start + chunk, n)
                    batch = build_forward_batch([RowInput(tokens=list(token_ids[start:end]), start=start, slot=slot,
                                                          pages=pages, want_logits=False)], self.page_size, dev)
                    hidden = self.model.forward(batch, self.views)
                    # position p predicts token p + 1
                    lo, hi = max(start, score_from - 1), min(end, n - 1)
                    for p in range(lo, hi, logits_rows):
                        q = min(p + logits_rows, hi)
                        lp = self.model.logits(hidden[p - start:q - start]).float().log_softmax(-1)
                        out[p + 1 - score_from:q + 1 - score_from] = lp.gather(1, ids[p + 1:q + 1, None])[:, 0]
        finally:
            self.pool.allocator.free(pages)
            self.states.free(slot)
        return out

    # -- CUDA graphs -------------------------------------------------------------------------------
    def _decode_graphs(self):
        from ninfer_qwen35.program.cuda_graphs import DecodeGraphs

        return DecodeGraphs(self._decode_logits, max_batch=self.max_concurrency,
                            max_pages=pages_for(self.max_model_len, self.page_size), page_size=self.page_size,
                            scratch_slot=self._scratch_slot, scratch_page=self._scratch_page,
                            device=self.device.torch)

    def _capture_graphs(self) -> None:
        graphs = self._decode_graphs()
        try:
            with torch.inference_mode(), self._launches():  # replays launch as captured
                graphs.capture()
        except Exception as exc:  # an op without a capturable path (e.g. a host sync): stay eager, say why
            self.graph_error = f"{type(exc).__name__}: {exc}"
            log.warning("decode CUDA graphs not captured, decoding eagerly: %s", self.graph_error)
            try:
                torch.cuda.synchronize(self.device.torch)
            except RuntimeError as sync_exc:
                raise RuntimeError(f"CUDA graph capture failed ({self.graph_error}) and left the device "
                                   f"unusable: {sync_exc}") from exc
            return
        self.graphs = graphs
