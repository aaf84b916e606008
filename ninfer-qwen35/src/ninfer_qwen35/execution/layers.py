"""The per-layer calls of Qwen3.5: Gated DeltaNet mixer, gated full attention, SwiGLU MLP or sparse MoE block.

Plain functions over tensors (no nn.Module, no autograd); the model runs them under inference_mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from ninfer.ops import (
    add_rms_norm,
    add_rms_norm_linear,
    causal_conv1d_prefill,
    gdn_decode_fused,
    gdn_gates,
    gdn_prefill,
    gdn_verify,
    linear,
    moe_block,
    moe_experts,
    moe_route,
    norm_rope_write_kv,
    paged_attention,
    rms_norm_gated,
    silu_and_mul,
    swiglu,
)
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.execution.forward_batch import ForwardBatch
from ninfer_qwen35.execution.parameters import AttentionParams, GDNParams, LayerParams, MLPParams, MoEParams

if TYPE_CHECKING:
    from ninfer.models.common.moe.host_experts import HostExperts
    from ninfer_qwen35.execution.linear import LinearSplit


@attrs.frozen(kw_only=True, eq=False)
class VerifySteps:
    """Where a verify forward keeps each position's GDN state: conv [B, R, L_gdn, conv_dim, K-1] and recurrent
    [B, R, L_gdn, HV, Dk, Dv] fp32 (row b of the batch, after its token t)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@attrs.frozen(kw_only=True)
class GDNPlan:
    """How the GDN layers run this batch, decided once per forward.

    ``decode``: every row is one token continuing an existing state -> the batched step ops.
    ``verify``: every row is R tokens continuing a state, each step's state kept aside (``gdn_verify``).
    Otherwise ``seqs`` lists (start, end, slot, has_initial_state) per sequence on the host, and each
    sequence runs the prefill ops over its own slice.
    """

    decode: bool
    seqs: tuple[tuple[int, int, int, bool], ...] = ()
    verify: VerifySteps | None = None


def gdn_mixer(c: Qwen35Config, p: GDNParams, x: torch.Tensor, batch: ForwardBatch, plan: GDNPlan,
              conv: torch.Tensor, recurrent: torch.Tensor, layer: int, *,
              gate_activation: str = "silu") -> torch.Tensor:
    """x [N, H] -> [N, H]; conv [S, conv_dim, K-1] and recurrent [S, HV, Dk, Dv] are this layer's state views
    (``layer``: its index among the GDN layers, for the verify steps). ``gate_activation``: the output norm's gate
    (Qwen3.5: silu; Qwen4Exp's ``output_gate_type`` may be sigmoid)."""
    N = x.shape[0]
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    mixed, z, b, a = p.in_proj(x)

    def heads(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split((c.key_dim, c.key_dim, c.value_dim), dim=-1)
        T = qkv.shape[0]
        return q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv)

    if plan.verify is not None:
        steps = plan.verify
        o = gdn_verify(mixed, a, b, p.conv, conv, p.A_log, p.dt_bias, recurrent, batch.state_slots,
                       steps.conv[:, :, layer], steps.recurrent[:, :, layer])
    elif plan.decode:
        # Conv update, gates and recurrent step as one op (one launch once its kernel is validated).
        o = gdn_decode_fused(mixed, a, b, p.conv, conv, p.A_log, p.dt_bias, recurrent, batch.state_slots)
    else:
        g, beta = gdn_gates(a, b, p.A_log, p.dt_bias)
        o = mixed.new_empty(N, hv, dv)
        for lo, hi, slot, initial in plan.seqs:
            q, k, v = heads(causal_conv1d_prefill(mixed[lo:hi], p.conv, conv[slot], initial))
            o[lo:hi] = gdn_prefill(q, k, v, g[lo:hi], beta[lo:hi], recurrent[slot], initial)
    o = rms_norm_gated(o, z.reshape(N, hv, dv), p.norm, c.rms_norm_eps, activation=gate_activation)
    return linear(o.reshape(N, c.value_dim), p.out_proj)


