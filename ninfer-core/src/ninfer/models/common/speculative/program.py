"""SpeculativeProgram: a PagedProgram whose decode unit verifies k drafts per row and drafts the next k.

One verify-and-commit core for every drafter (MTP now; DFlash later). A decode unit of B rows runs, with no
host sync until its one readback:

1. the target over R = k + 1 positions per row, ``[last accepted token, d1..dk]``, keeping the recurrent state
   after every position (``verify_forward``) and writing attention KV for all of them;
2. acceptance (``ops.speculative``: greedy prefix + argmax, or lossless rejection sampling with the row's
   counter-based draws; grammar masks on all R rows first): m drafts accepted, then the correction / bonus;
3. ``verify_commit``: the state after position m becomes the slot's state (rejected positions cost nothing);
4. the drafter's first pass over the same R positions (next-token ids = the verified tokens) and k - 1
   chained steps from position start + m, giving the next unit's drafts.

The row's PendingRow carries the m + 1 tokens (``drafted`` = k); ``collect`` moves the frontier by m + 1. The
drafts travel to the host with the tokens and live in the SequenceRecord: the next unit's inputs (and its
grammar mask rows) are built from them, a Snapshot keeps them, Replay makes them again (the last prefill chunk
of a rebuild drafts from its last position, as the end of a prompt does). A row with no drafts (after a
context-cache restore of the whole prompt) verifies its last token repeated: any draft is a valid proposal,
and acceptance keeps the output exactly that of plain decoding. Decode units do not chain (``decode_span`` >
1: the next unit's positions depend on this one's acceptance).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import attrs
import torch

from ninfer.contract.batch import LaunchedUnit, PendingBatch
from ninfer.contract.config import MAX_DRAFT_TOKENS
from ninfer.contract.constraint import TokenMasks
from ninfer.core.forward_batch import ForwardBatch
from ninfer.core.kv_pool import pages_for
from ninfer.core.readback import Readback
from ninfer.models.common.context.errors import ProgramError
from ninfer.models.common.context.sequence import SequenceRecord
from ninfer.models.common.paged_program import PagedProgram, _BatchNative
from ninfer.models.common.sampler import launch_readback, pending_row
from ninfer.models.common.speculative.batches import block_table, chained_batch, verify_batch
from ninfer.models.common.speculative.graphs import VerifyGraphs


@attrs.define(kw_only=True, eq=False)
class _VerifyLaunch:
    program_id: int
    seqs: tuple[SequenceRecord, ...]
    readback: Readback  # tokens [B*R], accepted [B], next drafts [B*k], packed
    rows: int           # R


class SpeculativeProgram(PagedProgram):
    """``PagedProgram`` with speculative decode units; a subclass supplies the three model calls below."""

    def __init__(self, *, draft_tokens: int, **kwargs) -> None:
        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {draft_tokens}")
        self.draft_tokens = draft_tokens
        super().__init__(**kwargs)
        # Verify k + 1 positions, then k - 1 chained draft positions past the accepted ones.
        self.decode_span = 2 * draft_tokens
        self.sampler.mask_rows = self.max_concurrency * (draft_tokens + 1)

    # -- the model calls ----------------------------------------------------------------------------
    @abc.abstractmethod
    def verify_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden rows [B*R, H] of a verify batch; recurrent state after each position is kept aside (the
        slot itself unchanged) until ``verify_commit``."""

    @abc.abstractmethod
    def verify_commit(self, batch: ForwardBatch, steps: torch.Tensor) -> None:
        """Make the kept state after position ``steps[b]`` of row b (device [B]) its slot's state."""

    @abc.abstractmethod
    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's hidden rows [N, H] (fed to ``logits``) at ``batch.positions``, given the next tokens
        ``batch.input_ids`` and the target's (or, chained, the drafter's own) hidden rows there."""

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, V] of the drafter's rows (``draft_forward``'s); the target's ``logits`` unless the drafter
        has a head of its own (Qwen4Exp's MTP mixes its residual with its own mixer first)."""
        return self.logits(hidden)

    def start_graphs(self, *, cuda_graphs: bool = True, static_decode: bool = False) -> None:
        """Call once the views exist: capture the verify unit's two graphs per B on CUDA (eager, with the reason in
        ``graph_error``, when capture fails); ``static_decode``: without graphs, still run through their static
        input buffers (checks that path on CPU)."""
        if not (cuda_graphs and self.device.is_cuda) and not static_decode:
            return
        graphs = VerifyGraphs(self._verify_stage, self._finish_stage, self._greedy_unit, max_batch=self.max_concurrency,
                              rows=self.draft_tokens + 1,
                              max_pages=pages_for(self.max_model_len + self.decode_span, self.page_size),
                              page_size=self.page_size, scratch_slot=self._scratch_slot,
                              scratch_page=self._scratch_page, device=self.device.torch)
        if cuda_graphs and self.device.is_cuda:
            self.graph_error = graphs.try_capture(self._launches())
            if self.graph_error is not None:
                return
        self.graphs = graphs

    def _verify_stage(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphed first stage: the target's hidden rows and logits over the verify batch."""
        hidden = self.verify_forward(batch)
        return hidden, self.logits(hidden)

    def _greedy_unit(self, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """Both stages and the greedy acceptance between them, for units with nothing to do on the host there."""
        from ninfer.ops.speculative import verify_greedy

        B, R = batch.num_seqs, batch.max_query_len
        hidden, logits = self._verify_stage(batch)
        tokens, accepted = verify_greedy(logits.view(B, R, -1), batch.input_ids.view(B, R)[:, 1:])
        return hidden, logits, tokens, accepted, self._finish_stage(batch, hidden, tokens, accepted)

    def _finish_stage(self, batch: ForwardBatch, hidden: torch.Tensor, tokens: torch.Tensor,
                      accepted: torch.Tensor) -> torch.Tensor:
        """The graphed second stage: commit the accepted state, then draft (first pass + chained steps)."""
        B, R = tokens.shape
        self.verify_commit(batch, accepted)
        drafted = self.draft_forward(attrs.evolve(batch, input_ids=tokens.clamp_min(0).flatten()), hidden)
        last = drafted.view(B, R, -1)[torch.arange(B, device=accepted.device), accepted]
        base = batch.positions.view(B, R)[:, 0] + accepted
        return self._chain(last, base, batch.block_tables, batch.state_slots)

    # -- prefill: the drafter's pass over the chunk, and drafts when the input is done ----------------
    def _prefilled(self, seq: SequenceRecord, batch: ForwardBatch, hidden: torch.Tensor, start: int,
                   sampled: torch.Tensor | None) -> None:
        n = hidden.shape[0]
        end = start + n
        known = seq.ledger[start + 1:end + 1]  # each position's next token, where the ledger has it
        ids = torch.tensor(known, dtype=torch.int64).to(self.device.torch)
        if len(known) < n:  # the prompt's last position: its next token is the one just sampled
            if sampled is None:
                raise ProgramError(f"sequence {seq.id}: prefill up to {end} without the next token")
            ids = torch.cat([ids, sampled.view(1)])
        drafted = self.draft_forward(attrs.evolve(batch, input_ids=ids), hidden)
        if end != seq.target:
            return
        table = block_table([seq.pages], end - 1 + self.draft_tokens, page_size=self.page_size,
                            scratch_page=self._scratch_page).to(self.device.torch)
        base = torch.full((1,), end - 1, dtype=torch.int64, device=self.device.torch)
        drafts = self._chain(drafted[-1:], base, table, batch.state_slots[:1])
        seq.drafts = tuple(drafts[0].tolist())

    # -- decode: verify, commit the accepted state, draft --------------------------------------------
    def launch_decode(self, sequence_ids: Sequence[int], *, after: LaunchedUnit | None = None,
                      masks: TokenMasks | None = None) -> LaunchedUnit:
        if after is not None:
            raise ProgramError("a speculative Program does not chain decode units (decode_span > 1)")
        # Holds the span below max_model_len (past it the scratch page stands in: those positions only make
        # tokens no request can keep); refuses rather than let rows' positions share the scratch page.
        ids, seqs, _ = self._decode_rows(sequence_ids, None)
        k, span = self.draft_tokens, self.decode_span
        drafts = [self._drafts_of(s) for s in seqs]
        B, R = len(seqs), k + 1
        rows = [[s.ledger[s.computed], *d] for s, d in zip(seqs, drafts, strict=True)]
        starts, slots, tables = [s.computed for s in seqs], [s.slot for s in seqs], [s.pages for s in seqs]
        with self._unit(seqs), torch.inference_mode():
            graphs = self.graphs
            if graphs is not None:
                graphs.load(rows, starts, slots, tables)
                batch = graphs.batch(B)
            else:
                batch = verify_batch(rows, starts, slots, tables, span=span, page_size=self.page_size,
                                     scratch_page=self._scratch_page, device=self.device.torch)
            constrained = masks is not None and any(masks.constrained(i) for i in ids)
            adjusted = any(s.sampling.adjusted for s in seqs)
            indices = [s.computed + 1 - s.prompt_len for s in seqs]
            if not constrained and not adjusted and all(s.sampling.greedy for s in seqs):  # no host between stages
                hidden, logits, tokens, accepted, nxt = (graphs.greedy_unit(B) if graphs is not None
                                                         else self._greedy_unit(batch))
                raw = logits
            else:
                hidden, logits = graphs.forward(B) if graphs is not None else self._verify_stage(batch)
                if constrained:
                    self.sampler.mask_verify(seqs, drafts, logits, masks)
                raw = self.sampler.adjust_verify(seqs, drafts, logits, indices) if adjusted else logits
                tokens, accepted = self.sampler.verify(seqs, logits.view(B, R, -1),
                                                       batch.input_ids.view(B, R)[:, 1:], indices)
                if graphs is not None:
                    nxt = graphs.finish(B, hidden, tokens, accepted)
                else:
                    nxt = self._finish_stage(batch, hidden, tokens, accepted)
            readback = self._readback(seqs, raw, tokens, accepted, nxt)
            for seq in seqs:
                seq.launched += 1
        native = _VerifyLaunch(program_id=self.id, seqs=tuple(seqs), readback=readback, rows=R)
        return LaunchedUnit(kind="verify", sequence_ids=ids, native=native)

    def _drafts_of(self, seq: SequenceRecord) -> tuple[int, ...]:
        """The row's drafts; none yet (its prompt restored whole from the cache): its last token repeated."""
        k = self.draft_tokens
        return seq.drafts if len(seq.drafts) == k else (seq.ledger[seq.computed],) * k

    def _chain(self, last: torch.Tensor, base: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor
               ) -> torch.Tensor:
        """Drafts [B, k]: the argmax of the drafter's rows ``last`` [B, H] (made at positions ``base``), then k - 1
        chained steps, each fed its previous draft and its own hidden row."""
        from ninfer.ops.sampling import greedy

        d = greedy(self.draft_logits(last))
        out = [d]
        for step in range(1, self.draft_tokens):
            last = self.draft_forward(chained_batch(base, step, d, tables, slots, self.page_size), last)
            d = greedy(self.draft_logits(last))
            out.append(d)
        return torch.stack(out, dim=1)

    def _readback(self, seqs: Sequence[SequenceRecord], logits: torch.Tensor, tokens: torch.Tensor,
                  accepted: torch.Tensor, drafts: torch.Tensor) -> Readback:
        """One copy: tokens [B*R], accepted [B], drafts [B*k], and the logprobs of every position of the rows
        that want them (flat rows b*R + t)."""
        B, R = tokens.shape
        pack = torch.cat([tokens.flatten(), accepted, drafts.flatten()])
        want = tuple(b * R + t for b, s in enumerate(seqs) if s.sampling.logprobs for t in range(R))
        top_n = max((s.sampling.top_logprobs for s in seqs if s.sampling.logprobs), default=0)
        return launch_readback(pack, logits, tokens.flatten().clamp_min(0), want, top_n, copies=self.sampler.copies)

    def collect(self, unit: LaunchedUnit) -> PendingBatch:
        native = unit.native
        if not isinstance(native, _VerifyLaunch) or native.program_id != self.id:
            raise ProgramError("LaunchedUnit was not produced by this Program")
        if unit.collected:
            raise ProgramError("LaunchedUnit collected twice")
        unit.collected = True
        flat, lps = native.readback.wait()
        B, R, k = len(native.seqs), native.rows, self.draft_tokens
        tokens, accepted, drafts = flat[:B * R], flat[B * R:B * R + B], flat[B * R + B:]
        rows, consumed = [], []
        for b, seq in enumerate(native.seqs):
            if self._seqs.get(seq.id) is not seq:  # released while its row was in flight
                continue
            seq.launched -= 1
            n = int(accepted[b]) + 1
            seq.computed += n
            seq.drafts = tuple(int(t) for t in drafts[b * k:(b + 1) * k])
            seq.pending = True
            out = tuple(int(t) for t in tokens[b * R:b * R + n])
            per = [lps[b * R + t] for t in range(n)] if seq.sampling.logprobs else None
            rows.append(pending_row(seq, out, per, drafted=k))
            consumed.append(n)
        return PendingBatch(kind="verify", rows=rows, native=_BatchNative(program_id=self.id, consumed=tuple(consumed)))
