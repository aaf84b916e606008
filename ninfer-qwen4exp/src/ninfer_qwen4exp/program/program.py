"""Qwen4ExpProgram: the physical side of one resident Qwen4Exp model (engine worker only).

What is Qwen4Exp's here: its StateImage holds the GDN conv and recurrent state of every GDN layer and, with PLE,
each PLE layer's conv history and the sequence's n-gram history (``ninfer_qwen4exp.state``); its attention
layers share one paged KV pool whose pages also hold the QSA indexer's raw keys (and, when the Program takes
media through Qwen3.5's encoder, each token's (t, h, w) rotary positions, docs/vision.md); a unit runs
``Qwen4ExpModel.forward(batch, Qwen4ExpStateViews)`` then ``logits``. Everything else (sequences, reservations,
copy-on-write, prefill chunks, decode, Snapshot / Replay, the context cache, scoring) is ``PagedProgram``'s.

A fresh slot is never cleared: a row whose unit starts at position 0 has ``has_initial_state`` False, and the
model then starts its GDN and PLE conv state at zero and its n-gram history at EOS instead of reading the slot.
Every path that starts a sequence over (the first prefill chunk, a Replay rebuild, a rollback, a scoring window)
runs from position 0, and every path that continues one (a fork, a Snapshot, a checkpoint) copies the whole
image, so the n-gram history is never read before the model wrote it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.device import Device
from ninfer.core.forward_batch import ForwardBatch
from ninfer.models.common.paged_program import PagedProgram
from ninfer_qwen4exp.execution.forward_batch import Qwen4ExpStateViews
from ninfer_qwen4exp.state import INDEX_KEYS, ROPE_POSITIONS
from ninfer_qwen35.program.program import take_media

if TYPE_CHECKING:
    from ninfer.models.common.moe.host_experts import HostExperts
    from ninfer_qwen4exp.config import Qwen4ExpConfig


class Qwen4ExpProgram(PagedProgram):
    """Implements ``ninfer.contract.Program`` for Qwen4Exp over the native model (``forward`` / ``logits``)."""

    def __init__(self, model: Any, *, config: Qwen4ExpConfig, state_layout: StateImageLayout, kv_pool: KVPoolSpec,
                 device: Device | str, max_concurrency: int, capacity: ProgramCapacity,
                 kv_dtype: torch.dtype | str | None = None, vocab_size: int,
                 sampling_defaults: SamplingParams | None = None, cuda_graphs: bool = True,
                 static_decode: bool = False, host_experts: HostExperts | None = None, vision: Any = None) -> None:
        """``model``: a ``Qwen4ExpModel`` of ``config``. ``state_layout`` / ``kv_pool``: ``ninfer_qwen4exp.state``'s
        for that config (``kv_pools(..., media=True)`` with ``vision``). ``capacity``, ``cuda_graphs``,
        ``static_decode``: as ``Qwen35Program``. ``host_experts``: this Program's runtime of the MoE routed experts
        kept in host memory. ``vision``: the model's encoder (``Qwen35Vision``); with it the Program takes prompts
        with images and videos (docs/vision.md)."""
        super().__init__(state_layout=state_layout, kv_pool=kv_pool, device=device, max_concurrency=max_concurrency,
                         capacity=capacity, kv_dtype=kv_dtype, vocab_size=vocab_size,
                         sampling_defaults=sampling_defaults)
        self.model = model
        self.config = config
        attention = len(config.attention_layers)
        kv = self.pool.caches()
        if len(kv) < attention:
            raise ValueError(f"the KV pool holds {len(kv)} layers; this config has {attention} attention layers")
        ple = config.ple is not None
        positions = ROPE_POSITIONS in {f.name for f in kv_pool.aux}
        if vision is not None and config.qsa is not None and not positions:
            raise ValueError(f"a Qwen4Exp Program with QSA takes media only over a KV pool that pages "
                             f"{ROPE_POSITIONS!r} (ninfer_qwen4exp.state.kv_pools(..., media=True))")
        # The pool's first layers are the target's attention layers (an MTP drafter's follow them).
        self.views = Qwen4ExpStateViews(
            conv=self.states.view("conv"), recurrent=self.states.view("recurrent"), kv=kv[:attention],
            page_size=self.page_size,
            index_keys=self.pool.aux_caches(INDEX_KEYS)[:attention] if config.qsa is not None else (),
            ple_conv=self.states.view("ple_conv") if ple else None,
            ngram=self.states.view("ngram")[:, 0] if ple else None,  # one history per sequence: [S, context_len]
            experts=host_experts, rope_positions=self.pool.aux_caches(ROPE_POSITIONS)[0] if positions else None)
        self.host_experts = host_experts
        if vision is not None:
            take_media(self, vision, self.config.base)
        self.start_graphs(cuda_graphs=cuda_graphs, static_decode=static_decode)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.views)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)
