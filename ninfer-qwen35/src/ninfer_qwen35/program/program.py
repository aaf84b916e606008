"""Qwen35Program: the physical side of one resident Qwen3.5 model (engine worker only).

What is Qwen3.5's here: its StateImage holds the conv and recurrent state of every GDN layer (one
contiguous image per slot), its attention layers share one paged KV pool, and a unit runs
``Qwen35Model.forward(batch, ModelStateViews)`` then ``logits``. Sequences, reservations and
copy-on-write, prefill chunks, exact-B decode (CUDA graphs), commit / rollback by Replay,
Snapshot / Replay pause and resume, sampling and scoring windows are the shared parts that
``PagedProgram`` composes (docs/program.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.device import Device
from ninfer.core.forward_batch import ForwardBatch
from ninfer.models.common.context.prompt_media import VisionSpec
from ninfer.models.common.paged_program import PagedProgram
from ninfer_qwen35.execution.forward_batch import ModelStateViews

if TYPE_CHECKING:
    from ninfer.models.common.moe.host_experts import HostExperts


class Qwen35Program(PagedProgram):
    """Implements ``ninfer.contract.Program`` for Qwen3.5 over the native model (``forward`` / ``logits``)."""

    def __init__(self, model: Any, *, state_layout: StateImageLayout, kv_pool: KVPoolSpec, device: Device | str,
                 max_concurrency: int, capacity: ProgramCapacity, kv_dtype: torch.dtype | str | None = None,
                 vocab_size: int, sampling_defaults: SamplingParams | None = None, cuda_graphs: bool = True,
                 static_decode: bool = False, host_experts: HostExperts | None = None, vision: Any = None) -> None:
        """``model``: a ``Qwen35Model``. ``state_layout`` / ``kv_pool``: ``ninfer_qwen35.state``'s. ``capacity``:
        what the runtime granted (``PagedProgram``). ``cuda_graphs``: capture decode graphs on CUDA.
        ``static_decode``: without graphs, still decode through the graphs' static input buffers (checks that
        input path on CPU). ``max_concurrency`` comes validated from ``StartupOptions`` (1..8). ``host_experts``:
        this Program's runtime of MoE routed experts kept in host memory (it runs them outside CUDA graphs).
        ``vision``: the model's ``Qwen35Vision`` encoder; with it the Program takes prompts with images and
        videos (docs/vision.md)."""
        super().__init__(state_layout=state_layout, kv_pool=kv_pool, device=device, max_concurrency=max_concurrency,
                         capacity=capacity, kv_dtype=kv_dtype, vocab_size=vocab_size,
                         sampling_defaults=sampling_defaults)
        self.model = model
        # The pool's first layers are the target's attention layers (an MTP drafter's follow them).
        self.views = ModelStateViews(conv=self.states.view("conv"), recurrent=self.states.view("recurrent"),
                                     kv=self.pool.caches()[:len(model.config.attention_layers)],
                                     page_size=self.page_size, experts=host_experts)
        self.host_experts = host_experts
        if vision is not None:
            take_media(self, vision, model.config)
        self.start_graphs(cuda_graphs=cuda_graphs, static_decode=static_decode)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.views)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)



def take_media(program: PagedProgram, vision: Any, config: Any) -> None:
    """Give ``program`` the vision encoder: its media placeholders (the config's image and video token ids) take
    the encoder's rows."""
    pads = [t for t in (config.image_token_id, config.video_token_id) if t is not None]
    if not pads:
        raise ValueError("a vision encoder needs the config's image_token_id / video_token_id")
    program.vision.encode = vision.forward
    program.sequences.vision = VisionSpec(merge_size=vision.config.spatial_merge_size, placeholder_ids=pads)
