"""Qwen35MTP: the multi-token-prediction block that drafts the token after next (``mtp.*``).

For the token at position t it reads the target's final-normed hidden h_t and the next token x_{t+1} (the
sampled one, or a draft), and predicts x_{t+2} through the main model's head:

    x = fc([norm_e(embed(x_{t+1})); norm_h(h_t)])  ->  one gated full-attention decoder layer  ->  norm

(``shared/reference/speculative.md`` §3.1-3.2: the hidden is post final norm, as vLLM and SGLang feed it; a
chained step feeds the block's own normed output back.) The layer attends over its own paged KV, written at
the target's positions (the entry at t is built from h_t and x_{t+1}); it has no recurrent state, so a
rejected draft's entry is simply overwritten by the next pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ninfer.ops import linear, rms_norm
from ninfer_qwen35.execution.forward_batch import ForwardBatch
from ninfer_qwen35.execution.layers import attention_mixer, feed_forward
from ninfer_qwen35.execution.model import Qwen35Model
from ninfer_qwen35.execution.parameters import MTPParams

if TYPE_CHECKING:
    from ninfer.models.common.moe.host_experts import HostExperts


class Qwen35MTP:
    """The MTP block over its Parameters, sharing the main model's embedding, rotary rates and head."""

    def __init__(self, params: MTPParams, model: Qwen35Model) -> None:
        self.params = params
        self.model = model
        self.config = model.config

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                experts: HostExperts | None = None) -> torch.Tensor:
        """The block's normed output [N, H] for every row of ``batch``: ``batch.input_ids`` are the next tokens
        x_{t+1}, ``batch.positions`` the target positions t, ``hidden`` [N, H] the target's (or, chained, this
        block's) normed hidden at t; ``kv`` holds one (k_cache, v_cache) per MTP layer, written at t; ``experts``:
        the Program's host experts runtime (routed experts in host memory)."""
        c, p = self.config, self.params
        if hidden.shape != (batch.input_ids.shape[0], c.hidden_size) or len(kv) != len(p.layers):
            raise ValueError(f"Qwen35MTP.forward: hidden {tuple(hidden.shape)} must be [{batch.input_ids.shape[0]}, "
                             f"{c.hidden_size}] and {len(p.layers)} KV caches given (got {len(kv)})")
        eps = c.rms_norm_eps
        e = rms_norm(F.embedding(batch.input_ids, self.model.params.embed), p.pre_fc_norm_embedding, eps)
        x = linear(torch.cat([e, rms_norm(hidden, p.pre_fc_norm_hidden, eps)], dim=-1), p.fc)
        next_norms = [layer.input_norm for layer in p.layers[1:]] + [p.norm]
        h = rms_norm(x, p.layers[0].input_norm, eps)
        for layer, next_norm, (k_cache, v_cache) in zip(p.layers, next_norms, kv, strict=True):
            h = attention_mixer(c, layer.mixer, h, batch, self.model.rope_inv_freq, k_cache, v_cache)
            h, x = feed_forward(layer, h, x, next_norm, eps, experts)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, V] of the token after next, through the main model's head."""
        return self.model.logits(hidden)
