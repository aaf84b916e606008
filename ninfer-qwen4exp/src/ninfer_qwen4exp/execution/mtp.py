"""Qwen4ExpMTP: the multi-token-prediction block that drafts the token after next (``mtp.*``), over the wide residual.

For the token at position t it reads the target's residual R_t [S * H] (after the last layer, before the final
hyper-connection mixer) and the next token x_{t+1} (the sampled one, or a draft), and predicts x_{t+2} through
the main model's head, as SGLang's ``qwen4_exp_mtp`` does (hc_count > 1):

    e  = fc_embedding(norm_e(embed(x_{t+1})))                      [H]
    h  = norm_h(R_t)                                               one (1 + w) RMS norm over all S * H
    R' = [fc_hidden(h_s) + e for each stream s]                    [S * H]
    R' -> one indexed-attention layer (hyper-connections, QSA, MoE) -> mtp.hyper_connection_mixer -> lm_head

A chained step feeds the block's own residual (before its mixer) back as R. The layer attends over its own paged
KV and QSA indexer keys, written at the target's positions (the entry at t is built from R_t and x_{t+1}); it has
no recurrent state and no PLE, so a rejected draft's entry is simply overwritten by the next pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch
import torch.nn.functional as F

from ninfer.artifact.weights import WeightSet
from ninfer.ops import hyper_connection_inject, hyper_connection_mix, linear, rms_norm
from ninfer.ops.norm import sum_terms
from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.execution.forward_batch import ForwardBatch
from ninfer_qwen4exp.execution.layers import qsa_attention
from ninfer_qwen4exp.execution.model import Qwen4ExpModel
from ninfer_qwen4exp.execution.parameters import (
    HyperParams,
    IndexerParams,
    Qwen4ExpLayerParams,
    WeightsError,
    _hyper,
    _hyper_tensors,
)
from ninfer_qwen4exp.source_mapping import expected_parameters
from ninfer_qwen35.execution.layers import mlp
from ninfer_qwen35.execution.linear import Weight
from ninfer_qwen35.execution.parameters import WeightBuilder, bank_tensors, check_shapes

if TYPE_CHECKING:
    from ninfer.models.common.moe.host_experts import HostExperts

__all__ = ["Qwen4ExpMTP", "Qwen4ExpMTPParams"]


@attrs.frozen(kw_only=True, eq=False)
class Qwen4ExpMTPParams:
    """The MTP block: the two input norms (the hidden one [S * H] wide), the embedding's and each stream's H -> H
    projections, its indexed-attention layers (``state_index``: the layer's index in the MTP's own KV) and its
    final hyper-connection mixer. Embedding and head are the main model's."""

    pre_fc_norm_embedding: torch.Tensor
    pre_fc_norm_hidden: torch.Tensor
    fc_embedding: Weight
    fc_hidden: Weight
    layers: tuple[Qwen4ExpLayerParams, ...]
    mixer: HyperParams

    @classmethod
    def from_weights(cls, config: Qwen4ExpConfig, weights: WeightSet, dtype: torch.dtype,
                     device: torch.device | str, experts_device: torch.device | str | None = None
                     ) -> Qwen4ExpMTPParams:
        depth = config.base.mtp_num_hidden_layers
        if not depth:
            raise WeightsError("this Qwen4Exp config has no MTP block (mtp_num_hidden_layers is 0)")
        if config.hc_count < 2:  # SGLang's one-stream MTP is Qwen3.5's (one fc over [e; h]): not mapped here
            raise WeightsError(f"the Qwen4Exp MTP block needs hyper-connections (hc_count {config.hc_count})")
        _check_weights(config, weights)
        build = WeightBuilder(config.base, weights, dtype, torch.device(device), experts_device)
        layers = []
        for j in range(depth):
            p = f"mtp.layers.{j}."
            indexer = None
            if config.qsa is not None:
                x = p + "self_attn.indexer."
                indexer = IndexerParams(qk_proj=build.matrix(x + "index_qk_proj.weight"),
                                        q_norm=build.w(x + "q_layernorm.weight"),
                                        k_norm=build.w(x + "k_layernorm.weight"))
            layers.append(Qwen4ExpLayerParams(
                index=j, kind="indexed_attention", state_index=j, mixer=build.attention(p), indexer=indexer,
                mlp=build.ffn(p + "mlp."), attn_hc=_hyper(build, p + "attn_hyper_connection."),
                mlp_hc=_hyper(build, p + "mlp_hyper_connection."), ple=None))
        return cls(pre_fc_norm_embedding=build.w("mtp.pre_fc_norm_embedding.weight"),
                   pre_fc_norm_hidden=build.w("mtp.pre_fc_norm_hidden.weight"),
                   fc_embedding=build.matrix("mtp.fc_embedding.weight"), fc_hidden=build.matrix("mtp.fc_hidden.weight"),
                   layers=tuple(layers), mixer=_hyper(build, "mtp.hyper_connection_mixer.", inject=False))

    def tensors(self) -> list[Weight]:
        out: list[Weight] = [self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.fc_embedding, self.fc_hidden,
                             *_hyper_tensors(self.mixer)]
        for layer in self.layers:
            f, m = layer.mlp, layer.mixer
            out += [*_hyper_tensors(layer.attn_hc), *_hyper_tensors(layer.mlp_hc), *m.qkv.groups, m.q_norm, m.k_norm,
                    m.o_proj, *f.router_shared_gate.groups, f.gate_up, f.down, *f.shared.gate_up.groups, f.shared.down]
            if layer.indexer is not None:
                out += [layer.indexer.qk_proj, layer.indexer.q_norm, layer.indexer.k_norm]
        return out

    def expert_banks(self) -> list[Weight]:
        return bank_tensors(self.layers)


