"""Decode through CUDA graphs captured once per exact B (1..max_batch).

Token ids, positions, state slots, page ids and sequence lengths are inputs: they live in static
device buffers that each step overwrites before replay, so one graph per B serves every
membership. Warmup and capture point every row at a scratch StateImage slot and a scratch KV
page that no sequence owns, so neither touches real state. Kernels get ``max_seq_len`` fixed at the
Program's longest sequence (grids from host ints, no host sync inside the graph). Sampling runs
eagerly after replay, with each row's own generator. A chained step (``PipelinedDecode``) takes its
token ids from the previous step's device-resident samples instead of the host.

``run`` is the Program's graphed part of a step (forward and logits of every row over a
ForwardBatch); the module knows nothing else about the model.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ninfer.core.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

# A step's table upload is folded into the one packed copy while the span up to the last changed
# entry stays below this (a DMA of it costs about one extra launch); longer spans copy each changed
# row segment on its own (a long max_model_len makes full table rows large).
ONE_COPY_BYTES = 64 << 10
_ALIGN = 64  # bytes; kernels (Triton specializes on 16-byte pointer alignment) see aligned inputs


class DecodeGraphs:
    """Static input buffers plus one captured graph (and its logits output) per batch size.

    Every per-step input lives in one device buffer, mirrored by one host staging buffer (pinned
    on CUDA) with the same byte layout, so staging a step is one host->device copy:
    [input_ids | positions | state_slots | slot_mapping] int64 [max_batch] each, seq_lens int32
    [max_batch], then block_tables int32 [max_batch, max_pages], each starting on a 64-byte
    boundary. The input tensors the graphs read are typed views into the device buffer; the host
    side is written through numpy views (far cheaper per step than small torch ops).
    """

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
        col = -(-8 * B // _ALIGN) * _ALIGN  # each input starts aligned, as separate allocations would
        self._seq_lens_at = 4 * col
        self._tables_at = self._seq_lens_at + -(-4 * B // _ALIGN) * _ALIGN
        size = self._tables_at + 4 * B * max_pages
        self._packed = torch.zeros(size, dtype=torch.uint8, device=device)
        self._staging = torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        cols = self._packed[:4 * col].view(torch.int64).view(4, col // 8)[:, :B]
        self.input_ids, self.positions, self.state_slots, self.slot_mapping = cols.unbind(0)
        self.seq_lens = self._packed[self._seq_lens_at:self._seq_lens_at + 4 * B].view(torch.int32)
        self.block_tables = self._packed[self._tables_at:].view(torch.int32).view(B, max_pages)
        staging = self._staging.numpy()
        self._h_cols = staging[:4 * col].view(np.int64).reshape(4, col // 8)[:, :B]
        self._h_seq_lens = staging[self._seq_lens_at:self._seq_lens_at + 4 * B].view(np.int32)
        self._h_tables = staging[self._tables_at:].view(np.int32).reshape(B, max_pages)
        # The usual step's copy (no table change), sliced once: slicing costs about as much as the copy call.
        self._rows_dev, self._rows_host = self._packed[:self._tables_at], self._staging[:self._tables_at]
        # Inputs no decode step changes.
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(B, dtype=torch.bool, device=device)
        self.logits_indices = torch.arange(B, dtype=torch.int64, device=device)
        # Per row: the page list (key) and length whose entries the device table already holds.
        self._row_key: list[object] = [None] * B
        self._row_len = [0] * B
        self._staged: torch.cuda.Event | None = None  # recorded after the last copy out of the staging buffer
        # A step's upload runs on its own stream once the previous step's forward has read the inputs, so it
        # overlaps that step's sampling and readback instead of queueing behind them on the compute stream.
        cuda = device.type == "cuda"
        self._uploads = torch.cuda.Stream(device) if cuda else None
        self._replayed = torch.cuda.Event() if cuda else None  # recorded after each step's forward
        self._point_at_scratch()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def batch(self, B: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:B], positions=self.positions[:B], query_start_loc=self.query_start_loc[:B + 1],
            seq_lens=self.seq_lens[:B], state_slots=self.state_slots[:B],
            has_initial_state=self.has_initial_state[:B], block_tables=self.block_tables[:B],
            slot_mapping=self.slot_mapping[:B], logits_indices=self.logits_indices[:B], max_query_len=1,
            max_seq_len=self.max_pages * self.page_size, all_initial_state=True, static=True)

    def _point_at_scratch(self) -> None:
        """Every row at the scratch slot and page (warmup, capture): host staging and device alike."""
        B = self.max_batch
        self._h_cols[0] = 0
        self._h_cols[1] = 0
        self._h_cols[2] = self.scratch_slot
        self._h_cols[3] = self.scratch_page * self.page_size
        self._h_seq_lens[:] = 1
        self._h_tables[:] = self.scratch_page
        self._packed.copy_(self._staging)
        self._row_key = [None] * B
        self._row_len = [0] * B

    def capture(self) -> None:
        """Warm every B on a side stream, then capture largest B first into one shared memory pool."""
        self._point_at_scratch()
        sizes = range(self.max_batch, 0, -1)
        warm_on_side_stream(self.device, lambda: [self._run(self.batch(B)) for B in sizes])
        pool = torch.cuda.graph_pool_handle()
        for B in sizes:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._run(self.batch(B))
            self.graphs[B] = (graph, out)
        torch.cuda.synchronize(self.device)

    def try_capture(self, launches: contextlib.AbstractContextManager) -> str | None:
        """``capture`` inside ``launches`` (the Program's launch scope: replays launch as captured).

        Returns None when every B was captured, else why not (an op without a capturable path, e.g. a
        host sync): the caller then decodes eagerly. Raises when the failed capture left the device unusable.
        """
        return try_capture(self.capture, launches, self.device, "decode CUDA graphs")

    def load(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]], keys: Sequence[object], *,
             device_tokens: torch.Tensor | None = None, rope_positions: Sequence[int] | None = None) -> None:
        """Write B = len(tokens) decode rows into the static input buffers (one host->device copy).

        ``keys`` identify each row's page list (sequence id and truncation epoch): a row whose key is
        unchanged since the last step only had pages appended, so only the new entries are written.
        ``device_tokens`` [B], when given, replace ``tokens`` (a chained step's inputs, still on the device).
        ``rope_positions``: the rows' rotary positions when they differ from ``positions`` (the KV positions), as
        a prompt with media shifts them; the graphs read them from the same buffer.
        """
        B = len(tokens)
        if self._staged is not None:
            # The staging buffer is rewritten below: the previous step's copies out of it must have run.
            # (Usually long done; with chained steps the host may be one step ahead of the device.)
            self._staged.synchronize()
        ps = self.page_size
        h = self._h_cols  # rows: token, position, slot, flat KV index of the position
        h[:, :B] = (tokens, positions, slots,
                    [pages[p // ps] * ps + p % ps for p, pages in zip(positions, tables, strict=True)])
        np.add(h[1, :B], 1, out=self._h_seq_lens[:B], casting="unsafe")
        if rope_positions is not None:
            h[1, :B] = rope_positions
        ht = self._h_tables  # entries past a row's pages hold stale but valid page ids, never read
        row_key, row_len, width = self._row_key, self._row_len, self.max_pages
        spans = []  # changed table entries, as flat int32 index ranges
        for i, (pages, key) in enumerate(zip(tables, keys, strict=True)):
            n = len(pages)
            start = row_len[i] if row_key[i] == key and n >= row_len[i] else 0
            if n > start:
                ht[i, start:n] = pages[start:]
                spans.append((i * width + start, i * width + n))
        end = self._tables_at + 4 * spans[-1][1] if spans else 0
        if self._uploads is None:
            self._upload(spans, end)
        else:
            compute = torch.cuda.current_stream(self.device)
            self._uploads.wait_event(self._replayed)  # the inputs the last forward read (no-op before the first)
            with torch.cuda.stream(self._uploads):
                self._upload(spans, end)
                self._staged = torch.cuda.Event()
                self._staged.record()
            compute.wait_event(self._staged)
        if device_tokens is not None:  # after the packed copy, which wrote placeholders there
            self.input_ids[:B].copy_(device_tokens)
        for i, (pages, key) in enumerate(zip(tables, keys, strict=True)):
            row_key[i], row_len[i] = key, len(pages)

    def _upload(self, spans: list[tuple[int, int]], end: int) -> None:
        """Copy the staged inputs: up to ``end`` bytes in one copy when that is short, else the rows and each
        changed table span (flat int32 index ranges) on its own."""
        if 0 < end <= ONE_COPY_BYTES:
            self._packed[:end].copy_(self._staging[:end], non_blocking=True)
            return
        self._rows_dev.copy_(self._rows_host, non_blocking=True)
        for lo, hi in spans:
            lo, hi = self._tables_at + 4 * lo, self._tables_at + 4 * hi
            self._packed[lo:hi].copy_(self._staging[lo:hi], non_blocking=True)

    def replay(self, B: int) -> torch.Tensor:
        """Run the graph for B loaded rows; returns its logits buffer [B, V] (valid until the next replay).

        Without a captured graph for B (CPU, or before capture) the same call runs eagerly over the
        static buffers, so the input path can be checked anywhere.
        """
        if B not in self.graphs:
            out = self._run(self.batch(B))
        else:
            graph, out = self.graphs[B]
            graph.replay()
        if self._replayed is not None:
            self._replayed.record()
        return out


def warm_on_side_stream(device: torch.device, run: Callable[[], object], rounds: int = 2) -> None:
    """Run ``run`` (one warmup of everything about to be captured) ``rounds`` times on a side stream, then wait:
    lazy initialisation and autotuning happen before capture, off the capture stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(rounds):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def try_capture(capture: Callable[[], None], launches: contextlib.AbstractContextManager, device: torch.device,
                what: str) -> str | None:
    """Run ``capture`` inside ``launches`` (a Program's launch scope) in inference mode; None when it succeeded,
    else why not (the caller then runs eagerly). Raises when the failed capture left the device unusable."""
    try:
        with torch.inference_mode(), launches:
            capture()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.warning("%s not captured, running eagerly: %s", what, error)
        try:
            torch.cuda.synchronize(device)
        except RuntimeError as sync_exc:
            raise RuntimeError(f"CUDA graph capture failed ({error}) and left the device "
                               f"unusable: {sync_exc}") from exc
        return error
    return None
