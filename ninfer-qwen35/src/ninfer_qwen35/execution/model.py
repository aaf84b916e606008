"""Qwen35Model: one forward over a packed batch (prefill of several sequences, or B decode rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops import embed_rms_norm, linear, rms_norm, rope_inv_freq
from ninfer.ops.rope import mrope_axes
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.execution.forward_batch import ForwardBatch, ModelStateViews
from ninfer_qwen35.execution.layers import GDNPlan, VerifySteps, attention_mixer, feed_forward, gdn_mixer
from ninfer_qwen35.execution.parameters import GDNParams, Qwen35Parameters


class Qwen35Model:
    """The fixed model calls over prepared Parameters; all state lives in the views passed in."""

    def __init__(self, params: Qwen35Parameters) -> None:
        self.params = params
        self.config = params.config
        # Rotary rates, made once: a decode graph reads them, and per-forward cos/sin tables cost launches.
        self.rope_inv_freq = rope_inv_freq(self.config.rotary_dim, self.config.rope_theta, params.embed.device)
        # MRoPE (a prefill chunk with media placeholders): the (t, h, w) row each frequency slot reads.
        self.rope_axes = mrope_axes(self.config.rotary_dim, self.config.mrope_section, params.embed.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, state: ModelStateViews, verify: VerifySteps | None = None) -> torch.Tensor:
        """hidden [N, H] after the final norm, for every new token of the batch (MTP reads them too).

        GDN conv/recurrent state of each sequence's slot and the KV of its pages are updated in place; with
        ``verify`` (every row R tokens) the slots are left as they were and each position's state goes there.
        """
        c, p = self.config, self.params
        self._check(batch, state)
        eps = c.rms_norm_eps
        if batch.vision_rows is None:  # the residual stream x, and the first layer's input norm of it
            x, h = embed_rms_norm(batch.input_ids, p.embed, p.layers[0].input_norm, eps)
        else:  # media placeholders take the vision encoder's rows
            x = F.embedding(batch.input_ids, p.embed)
            x.index_copy_(0, batch.vision_rows, batch.vision_embeds.to(x.dtype))
            h = rms_norm(x, p.layers[0].input_norm, eps)
        plan = GDNPlan(decode=False, verify=verify) if verify is not None else self._gdn_plan(batch)
        # Each sublayer's output joins the stream in the op of the norm after it (one kernel once enabled):
        # the mixer's with the post-attention norm, the MLP's with the next layer's input norm or the final norm.
        next_norms = [layer.input_norm for layer in p.layers[1:]] + [p.final_norm]
        for layer, next_norm in zip(p.layers, next_norms, strict=True):
            if isinstance(layer.mixer, GDNParams):
                i = layer.state_index
                h = gdn_mixer(c, layer.mixer, h, batch, plan, state.conv[:, i], state.recurrent[:, i], i)
            else:
                k_cache, v_cache = state.kv[layer.state_index]
                h = attention_mixer(c, layer.mixer, h, batch, self.rope_inv_freq, k_cache, v_cache, self.rope_axes)
            h, x = feed_forward(layer, h, x, next_norm, eps, state.experts)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, V] for final-normed hidden rows [M, H] (tied head = the embedding). Few rows on the GPU
        get the projection's fp32 accumulator (no bf16 rounding, no cast kernel); otherwise the product is cast."""
        return linear(hidden, self.params.lm_head, out_dtype=torch.float32)

    @staticmethod
    def _gdn_plan(batch: ForwardBatch) -> GDNPlan:
        if batch.is_decode:
            initial = batch.all_initial_state
            if initial is None:
                initial = bool(batch.has_initial_state.all())  # a device sync; the Program can say it instead
            if initial:
                return GDNPlan(decode=True)
        starts = batch.query_start_loc.tolist()
        seqs = tuple((starts[i], starts[i + 1], slot, bool(init)) for i, (slot, init) in
                     enumerate(zip(batch.state_slots.tolist(), batch.has_initial_state.tolist(), strict=True))
                     if starts[i + 1] > starts[i])
        return GDNPlan(decode=False, seqs=seqs)

    def _check(self, batch: ForwardBatch, state: ModelStateViews) -> None:
        """Cheap shape checks (no device sync) so a mis-built batch fails with a message, not deep in an op."""
        problems = forward_problems(self.config, batch, state)
        if problems:
            raise ValueError("Qwen35Model.forward: " + "; ".join(problems))


def forward_problems(c: Qwen35Config, batch: ForwardBatch, state: ModelStateViews) -> list[str]:
    """What is wrong with ``batch`` and ``state`` for a model of ``c``, from shapes alone (no device sync): the
    checks every Qwen-family model makes before a forward (Qwen4Exp adds its own)."""
    N, B = batch.input_ids.shape[0], batch.num_seqs
    problems = []
    if batch.positions.shape != (N,) or batch.slot_mapping.shape != (N,):
        problems.append(f"positions {tuple(batch.positions.shape)} / slot_mapping "
                        f"{tuple(batch.slot_mapping.shape)} must be [{N}]")
    if batch.mrope_positions is not None and batch.mrope_positions.shape != (3, N):
        problems.append(f"mrope_positions {tuple(batch.mrope_positions.shape)} must be [3, {N}]")
    rows, embeds = batch.vision_rows, batch.vision_embeds
    if (rows is None) != (embeds is None) or (rows is not None and (
            rows.dim() != 1 or embeds.shape != (rows.shape[0], c.hidden_size))):
        problems.append(f"vision_rows {None if rows is None else tuple(rows.shape)} / vision_embeds "
                        f"{None if embeds is None else tuple(embeds.shape)} must be [M] / [M, {c.hidden_size}]")
    if batch.query_start_loc.shape != (B + 1,) or batch.seq_lens.shape != (B,) \
            or batch.has_initial_state.shape != (B,) or batch.block_tables.shape[0] != B:
        problems.append(f"per-sequence tensors must have {B} rows (query_start_loc {B + 1})")
    gdn = len(c.gdn_layers)
    if gdn and (state.conv.shape[1:] != (gdn, c.conv_dim, c.linear_conv_kernel_dim - 1)
                or state.recurrent.shape[1:] != (gdn, c.linear_num_value_heads, c.linear_key_head_dim,
                                                 c.linear_value_head_dim)
                or state.recurrent.dtype != torch.float32):
        problems.append(f"state views conv {tuple(state.conv.shape)} / recurrent {tuple(state.recurrent.shape)} "
                        f"{state.recurrent.dtype} do not match the config's StateImage layout")
    if len(state.kv) != len(c.attention_layers):
        problems.append(f"{len(state.kv)} KV caches given for {len(c.attention_layers)} attention layers")
    return problems
