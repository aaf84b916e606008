"""The per-layer calls Qwen4Exp adds to Qwen3.5's: QSA attention (gated attention over the tokens its indexer
selects) and the PLE addend of the wide residual. Plain functions over tensors; the model runs them under
inference_mode. The GDN mixer and the MoE block are Qwen3.5's (``ninfer_qwen35.execution.layers``).

A verify forward (every row R tokens) leaves the slots' state as it was and keeps the state after each position in
``Qwen4ExpVerifySteps``: Qwen3.5's GDN steps plus, with PLE, each PLE layer's conv history and the n-gram history.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from ninfer.ops import (
    apply_rope,
    gather_rows,
    linear,
    ngram_hash_ids,
    paged_attention,
    rms_norm,
)
from ninfer.ops.ple import dilated_causal_conv, ple_gated_values, ple_layer
from ninfer.ops.qsa import qsa_attention_static, qsa_select, qsa_select_static
from ninfer.ops.rope import rope_angles_cos_sin
from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.execution.forward_batch import ForwardBatch
from ninfer_qwen4exp.execution.parameters import IndexerParams, PLEParams
from ninfer_qwen35.execution.layers import VerifySteps, attention_inputs
from ninfer_qwen35.execution.parameters import AttentionParams


@attrs.frozen(kw_only=True, eq=False)
class Qwen4ExpVerifySteps(VerifySteps):
    """Where a verify forward keeps each position's state (row b of the batch, after its token t): Qwen3.5's GDN
    ``conv`` / ``recurrent`` [B, R, L_gdn, ...], and with PLE ``ple_conv`` [B, R, L_ple, conv_state_len, S * H]
    (each PLE layer's conv history) and ``ngram`` [B, R, context_len] int64 (the sequence's last token ids)."""

    ple_conv: torch.Tensor | None = None
    ngram: torch.Tensor | None = None


def row_steps(history: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The history after each position of rows of R new elements: history [B, L, ...] (each row's last L
    elements), new [B * R, ...] -> [B, R, L, ...], step t holding the last L of history + new[:t + 1]."""
    B, L = history.shape[:2]
    buf = torch.cat([history, new.view(B, -1, *new.shape[1:]).to(history.dtype)], dim=1)
    R = buf.shape[1] - L
    index = torch.arange(1, R + 1, device=buf.device)[:, None] + torch.arange(L, device=buf.device)
    return buf[:, index]


def qsa_dense(config: Qwen4ExpConfig, max_seq_len: int) -> bool:
    """Whether every query of a batch attends all its visible tokens: QSA keeps the best ``block_topk`` complete
    blocks and the open tail, so while no query sees more complete blocks than that, nothing is left out."""
    q = config.qsa
    return q is None or max_seq_len // q.compress_ratio <= q.block_topk


def index_queries(config: Qwen4ExpConfig, p: IndexerParams, x: torch.Tensor, batch: ForwardBatch,
                  rope_inv_freq: torch.Tensor, index_keys: torch.Tensor,
                  rope_axes: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's inputs for this batch: its raw key [N, Di] stored at ``slot_mapping`` in ``index_keys``
    [num_pages, page_size, Di] (pooled, normed and rotated per block when scored), and its queries [N, Hi, Di]
    (per-head (1 + w) norm, then rotated at the token's position over the attention's rotary dims: its
    ``mrope_positions`` through ``rope_axes`` when the batch has them)."""
    q = config.qsa
    N = x.shape[0]
    qk = linear(x, p.qk_proj)
    queries, keys = qk.split((q.n_heads * q.head_dim, q.head_dim), dim=-1)
    index_keys.view(-1, q.head_dim)[batch.slot_mapping] = keys.to(index_keys.dtype)
    queries = rms_norm(queries.reshape(N, q.n_heads, q.head_dim), p.q_norm, config.base.rms_norm_eps)
    mrope = batch.mrope_positions is not None
    cos, sin = rope_angles_cos_sin(batch.mrope_positions if mrope else batch.positions, rope_inv_freq, queries.dtype,
                                   rope_axes if mrope else None)
    return apply_rope(queries, cos, sin, config.base.rotary_dim)


def write_rope_positions(batch: ForwardBatch, rope_positions: torch.Tensor) -> None:
    """Store each new token's (t, h, w) rotary positions at ``slot_mapping`` in ``rope_positions`` [num_pages,
    page_size, 3] (text tokens: its position on every axis)."""
    rows = batch.mrope_positions.T if batch.mrope_positions is not None else batch.positions[:, None].expand(-1, 3)
    rope_positions.view(-1, 3)[batch.slot_mapping] = rows.to(rope_positions.dtype)


def qsa_attention(config: Qwen4ExpConfig, p: AttentionParams, indexer: IndexerParams | None, x: torch.Tensor,
                  batch: ForwardBatch, rope_inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  index_keys: torch.Tensor | None, rope_axes: torch.Tensor | None = None,
                  rope_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Gated attention x [N, H] -> [N, H] over the tokens QSA selects (all visible ones while the batch is
    ``qsa_dense``), writing this batch's K/V and indexer keys first. MRoPE: a batch with ``mrope_positions``
    rotates its queries and keys by them through ``rope_axes``; with ``rope_positions`` (every cached token's
    (t, h, w), this batch's already written) the block keys rotate at their first token's."""
    d = config.base.head_dim
    q, gate = attention_inputs(config.base, p, x, batch, rope_inv_freq, k_cache, v_cache, rope_axes)
    selected = None
    if indexer is not None:
        if index_keys is None:
            raise ValueError("qsa_attention: a QSA layer needs its indexer key cache")
        index_q = index_queries(config, indexer, x, batch, rope_inv_freq, index_keys, rope_axes)
        if not qsa_dense(config, batch.max_seq_len):
            selected = _select_blocks(config, indexer, index_q, index_keys, batch, rope_inv_freq,
                                      rope_positions, rope_axes)
    if selected is None:
        o = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                            batch.max_query_len, batch.max_seq_len, d ** -0.5, gate=gate)
    elif _static_forms(batch):
        o = qsa_attention_static(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                 selected, config.qsa.compress_ratio, d ** -0.5, gate)
    else:
        o = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                            batch.max_query_len, batch.max_seq_len, d ** -0.5, gate=gate, selected_blocks=selected,
                            block_size=config.qsa.compress_ratio)
    return linear(o.flatten(1), p.o_proj)