def _check_weights(config: Qwen4ExpConfig, weights: WeightSet) -> None:
    """Raise WeightsError naming every missing or mis-shaped ``mtp.*`` parameter."""
    check_shapes(expected_parameters(config, ("mtp",)), weights, "Qwen4Exp MTP weights")


class Qwen4ExpMTP:
    """The MTP block over its Parameters, sharing the main model's embedding, rotary rates and head."""

    def __init__(self, params: Qwen4ExpMTPParams, model: Qwen4ExpModel) -> None:
        self.params = params
        self.model = model
        self.config = model.config

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, residual: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                index_keys: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
                experts: HostExperts | None = None) -> torch.Tensor:
        """The block's residual [N, S * H] (before its mixer) for every row of ``batch``: ``batch.input_ids`` are
        the next tokens x_{t+1}, ``batch.positions`` the target positions t, ``residual`` [N, S * H] the target's
        (or, chained, this block's) residual at t; ``kv`` / ``index_keys`` hold one KV pair and (with QSA) one
        indexer key cache per MTP layer, written at t; ``experts``: the Program's host experts runtime."""
        c, p = self.config, self.params
        N, S, H = batch.input_ids.shape[0], c.hc_count, c.hidden_size
        if residual.shape != (N, S * H) or len(kv) != len(p.layers) \
                or len(index_keys) != (len(p.layers) if c.qsa is not None else 0):
            raise ValueError(f"Qwen4ExpMTP.forward: residual {tuple(residual.shape)} must be [{N}, {S * H}], with "
                             f"{len(p.layers)} KV caches (got {len(kv)}) and as many indexer key caches with QSA "
                             f"(got {len(index_keys)})")
        eps = c.base.rms_norm_eps
        e = linear(rms_norm(F.embedding(batch.input_ids, self.model.params.embed), p.pre_fc_norm_embedding, eps),
                   p.fc_embedding)
        h = rms_norm(residual, p.pre_fc_norm_hidden, eps).view(N * S, H)
        x = (linear(h, p.fc_hidden).view(N, S, H) + e.unsqueeze(1)).flatten(1)
        for layer in p.layers:
            h, inject = self._mix(x, layer.attn_hc)
            k_cache, v_cache = kv[layer.state_index]
            h = qsa_attention(c, layer.mixer, layer.indexer, h, batch, self.model.rope_inv_freq, k_cache, v_cache,
                              index_keys[layer.state_index] if c.qsa is not None else None)
            x = hyper_connection_inject(x, h, inject)
            h, inject = self._mix(x, layer.mlp_hc)
            h = mlp(layer.mlp, h, experts)
            x = hyper_connection_inject(x, sum_terms(h) if h.dim() == 3 else h, inject)
        return x

    def logits(self, residual: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, V] of the token after next, from the block's residual rows through its mixer and the
        main model's head."""
        return self.model.logits(self._mix(residual, self.params.mixer)[0])

    def _mix(self, x: torch.Tensor, h: HyperParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hyper_connection_mix(x, h.norm, h.down, h.up, h.inject, self.config.hc_count,
                                    self.config.base.rms_norm_eps)
