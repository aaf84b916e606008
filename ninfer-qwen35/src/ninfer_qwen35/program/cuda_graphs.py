"""Decode through CUDA graphs captured once per exact B (1..max_batch).

Token ids, positions, state slots, page ids and sequence lengths are inputs: they live in static
device buffers that each step overwrites before replay, so one graph per B serves every
membership. Warmup and capture point every row at a scratch StateImage slot and a scratch KV
page that no sequence owns, so neither touches real state. Kernels get ``max_seq_len`` fixed at the
Program's longest sequence (grids from host ints, no host sync inside the graph). Sampling runs
eagerly after replay, with each row's own generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ninfer_qwen35.execution.forward_batch import ForwardBatch


class DecodeGraphs:
    """Static input buffers plus one captured graph (and its logits output) per batch size."""

    def __init__(self, run: Callable[[ForwardBatch], torch.Tensor], *, max_batch: int, max_pages: int,
                 page_size: int, scratch_slot: int, scratch_page: int, device: torch.device) -> None:
        self._run = run
        self.max_batch = max_batch
        self.max_pages = max_pages
        self.page_size = page_size
        self.scratch_slot = scratch_slot
        self.scratch_page = scratch_page
        self.device = device
        B = max_batch
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=device)
        self.positions = torch.zeros(B, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=device)
        self.state_slots = torch.full((B,), scratch_slot, dtype=torch.int64, device=device)
        self.has_initial_state = torch.ones(B, dtype=torch.bool, device=device)
        self.block_tables = torch.full((B, max_pages), scratch_page, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((B,), scratch_page * page_size, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(B, dtype=torch.int64, device=device)
        # One host staging row per buffer, written then copied up in one transfer per step.
        self._host = torch.zeros((B, 5), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_tables = torch.full((B, max_pages), scratch_page, dtype=torch.int32,
                                       pin_memory=device.type == "cuda")
        self._upload = torch.empty(B * max_pages, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._row_key: list[object] = [None] * B
        self._row_len = [0] * B
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def batch(self, B: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:B], positions=self.positions[:B], query_start_loc=self.query_start_loc[:B + 1],
            seq_lens=self.seq_lens[:B], state_slots=self.state_slots[:B],
            has_initial_state=self.has_initial_state[:B], block_tables=self.block_tables[:B],
            slot_mapping=self.slot_mapping[:B], logits_indices=self.logits_indices[:B], max_query_len=1,
            max_seq_len=self.max_pages * self.page_size, all_initial_state=True)

    def _point_at_scratch(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.seq_lens.fill_(1)
        self.state_slots.fill_(self.scratch_slot)
        self.block_tables.fill_(self.scratch_page)
        self.slot_mapping.fill_(self.scratch_page * self.page_size)

    def capture(self) -> None:
        """Warm every B on a side stream, then capture largest B first into one shared memory pool."""
        self._point_at_scratch()
        sizes = range(self.max_batch, 0, -1)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for B in sizes:
                for _ in range(2):
                    self._run(self.batch(B))
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for B in sizes:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._run(self.batch(B))
            self.graphs[B] = (graph, out)
        torch.cuda.synchronize(self.device)

    def load(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]], keys: Sequence[object]) -> None:
        """Write B = len(tokens) decode rows into the static input buffers.

        ``keys`` identify each row's page list (sequence id and truncation epoch): a row whose key is
        unchanged since the last step only had pages appended, so only the new entries are written.
        """
        B = len(tokens)
        ps = self.page_size
        # [max_batch, 5]: token, position, seq_len, slot, flat KV index, built in Python and written in
        # one op: small host tensor ops cost more than the arithmetic (host time per step matters).
        self._host[:B] = torch.tensor([(t, p, p + 1, s, pages[p // ps] * ps + p % ps) for t, p, s, pages in
                                       zip(tokens, positions, slots, tables, strict=True)], dtype=torch.int64)
        h = self._host
        ht = self._host_tables  # entries past a row's pages hold stale but valid page ids, never read
        for i, (pages, key) in enumerate(zip(tables, keys, strict=True)):
            start = self._row_len[i] if self._row_key[i] == key and len(pages) >= self._row_len[i] else 0
            if len(pages) > start:
                ht[i, start:len(pages)] = torch.tensor(pages[start:], dtype=torch.int32)
            self._row_key[i], self._row_len[i] = key, len(pages)
        # The previous step's copies from these pinned buffers have finished: its tokens were read on the host.
        dev = h[:B].to(self.device, non_blocking=True)
        self.input_ids[:B].copy_(dev[:, 0])
        self.positions[:B].copy_(dev[:, 1])
        self.seq_lens[:B].copy_(dev[:, 2].to(torch.int32))
        self.state_slots[:B].copy_(dev[:, 3])
        self.slot_mapping[:B].copy_(dev[:, 4])
        # Upload only the columns in use (a long max_model_len makes the full table large); the
        # device entries past them keep stale but valid page ids that no kernel reads.
        w = max(len(pages) for pages in tables)
        staged = self._upload[:B * w].view(B, w)
        staged.copy_(ht[:B, :w])
        self.block_tables[:B, :w].copy_(staged, non_blocking=True)

    def replay(self, B: int) -> torch.Tensor:
        """Run the graph for B loaded rows; returns its logits buffer [B, V] (valid until the next replay).

        Without a captured graph for B (CPU, or before capture) the same call runs eagerly over the
        static buffers, so the input path can be checked anywhere.
        """
        if B not in self.graphs:
            return self._run(self.batch(B))
        graph, out = self.graphs[B]
        graph.replay()
        return out
