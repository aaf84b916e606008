"""Qwen3Program (plugin slot ``program``): dense Qwen3's Program, built from ninfer-core's shared parts.

What is Qwen3's here is small: a StateImage of no fields, one paged KV pool over every layer, and a unit
that runs ``Qwen3Model.forward`` then ``logits``. Sequences, reservations and copy-on-write, prefill
chunks, exact-B decode (CUDA graphs on CUDA), commit and rollback, Snapshot / Replay pause, sampling and
scoring windows are ``PagedProgram``'s (docs/program.md, "Building a Program from the shared parts").
"""

from __future__ import annotations

import torch

from ninfer.contract import KVPoolSpec, ProgramCapacity, SamplingParams
from ninfer.core.device import Device
from ninfer.core.forward_batch import ForwardBatch, PagedKVViews
from ninfer.models.common.paged_program import PagedProgram
from ninfer_qwen3.model import Qwen3Model, state_layout


class Qwen3Program(PagedProgram):
    """Implements ``ninfer.contract.Program`` (and ``PipelinedDecode``) for a ``Qwen3Model``."""

    def __init__(self, model: Qwen3Model, *, kv_pool: KVPoolSpec, device: Device | str, max_concurrency: int,
                 capacity: ProgramCapacity, kv_dtype: torch.dtype | str | None = None,
                 sampling_defaults: SamplingParams | None = None, cuda_graphs: bool = True,
                 static_decode: bool = False) -> None:
        """``static_decode``: without graphs, still decode through the graphs' static input buffers (the
        CUDA-graph input path, checked on the CPU). ``capacity`` is ``PagedProgram``'s."""
        super().__init__(state_layout=state_layout(model.config), kv_pool=kv_pool, device=device,
                         max_concurrency=max_concurrency, capacity=capacity, kv_dtype=kv_dtype,
                         vocab_size=model.config.vocab_size, sampling_defaults=sampling_defaults)
        self.model = model
        self.views = PagedKVViews(kv=self.pool.caches(), page_size=self.page_size)
        self.start_graphs(cuda_graphs=cuda_graphs, static_decode=static_decode)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.views)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)