def _static_forms(batch: ForwardBatch) -> bool:
    """Whether QSA selects and attends in its static forms: in a ``static`` batch (CUDA-graph decode, verify and
    draft steps, where ``max_seq_len`` is the graphs' bound) they are the only ones, and every decode batch takes
    them too, so eager and captured decode run one code path (and no per-sequence loop)."""
    return batch.static or batch.is_decode


def _select_blocks(config: Qwen4ExpConfig, indexer: IndexerParams, index_q: torch.Tensor, index_keys: torch.Tensor,
                   batch: ForwardBatch, rope_inv_freq: torch.Tensor, rope_positions: torch.Tensor | None,
                   rope_axes: torch.Tensor | None) -> torch.Tensor:
    """The blocks each query keeps (of equal scores, the earlier block): ``qsa_select``, or its static form over
    ``max_seq_len // compress_ratio`` blocks (``_static_forms``)."""
    q = config.qsa
    if rope_positions is not None and rope_axes is None:
        raise ValueError("qsa_attention: rope_positions need rope_axes")
    args = (index_q, index_keys, batch.block_tables, batch.seq_lens, batch.query_start_loc, indexer.k_norm,
            config.base.rms_norm_eps, rope_inv_freq, config.base.rotary_dim, q.compress_ratio, q.block_topk)
    axes = rope_axes if rope_positions is not None else None
    if _static_forms(batch):
        return qsa_select_static(*args, batch.max_seq_len // q.compress_ratio, key_positions=rope_positions,
                                 rope_axes=axes)
    return qsa_select(*args, key_positions=rope_positions, rope_axes=axes)


def ple_addend(config: Qwen4ExpConfig, p: PLEParams, x: torch.Tensor, windows: torch.Tensor, batch: ForwardBatch,
               conv_state: torch.Tensor, steps: torch.Tensor | None = None) -> torch.Tensor:
    """What a PLE layer adds to the residual x [N, S * H], from the batch's n-gram ``windows`` [N, n]; its conv
    history rows of ``conv_state`` [slots, (K - 1) * n, S * H] are read (zeros for a fresh row) and rewritten, or,
    with ``steps`` [B, R, (K - 1) * n, S * H] (a verify batch), left as they were and each position's history
    kept there."""
    e, eps = config.ple, config.base.rms_norm_eps
    rows = ngram_hash_ids(windows, p.multipliers, p.head_vocab, p.head_offsets, e.heads_per_ngram)
    embeddings = gather_rows(p.table, rows, x.device, x.dtype).flatten(1)
    slots = batch.state_slots
    history = torch.where(batch.has_initial_state[:, None, None], conv_state[slots].to(x.dtype), 0)
    if steps is None:
        out, history = ple_layer(x, embeddings, p.key_proj, p.value_proj, p.norm_key, p.norm_query, p.norm_conv,
                                 p.conv, history, batch.query_start_loc, streams=config.hc_count,
                                 dilation=e.ngram_size, eps=eps)
        conv_state[slots] = history.to(conv_state.dtype)
        return out
    # ple_layer's sum, with the conv's input kept to make the history after each position
    gated, normed = ple_gated_values(x, embeddings, p.key_proj, p.value_proj, p.norm_key, p.norm_query, p.norm_conv,
                                     config.hc_count, eps)
    conv, _ = dilated_causal_conv(normed, p.conv, history, batch.query_start_loc, e.ngram_size)
    steps.copy_(row_steps(history, normed))
    return gated + F.silu(conv)