def attention_mixer(c: Qwen35Config, p: AttentionParams, x: torch.Tensor, batch: ForwardBatch,
                    rope_inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    rope_axes: torch.Tensor | None = None) -> torch.Tensor:
    """Gated full attention: x [N, H] -> [N, H], writing this batch's K/V into the paged caches first. A batch
    with ``mrope_positions`` rotates at them (``rope_axes``: the row each frequency slot reads)."""
    q, gate = attention_inputs(c, p, x, batch, rope_inv_freq, k_cache, v_cache, rope_axes)
    o = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                        batch.max_query_len, batch.max_seq_len, c.head_dim ** -0.5, gate=gate)
    return linear(o.flatten(1), p.o_proj)


def attention_inputs(c: Qwen35Config, p: AttentionParams, x: torch.Tensor, batch: ForwardBatch,
                     rope_inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rope_axes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated attention's (q [N, heads, D] normed and rotated, its output gate [N, heads, D]) of x [N, H], this
    batch's K/V normed, rotated and written into the paged caches (at ``mrope_positions`` through ``rope_axes``
    when the batch has them)."""
    N, nh, kvh, d = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q_gate, k, v = p.qkv(x)
    q_gate = q_gate.view(N, nh, 2 * d)  # each head's block is [query | gate]
    mrope = batch.mrope_positions is not None
    if mrope and rope_axes is None:
        raise ValueError("attention: a batch with mrope_positions needs rope_axes")
    q = norm_rope_write_kv(q_gate[..., :d], k.view(N, kvh, d), v.view(N, kvh, d), p.q_norm, p.k_norm,
                           c.rms_norm_eps, batch.mrope_positions if mrope else batch.positions, rope_inv_freq,
                           k_cache, v_cache, batch.slot_mapping, axes=rope_axes if mrope else None)
    return q, q_gate[..., d:]


def feed_forward(layer: LayerParams, h: torch.Tensor, x: torch.Tensor, next_norm: torch.Tensor, eps: float,
                 experts: HostExperts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer after its mixer: the mixer's output ``h`` joins the residual stream ``x`` in the post-mixer
    norm, the MLP or MoE block runs, and its output joins in ``next_norm`` (the next layer's input norm or the
    final norm). Returns (normed, residual). A MoE router's projection rides in the post-mixer norm's kernel."""
    if isinstance(layer.mlp, MoEParams):
        h, x, router = add_rms_norm_linear(h, x, layer.post_norm, eps, layer.mlp.router_shared_gate.weight)
    else:
        (h, x), router = add_rms_norm(h, x, layer.post_norm, eps), None
    return add_rms_norm(mlp(layer.mlp, h, experts, router), x, next_norm, eps)


def mlp(p: MLPParams | MoEParams, x: torch.Tensor, experts: HostExperts | None = None,
        router: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's feed-forward: the SwiGLU MLP, or the sparse MoE block (routed experts + the shared expert
    scaled by sigmoid of its gate logit). ``experts``: the runtime of routed experts kept in host memory.
    ``router``: the router's and shared gate's logits [N, E + 1] when the caller computed them. The all-device
    block may return its output as [N, S, H] terms, which the caller's ``add_rms_norm`` adds up."""
    if isinstance(p, MLPParams):
        return linear(_swiglu(x, p.gate_up), p.down)
    split = p.router_shared_gate
    logits, shared_gate = split(x) if router is None else split.parts(router)
    one_matmul = len(p.shared.gate_up.groups) == 1
    if experts is None and one_matmul:
        return moe_block(x, logits, shared_gate, p.gate_up, p.down, p.shared.gate_up.weight, p.shared.down, p.top_k,
                         summed=False)
    weights, ids = moe_route(logits, p.top_k)
    shared = linear(_swiglu(x, p.shared.gate_up), p.shared.down)
    if experts is None:
        return moe_experts(x, p.gate_up, p.down, ids, weights, shared=shared, shared_gate=shared_gate)
    return experts.routed(p.gate_up, x, ids, weights) + torch.sigmoid(shared_gate) * shared


def _swiglu(x: torch.Tensor, gate_up: LinearSplit) -> torch.Tensor:
    """silu(gate) * up; as two matmuls where gate and up are stored apart (FP8 parts that do not fill their
    128-row scale blocks cannot share one weight)."""
    return swiglu(x, gate_up.weight) if len(gate_up.groups) == 1 else silu_and_mul(gate_up.matmul(x))
