"""Qwen4ExpModel: one forward over a packed batch (prefill chunks of several sequences, or B decode rows).

The residual is ``hc_count`` streams wide (the embedding repeated); each layer optionally adds its PLE term, then
reads its mixer's input through one hyper-connection and its MoE block's through another, each output injected
back into every stream. The final hyper-connection mixer gives the hidden states (there is no final norm).

Media (as Qwen3.5): placeholder rows take the vision encoder's embeddings before the residual is widened, PLE
hashes the token ids with the placeholders as they are (transformers' ``ple_input_ids``), and a chunk with
placeholders rotates by its (t, h, w) MRoPE positions, the QSA indexer too: its block keys rotate at their first
token's, which ``rope_positions`` keeps for every cached token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops import hyper_connection_inject, hyper_connection_mix, linear, ngram_windows, rope_inv_freq
from ninfer.ops.norm import sum_terms
from ninfer.ops.rope import mrope_axes
from ninfer_qwen4exp.execution.forward_batch import ForwardBatch, Qwen4ExpStateViews
from ninfer_qwen4exp.execution.layers import (
    Qwen4ExpVerifySteps,
    ple_addend,
    qsa_attention,
    row_steps,
    write_rope_positions,
)
from ninfer_qwen4exp.execution.parameters import HyperParams, Qwen4ExpParameters
from ninfer_qwen35.execution.layers import GDNPlan, gdn_mixer, mlp
from ninfer_qwen35.execution.model import Qwen35Model, forward_problems
from ninfer_qwen35.execution.parameters import GDNParams


class Qwen4ExpModel:
    """The fixed model calls over prepared Parameters; all state lives in the views passed in."""

    def __init__(self, params: Qwen4ExpParameters) -> None:
        self.params = params
        self.config = params.config
        b = self.config.base
        self.rope_inv_freq = rope_inv_freq(b.rotary_dim, b.rope_theta, params.embed.device)
        # MRoPE (a prefill chunk with media placeholders): the (t, h, w) row each frequency slot reads.
        self.rope_axes = mrope_axes(b.rotary_dim, b.mrope_section, params.embed.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, state: Qwen4ExpStateViews, verify: Qwen4ExpVerifySteps | None = None, *,
                wide: bool = False) -> torch.Tensor:
        """hidden [N, H] after the final hyper-connection mixer, for every new token of the batch; with ``wide``
        the residual [N, S * H] before it (what the MTP block reads; ``mix`` makes the hidden of it).

        The GDN state and PLE histories of each sequence's slot and the KV (with indexer keys) of its pages are
        updated in place; with ``verify`` (every row R tokens) the slots are left as they were and each
        position's state goes there."""
        c, p = self.config, self.params
        self._check(batch, state)
        if verify is not None:
            self._check_verify(batch, verify)
        x = F.embedding(batch.input_ids, p.embed)
        if batch.vision_rows is not None:  # media placeholders take the vision encoder's rows
            x.index_copy_(0, batch.vision_rows, batch.vision_embeds.to(x.dtype))
        x = x.repeat(1, c.hc_count)
        if state.rope_positions is not None:
            write_rope_positions(batch, state.rope_positions)
        plan = GDNPlan(decode=False, verify=verify) if verify is not None else Qwen35Model._gdn_plan(batch)
        windows = None
        if c.ple is not None:  # every PLE layer hashes the same windows; the history moves on once per forward
            slots = batch.state_slots
            windows, history = ngram_windows(batch.input_ids, state.ngram[slots], batch.query_start_loc,
                                             batch.has_initial_state, c.eos_token_id)
            if verify is None:
                state.ngram[slots] = history
            else:
                start = torch.where(batch.has_initial_state[:, None], state.ngram[slots], c.eos_token_id)
                verify.ngram.copy_(row_steps(start, batch.input_ids))
        for layer in p.layers:
            if layer.ple is not None:
                k = layer.ple.state_index
                x = x + ple_addend(c, layer.ple, x, windows, batch, state.ple_conv[:, k],
                                   None if verify is None else verify.ple_conv[:, :, k])
            h, inject = self._mix(x, layer.attn_hc)
            i = layer.state_index
            if isinstance(layer.mixer, GDNParams):
                h = gdn_mixer(c.base, layer.mixer, h, batch, plan, state.conv[:, i], state.recurrent[:, i], i,
                              gate_activation=c.output_gate)
            else:
                k_cache, v_cache = state.kv[i]
                h = qsa_attention(c, layer.mixer, layer.indexer, h, batch, self.rope_inv_freq, k_cache, v_cache,
                                  state.index_keys[i] if state.index_keys else None, self.rope_axes,
                                  state.rope_positions)
            x = hyper_connection_inject(x, h, inject)
            h, inject = self._mix(x, layer.mlp_hc)
            h = mlp(layer.mlp, h, state.experts)
            x = hyper_connection_inject(x, sum_terms(h) if h.dim() == 3 else h, inject)
        return x if wide else self.mix(x)

    def mix(self, residual: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] of residual rows [M, S * H] through the final hyper-connection mixer."""
        return self._mix(residual, self.params.mixer)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, V] for hidden rows [M, H] (tied head = the embedding)."""
        return linear(hidden, self.params.lm_head, out_dtype=torch.float32)

    def _mix(self, x: torch.Tensor, h: HyperParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hyper_connection_mix(x, h.norm, h.down, h.up, h.inject, self.config.hc_count,
                                    self.config.base.rms_norm_eps)

    def _check_verify(self, batch: ForwardBatch, verify: Qwen4ExpVerifySteps) -> None:
        c, B = self.config, batch.num_seqs
        R = verify.conv.shape[1]
        problems = []
        if batch.input_ids.shape[0] != B * R or batch.max_query_len != R:
            problems.append(f"every row must be the steps' {R} tokens ({B} rows, {batch.input_ids.shape[0]} tokens)")
        if verify.conv.shape[0] != B or verify.recurrent.shape[:2] != (B, R):
            problems.append(f"GDN steps {tuple(verify.conv.shape[:2])} / {tuple(verify.recurrent.shape[:2])} must "
                            f"be [{B}, {R}]")
        if c.ple is not None and (verify.ple_conv is None or verify.ngram is None
                                  or verify.ple_conv.shape[:3] != (B, R, len(c.ple_layers))
                                  or verify.ngram.shape != (B, R, c.ple.context_len)):
            problems.append(f"PLE steps ple_conv / ngram must be [{B}, {R}, {len(c.ple_layers)}, ...] / "
                            f"[{B}, {R}, {c.ple.context_len}]")
        if problems:
            raise ValueError("Qwen4ExpModel.forward(verify=...): " + "; ".join(problems))

    def _check(self, batch: ForwardBatch, state: Qwen4ExpStateViews) -> None:
        """Cheap shape checks (no device sync) so a mis-built batch fails with a message, not deep in an op:
        Qwen3.5's (``forward_problems`` of the base config), then the QSA, PLE and rotary-position views'."""
        c = self.config
        problems = forward_problems(c.base, batch, state)
        if batch.mrope_positions is not None and c.qsa is not None and state.rope_positions is None:
            problems.append("a batch with mrope_positions needs the views' rope_positions (QSA block keys rotate "
                            "at their first token's (t, h, w))")
        if state.rope_positions is not None and (
                state.rope_positions.shape[1:] != (state.page_size, 3) or state.rope_positions.dtype != torch.int32):
            problems.append(f"rope_positions {tuple(state.rope_positions.shape)} {state.rope_positions.dtype} must "
                            f"be [pages, {state.page_size}, 3] int32")
        if c.qsa is not None and (len(state.index_keys) != len(c.attention_layers) or any(
                k.shape[1:] != (state.page_size, c.qsa.head_dim) for k in state.index_keys)):
            problems.append(f"QSA needs one indexer key cache [pages, {state.page_size}, {c.qsa.head_dim}] per "
                            f"attention layer, got {[tuple(k.shape) for k in state.index_keys]}")
        if c.ple is not None:
            e = c.ple
            want = (len(c.ple_layers), e.conv_state_len, c.hc_hidden_size)
            if state.ple_conv is None or state.ple_conv.shape[1:] != want:
                problems.append(f"ple_conv {None if state.ple_conv is None else tuple(state.ple_conv.shape)} must "
                                f"be [slots, {', '.join(map(str, want))}]")
            if state.ngram is None or state.ngram.shape[1:] != (e.context_len,) or state.ngram.dtype != torch.int64:
                problems.append(f"ngram {None if state.ngram is None else tuple(state.ngram.shape)} must be "
                                f"[slots, {e.context_len}] int64")
        if problems:
            raise ValueError("Qwen4ExpModel.forward: " + "; ".join(problems))
