"""A speculative decode unit through CUDA graphs captured per exact B: the design's two-stage graph.

Stage ``forward``: the target over the verify batch (B rows of R positions) and its logits. Between the
stages, on the host's schedule: the grammar masks and the acceptance (which draws from each row's own
generators). Stage ``finish``: the accepted state's commit and the drafter (its first pass over the R positions,
then the chained steps at positions that depend on the acceptance, computed on the device). Token ids,
positions, slots, KV slots, page tables, the verified tokens and the accepted counts are inputs in static
buffers that each unit overwrites before replay; capture and warmup point every row at a scratch slot and a
scratch page no sequence owns. Without a captured graph (CPU) the same calls run eagerly over the static
buffers, so the input path is checked anywhere. A unit whose rows are all greedy and unconstrained (nothing to
do on the host between the stages) replays a third graph instead: forward, greedy acceptance and finish in one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ninfer.core.cuda_graphs import try_capture, warm_on_side_stream
from ninfer.core.forward_batch import ForwardBatch

Forward = Callable[[ForwardBatch], tuple[torch.Tensor, torch.Tensor]]           # batch -> (hidden, logits)
Finish = Callable[[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # -> drafts [B, k]
Whole = Callable[[ForwardBatch], tuple[torch.Tensor, ...]]  # -> (hidden, logits, tokens, accepted, drafts)


class VerifyGraphs:
    """Static inputs and the two captured graphs per B (1..max_batch) of a Program's verify unit."""

    def __init__(self, forward: Forward, finish: Finish, whole: Whole, *, max_batch: int, rows: int, max_pages: int,
                 page_size: int, scratch_slot: int, scratch_page: int, device: torch.device) -> None:
        self._forward, self._finish, self._whole = forward, finish, whole
        self.max_batch, self.rows, self.max_pages, self.page_size = max_batch, rows, max_pages, page_size
        self.scratch_slot, self.scratch_page, self.device = scratch_slot, scratch_page, device
        B, N = max_batch, max_batch * rows
        pin = device.type == "cuda"
        # int64 inputs: token ids, positions, KV slots [N] each, then state slots [B]; int32: seq_lens [B], tables.
        self._h64 = torch.zeros(3 * N + B, dtype=torch.int64, pin_memory=pin)
        self._h32 = torch.zeros(B + B * max_pages, dtype=torch.int32, pin_memory=pin)
        self._d64 = torch.zeros_like(self._h64, device=device)
        self._d32 = torch.zeros_like(self._h32, device=device)
        self._n64, self._n32 = self._h64.numpy(), self._h32.numpy()
        self.input_ids, self.positions, self.slot_mapping = self._d64[:3 * N].view(3, N).unbind(0)
        self.state_slots = self._d64[3 * N:]
        self.seq_lens, self.block_tables = self._d32[:B], self._d32[B:].view(B, max_pages)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device) * rows
        self.has_initial_state = torch.ones(B, dtype=torch.bool, device=device)
        self.logits_indices = torch.arange(N, dtype=torch.int64, device=device)
        self.tokens = torch.zeros((B, rows), dtype=torch.int64, device=device)   # the verified tokens
        self.accepted = torch.zeros(B, dtype=torch.int64, device=device)
        self._staged: torch.cuda.Event | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor],
                                     torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.greedy_graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._point_at_scratch()

    def batch(self, B: int) -> ForwardBatch:
        N = B * self.rows
        return ForwardBatch(
            input_ids=self.input_ids[:N], positions=self.positions[:N], query_start_loc=self.query_start_loc[:B + 1],
            seq_lens=self.seq_lens[:B], state_slots=self.state_slots[:B], has_initial_state=self.has_initial_state[:B],
            block_tables=self.block_tables[:B], slot_mapping=self.slot_mapping[:N],
            logits_indices=self.logits_indices[:N], max_query_len=self.rows,
            max_seq_len=self.max_pages * self.page_size, all_initial_state=True, static=True)

    def _point_at_scratch(self) -> None:
        B, N, R = self.max_batch, self.max_batch * self.rows, self.rows
        self._n64[:N] = 0
        self._n64[N:2 * N] = np.tile(np.arange(R), B)
        self._n64[2 * N:3 * N] = self.scratch_page * self.page_size + np.tile(np.arange(R), B) % self.page_size
        self._n64[3 * N:] = self.scratch_slot
        self._n32[:B] = R
        self._n32[B:] = self.scratch_page
        self._d64.copy_(self._h64)
        self._d32.copy_(self._h32)
        self.tokens.zero_()
        self.accepted.zero_()

    def load(self, tokens: Sequence[Sequence[int]], starts: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]]) -> None:
        """Write B = len(tokens) rows of R tokens at positions starts[b].. (two host->device copies). Table entries
        past a row's pages, and the KV slots of positions there, point at the scratch page."""
        if self._staged is not None:
            self._staged.synchronize()  # the previous unit's copies out of the staging buffers have run
        B, R, ps, P = len(tokens), self.rows, self.page_size, self.max_pages
        N = self.max_batch * R
        n64, n32 = self._n64, self._n32
        pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(R)[None, :]          # [B, R]
        table = np.full((B, P), self.scratch_page, dtype=np.int32)
        for b, pages in enumerate(tables):
            n = min(len(pages), P)
            table[b, :n] = pages[:n]
        n64[:B * R] = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n64[N:N + B * R] = pos.reshape(-1)
        n64[2 * N:2 * N + B * R] = (np.take_along_axis(table, pos // ps, 1) * ps + pos % ps).reshape(-1)
        n64[3 * N:3 * N + B] = slots
        n32[:B] = pos[:, -1] + 1
        n32[self.max_batch:self.max_batch + B * P] = table.reshape(-1)
        self._d64.copy_(self._h64, non_blocking=True)
        self._d32[:self.max_batch + B * P].copy_(self._h32[:self.max_batch + B * P], non_blocking=True)
        if self._d64.is_cuda:
            self._staged = torch.cuda.Event()
            self._staged.record()

    def forward(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [B*R, H], logits [B*R, V]) of the loaded rows (valid until the next replay)."""
        if B not in self.graphs:
            return self._forward(self.batch(B))
        graph, out, _, _ = self.graphs[B]
        graph.replay()
        return out

    def finish(self, B: int, hidden: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """The next drafts [B, k] after the acceptance ``tokens`` [B, R] / ``accepted`` [B] of the loaded rows."""
        self.tokens[:B].copy_(tokens)
        self.accepted[:B].copy_(accepted)
        if B not in self.graphs:
            return self._finish(self.batch(B), hidden, self.tokens[:B], self.accepted[:B])
        _, _, graph, out = self.graphs[B]
        graph.replay()
        return out

    def greedy_unit(self, B: int) -> tuple[torch.Tensor, ...]:
        """(hidden, logits, tokens, accepted, drafts) of the loaded rows, all greedy and unconstrained."""
        if B not in self.greedy_graphs:
            return self._whole(self.batch(B))
        graph, out = self.greedy_graphs[B]
        graph.replay()
        return out

    def capture(self) -> None:
        """Warm every B on a side stream, then capture both stages, largest B first, into one memory pool."""
        self._point_at_scratch()
        sizes = range(self.max_batch, 0, -1)

        def warm() -> None:
            for B in sizes:
                hidden, _ = self._forward(self.batch(B))
                self._finish(self.batch(B), hidden, self.tokens[:B], self.accepted[:B])
                self._whole(self.batch(B))

        warm_on_side_stream(self.device, warm)
        pool = torch.cuda.graph_pool_handle()
        for B in sizes:
            fwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(fwd, pool=pool):
                out = self._forward(self.batch(B))
            fin = torch.cuda.CUDAGraph()
            with torch.cuda.graph(fin, pool=pool):
                drafts = self._finish(self.batch(B), out[0], self.tokens[:B], self.accepted[:B])
            self.graphs[B] = (fwd, out, fin, drafts)
            whole = torch.cuda.CUDAGraph()
            with torch.cuda.graph(whole, pool=pool):
                self.greedy_graphs[B] = (whole, self._whole(self.batch(B)))
        torch.cuda.synchronize(self.device)

    def try_capture(self, launches: contextlib.AbstractContextManager) -> str | None:
        """``capture`` in the Program's launch scope; None when done, else why not (the unit then runs eagerly)."""
        error = try_capture(self.capture, launches, self.device, "verify CUDA graphs")
        if error is not None:
            self.graphs.clear()
            self.greedy_graphs.clear()
        return error
