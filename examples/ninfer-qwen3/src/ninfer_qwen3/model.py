"""Qwen3 Parameters (the artifact's bound weights arranged per layer) and the forward over a paged KV cache.

Every layer is attention: RMSNorm (plain weight) -> q/k/v (one fused matmul) -> per-head q/k RMSNorm ->
rotary embedding over the whole head -> K/V stored in the paged cache -> causal paged attention -> o_proj,
then RMSNorm -> SwiGLU MLP. The cache of layer i is ``views.kv[i] = (k_cache, v_cache)``, each
[num_pages, page_size, kv_heads, head_dim], addressed by the batch's ``block_tables`` and ``slot_mapping``.
Qwen3 keeps no recurrent state, so its StateImage has no fields.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch
import torch.nn.functional as F

from ninfer.contract import KVPoolSpec
from ninfer.core.forward_batch import ForwardBatch, PagedKVViews
from ninfer.models.common.weights import WeightSet
from ninfer.ops import (
    add_rms_norm,
    apply_rope,
    linear,
    paged_attention,
    rms_norm,
    rope_cos_sin,
    swiglu,
    write_kv,
)
from ninfer_qwen3.config import Qwen3Config
from ninfer_qwen3.source_mapping import EMBED, parameter_shapes


def kv_pool(config: Qwen3Config, *, page_size: int = 16, dtype: str = "bfloat16") -> KVPoolSpec:
    """One paged KV pool ``main`` shared by all layers."""
    return KVPoolSpec(name="main", layers=config.num_hidden_layers, kv_heads=config.num_key_value_heads,
                      head_dim=config.head_dim, dtype=dtype, page_size=page_size)


@attrs.frozen(kw_only=True, eq=False)
class LayerParams:
    input_norm: torch.Tensor
    qkv: torch.Tensor         # [q; k; v] rows
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor     # [gate; up] rows, for swiglu
    down: torch.Tensor


@attrs.frozen(kw_only=True, eq=False)
class Qwen3Parameters:
    config: Qwen3Config
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor     # the embedding itself when tied
    layers: tuple[LayerParams, ...]

    @classmethod
    def from_weights(cls, config: Qwen3Config, weights: WeightSet, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> Qwen3Parameters:
        wrong = [f"{name} {tuple(weights[name].shape) if name in weights else 'missing'} (want {shape})"
                 for name, shape in parameter_shapes(config).items()
                 if name not in weights or tuple(weights[name].shape) != shape]
        if wrong:
            raise ValueError(f"Qwen3 weights do not match the config: {'; '.join(wrong[:8])}")
        dtype = dtype or weights[EMBED].dtype
        device = device or weights[EMBED].device

        def w(*names: str) -> torch.Tensor:  # fused names stay one view of the artifact's parent when stored so
            t = weights.fused(list(names)) if len(names) > 1 else weights[names[0]]
            t = torch.cat([weights[n] for n in names]) if t is None else t
            return t.to(device=device, dtype=dtype)

        layers = tuple(LayerParams(
            input_norm=w(p + "input_layernorm.weight"),
            qkv=w(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
            q_norm=w(p + "self_attn.q_norm.weight"), k_norm=w(p + "self_attn.k_norm.weight"),
            o_proj=w(p + "self_attn.o_proj.weight"), post_norm=w(p + "post_attention_layernorm.weight"),
            gate_up=w(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), down=w(p + "mlp.down_proj.weight"))
            for p in (f"model.layers.{i}." for i in range(config.num_hidden_layers)))
        embed = w(EMBED)
        return cls(config=config, embed=embed, final_norm=w("model.norm.weight"), layers=layers,
                   lm_head=embed if config.tie_word_embeddings else w("lm_head.weight"))

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (self.embed, self.final_norm, self.lm_head)
        for layer in self.layers:
            yield from attrs.astuple(layer, recurse=False)


class Qwen3Model:
    """The fixed model calls over prepared Parameters; K/V live in the caches passed in."""

    def __init__(self, params: Qwen3Parameters) -> None:
        self.params = params
        self.config = params.config

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, views: PagedKVViews) -> torch.Tensor:
        """Final-normed hidden [N, H] of every new token of ``batch``; writes their K/V into ``views``."""
        c, p, eps, kv = self.config, self.params, self.config.rms_norm_eps, views.kv
        if len(kv) != c.num_hidden_layers:
            raise ValueError(f"{len(kv)} KV caches given for {c.num_hidden_layers} layers")
        x = F.embedding(batch.input_ids, p.embed)  # the residual stream
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, x.dtype)
        h = rms_norm(x, p.layers[0].input_norm, eps, one_plus=False)
        next_norms = [layer.input_norm for layer in p.layers[1:]] + [p.final_norm]
        for layer, (k_cache, v_cache), next_norm in zip(p.layers, kv, next_norms, strict=True):
            h = self._attention(layer, h, batch, cos, sin, k_cache, v_cache)
            h, x = add_rms_norm(h, x, layer.post_norm, eps, one_plus=False)
            h, x = add_rms_norm(linear(swiglu(h, layer.gate_up), layer.down), x, next_norm, eps, one_plus=False)
        return h

    def _attention(self, layer: LayerParams, h: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        c, N, d = self.config, h.shape[0], self.config.head_dim
        nh, kvh = c.num_attention_heads, c.num_key_value_heads
        q, k, v = linear(h, layer.qkv).split((nh * d, kvh * d, kvh * d), dim=-1)
        # Qwen3's RMSNorm multiplies by w (Qwen3.5's by 1 + w), so the fused norm_rope_write_kv does not apply.
        q = apply_rope(rms_norm(q.reshape(N, nh, d), layer.q_norm, c.rms_norm_eps, one_plus=False), cos, sin, d)
        k = apply_rope(rms_norm(k.reshape(N, kvh, d), layer.k_norm, c.rms_norm_eps, one_plus=False), cos, sin, d)
        write_kv(k, v.reshape(N, kvh, d), k_cache, v_cache, batch.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                            batch.max_query_len, batch.max_seq_len, d ** -0.5)
        return linear(o.reshape(N, nh * d), layer.o_proj)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, V] for final-normed hidden rows [M, H]."""
        return linear(hidden, self.params.lm_head, out_dtype=torch.float32)
