"""Qwen4ExpMTPProgram: Qwen4Exp decoding speculatively with its MTP head (``StartupFeatures.speculative = "mtp"``).

The shared core (``ninfer.models.common.speculative``) runs the verify unit, as for Qwen3.5
(``ninfer_qwen35.program.mtp_program``). What is Qwen4Exp's here:

- the rows passed between the target, the drafter and the heads are the wide residual [N, S * H] (the MTP block
  reads the target's residual before its final mixer); ``logits`` mixes target rows with the model's final mixer,
  ``draft_logits`` the drafter's rows with the MTP block's own;
- the verify forward keeps, besides each position's GDN state, each PLE layer's conv history and the n-gram
  history (``Qwen4ExpVerifySteps``), and the accepted step of all of them moves into the slot afterwards, so a
  rejected draft leaves no trace in the StateImage;
- the drafter's KV layers (with their QSA indexer keys) follow the target's attention layers in the one paged
  pool (same pages, same positions).
"""

from __future__ import annotations

from typing import Any

import torch

from ninfer.core.forward_batch import ForwardBatch
from ninfer.models.common.speculative.program import SpeculativeProgram
from ninfer.ops import gdn_verify_commit
from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.execution.layers import Qwen4ExpVerifySteps
from ninfer_qwen4exp.program.program import Qwen4ExpProgram
from ninfer_qwen4exp.state import INDEX_KEYS


def verify_steps(config: Qwen4ExpConfig, *, rows: int, draft_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> Qwen4ExpVerifySteps:
    """Step buffers for ``rows`` verify rows of 1 + ``draft_tokens`` positions (explicit Program backing: the
    profile counts them as ``backing_bytes``)."""
    b, R, L = config.base, draft_tokens + 1, len(config.gdn_layers)
    ple_conv = ngram = None
    if config.ple is not None:
        e = config.ple
        ple_conv = torch.zeros((rows, R, len(config.ple_layers), e.conv_state_len, config.hc_hidden_size),
                               dtype=dtype, device=device)
        ngram = torch.zeros((rows, R, e.context_len), dtype=torch.int64, device=device)
    return Qwen4ExpVerifySteps(
        conv=torch.zeros((rows, R, L, b.conv_dim, b.linear_conv_kernel_dim - 1), dtype=dtype, device=device),
        recurrent=torch.zeros((rows, R, L, b.linear_num_value_heads, b.linear_key_head_dim, b.linear_value_head_dim),
                              dtype=torch.float32, device=device),
        ple_conv=ple_conv, ngram=ngram)


def steps_bytes(steps: Qwen4ExpVerifySteps) -> int:
    return sum(t.numel() * t.element_size() for t in (steps.conv, steps.recurrent, steps.ple_conv, steps.ngram)
               if t is not None)


class Qwen4ExpMTPProgram(SpeculativeProgram, Qwen4ExpProgram):
    """``Qwen4ExpProgram`` whose decode units verify ``draft_tokens`` MTP drafts per row."""

    def __init__(self, model: Any, *, mtp: Any, steps: Qwen4ExpVerifySteps, draft_tokens: int, **kwargs: Any) -> None:
        """``model``: a ``Qwen4ExpModel``; ``mtp``: its ``Qwen4ExpMTP``; ``steps``: ``verify_steps(...)`` for
        ``max_concurrency`` rows; the rest as ``Qwen4ExpProgram`` (the pool holds the MTP layers after the
        target's)."""
        self.mtp = mtp
        self.steps = steps
        cuda_graphs, static_decode = kwargs.pop("cuda_graphs", True), kwargs.pop("static_decode", False)
        super().__init__(model=model, draft_tokens=draft_tokens, cuda_graphs=False, **kwargs)
        R = draft_tokens + 1
        if steps.conv.shape[:2] != (self.max_concurrency, R) or (self.config.ple is not None and (
                steps.ple_conv is None or steps.ngram is None or steps.ple_conv.shape[:2] != (self.max_concurrency, R)
                or steps.ngram.shape[:2] != (self.max_concurrency, R))):
            raise ValueError(f"verify steps {tuple(steps.conv.shape[:2])} must be [max_concurrency, draft_tokens + 1] "
                             "(with PLE, its conv and n-gram steps too)")
        attention, depth = len(self.config.attention_layers), len(mtp.params.layers)
        caches = self.pool.caches()
        self.mtp_kv = caches[attention:]
        if len(self.mtp_kv) != depth:
            raise ValueError(f"the KV pool holds {len(self.mtp_kv)} layers after the target's {attention}; the MTP "
                             f"block has {depth}")
        self.mtp_index_keys = self.pool.aux_caches(INDEX_KEYS)[attention:] if self.config.qsa is not None else ()
        self.start_graphs(cuda_graphs=cuda_graphs, static_decode=static_decode)  # the drafter's views exist now

    def backing_bytes(self) -> int:
        return super().backing_bytes() + steps_bytes(self.steps)

    # Every row between the calls is the wide residual; the heads mix it first.
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.views, wide=True)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(self.model.mix(hidden))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.logits(hidden)

    def verify_forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.views, self._steps(batch.num_seqs), wide=True)

    def verify_commit(self, batch: ForwardBatch, steps: torch.Tensor) -> None:
        B, views, kept = batch.num_seqs, self.views, self._steps(batch.num_seqs)
        slots = batch.state_slots
        gdn_verify_commit(views.conv, views.recurrent, slots, kept.conv, kept.recurrent, steps)
        if self.config.ple is not None:
            rows = torch.arange(B, device=steps.device)
            views.ple_conv[slots] = kept.ple_conv[rows, steps]
            views.ngram[slots] = kept.ngram[rows, steps]

    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.forward(batch, hidden, self.mtp_kv, self.mtp_index_keys, self.views.experts)

    def _steps(self, B: int) -> Qwen4ExpVerifySteps:
        s = self.steps
        return Qwen4ExpVerifySteps(conv=s.conv[:B], recurrent=s.recurrent[:B],
                                   ple_conv=None if s.ple_conv is None else s.ple_conv[:B],
                                   ngram=None if s.ngram is None else s.ngram[:B])
