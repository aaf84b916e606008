"""Qwen35MTPProgram: Qwen3.5 decoding speculatively with its MTP head (``StartupFeatures.speculative = "mtp"``).

The shared core (``ninfer.models.common.speculative``) runs the verify unit; what is Qwen3.5's here: the verify
forward keeps each position's GDN conv and recurrent state in ``VerifySteps`` (rows of the unit, R steps each)
and the accepted step is moved into the slot afterwards (``gdn_verify_commit``: SGLang's intermediate cache and
one scatter rather than vLLM's per-step slots, so a StateImage, its Snapshot and its checkpoints stay one
image: docs/speculative.md); the drafter is ``Qwen35MTP``, whose KV layers follow the target's attention
layers in the one paged pool (same pages, same positions).
"""

from __future__ import annotations

from typing import Any

import torch

from ninfer.core.forward_batch import ForwardBatch
from ninfer.models.common.speculative.program import SpeculativeProgram
from ninfer.ops import gdn_verify_commit
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.execution.layers import VerifySteps
from ninfer_qwen35.program.program import Qwen35Program


def verify_steps(config: Qwen35Config, *, rows: int, draft_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> VerifySteps:
    """Step buffers for ``rows`` verify rows of 1 + ``draft_tokens`` positions (explicit Program backing: the
    profile counts them as ``backing_bytes``)."""
    R, L = draft_tokens + 1, len(config.gdn_layers)
    return VerifySteps(
        conv=torch.zeros((rows, R, L, config.conv_dim, config.linear_conv_kernel_dim - 1), dtype=dtype,
                         device=device),
        recurrent=torch.zeros((rows, R, L, config.linear_num_value_heads, config.linear_key_head_dim,
                               config.linear_value_head_dim), dtype=torch.float32, device=device))


class Qwen35MTPProgram(SpeculativeProgram, Qwen35Program):
    """``Qwen35Program`` whose decode units verify ``draft_tokens`` MTP drafts per row."""

    def __init__(self, model: Any, *, mtp: Any, steps: VerifySteps, draft_tokens: int, **kwargs: Any) -> None:
        """``model``: a ``Qwen35Model``; ``mtp``: its ``Qwen35MTP``; ``steps``: ``verify_steps(...)`` for
        ``max_concurrency`` rows; the rest as ``Qwen35Program`` (the pool holds the MTP layers after the target's)."""
        self.mtp = mtp
        self.steps = steps
        cuda_graphs, static_decode = kwargs.pop("cuda_graphs", True), kwargs.pop("static_decode", False)
        if kwargs.get("vision") is not None:
            raise ValueError("speculative decoding (MTP) does not run the vision encoder yet: start without one")
        super().__init__(model=model, draft_tokens=draft_tokens, cuda_graphs=False, **kwargs)
        # Its verify and draft units place tokens at plain ledger positions (no MRoPE shift).
        self.sequences.no_vision = "speculative decoding (MTP) does not run prompts with images or videos yet"
        if steps.conv.shape[:2] != (self.max_concurrency, draft_tokens + 1):
            raise ValueError(f"verify steps {tuple(steps.conv.shape[:2])} must be [max_concurrency, draft_tokens + 1]")
        attention = len(model.config.attention_layers)
        self.mtp_kv = self.pool.caches()[attention:]
        if len(self.mtp_kv) != len(mtp.params.layers):
            raise ValueError(f"the KV pool holds {len(self.mtp_kv)} layers after the target's {attention}; the MTP "
                             f"block has {len(mtp.params.layers)}")
        self.start_graphs(cuda_graphs=cuda_graphs, static_decode=static_decode)  # the drafter's views exist now

    def backing_bytes(self) -> int:
        return super().backing_bytes() + sum(t.numel() * t.element_size() for t in (self.steps.conv, self.steps.recurrent))

    def verify_forward(self, batch: ForwardBatch) -> torch.Tensor:
        B = batch.num_seqs
        return self.model.forward(batch, self.views, VerifySteps(conv=self.steps.conv[:B],
                                                                 recurrent=self.steps.recurrent[:B]))

    def verify_commit(self, batch: ForwardBatch, steps: torch.Tensor) -> None:
        B = batch.num_seqs
        gdn_verify_commit(self.views.conv, self.views.recurrent, batch.state_slots, self.steps.conv[:B],
                          self.steps.recurrent[:B], steps)

    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.forward(batch, hidden, self.mtp_kv, self.views.experts)
