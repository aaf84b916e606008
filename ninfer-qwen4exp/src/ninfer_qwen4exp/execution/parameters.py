"""Native Parameters of Qwen4Exp: the bound weights arranged per layer once, in the compute dtype.

The parts Qwen4Exp shares with Qwen3.5 (Gated DeltaNet, gated attention, the sparse MoE block) are built by
Qwen3.5's builder over ``config.base``; what is Qwen4Exp's own is added here: each layer's two hyper-connections,
the final mixer, the QSA indexer of the attention layers and the PLE of some GDN layers. There are no input or
post-attention norms and no final norm (the hyper-connections normalise). A PLE layer's n-gram table stays where
the weights keep it (host memory for the published size): only the rows a batch looks up are moved. The hash
constants of each PLE layer are derived from the config, as transformers derives them (not read from the
checkpoint's buffers).
"""

from __future__ import annotations

import attrs
import torch

from ninfer.artifact.weights import WeightSet
from ninfer.core.device_plan import resident_bytes
from ninfer.ops.ple import ngram_multipliers
from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.source_mapping import expected_parameters
from ninfer_qwen35.execution.linear import Weight
from ninfer_qwen35.execution.parameters import (
    AttentionParams,
    GDNParams,
    MoEParams,
    WeightBuilder,
    WeightsError,
    bank_tensors,
    check_shapes,
)

__all__ = ["HyperParams", "IndexerParams", "PLEParams", "Qwen4ExpLayerParams", "Qwen4ExpParameters", "WeightsError"]


@attrs.frozen(kw_only=True, eq=False)
class HyperParams:
    """One gated residual of the hyper-connections: the grouped norm, the low-rank mix (down [R, S*H], up
    [S*H, R]) and the per-stream injection [S, S*H] (None for the final mixer)."""

    norm: torch.Tensor
    down: Weight
    up: Weight
    inject: Weight | None


@attrs.frozen(kw_only=True, eq=False)
class IndexerParams:
    """The QSA indexer of an attention layer: one projection to [query heads | the one key head], the query
    heads' norm and the pooled block keys' norm."""

    qk_proj: Weight
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@attrs.frozen(kw_only=True, eq=False)
class PLEParams:
    """A PLE layer: its n-gram table (where the weights keep it), the hash constants of its heads, the key /
    value projections, the three grouped norms and the depthwise conv [S*H, K]."""

    state_index: int          # the layer's index among the PLE layers (its row of the PLE conv state)
    table: torch.Tensor
    multipliers: torch.Tensor  # [ngram_size] int64
    head_vocab: torch.Tensor   # [heads] int64, prime
    head_offsets: torch.Tensor  # [heads] int64
    key_proj: Weight
    value_proj: Weight
    norm_key: torch.Tensor
    norm_query: torch.Tensor
    norm_conv: torch.Tensor
    conv: torch.Tensor


@attrs.frozen(kw_only=True, eq=False)
class Qwen4ExpLayerParams:
    index: int
    kind: str                 # "linear_attention" or "indexed_attention"
    state_index: int          # index among the GDN layers (StateImage) or the attention layers (KV pool)
    mixer: GDNParams | AttentionParams
    indexer: IndexerParams | None
    mlp: MoEParams
    attn_hc: HyperParams
    mlp_hc: HyperParams
    ple: PLEParams | None


@attrs.frozen(kw_only=True, eq=False)
class Qwen4ExpParameters:
    config: Qwen4ExpConfig
    dtype: torch.dtype
    embed: torch.Tensor
    lm_head: Weight           # the embedding itself when tied
    mixer: HyperParams        # the final hyper-connection mixer
    layers: tuple[Qwen4ExpLayerParams, ...]

    @classmethod
    def from_weights(cls, config: Qwen4ExpConfig, weights: WeightSet, compute_dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None,
                     experts: torch.device | str | None = None) -> Qwen4ExpParameters:
        """``experts``: where the MoE routed expert banks live (default ``device``; "cpu" for host experts)."""
        check_weights(config, weights)
        embed_name = "model.embed_tokens.weight"
        dtype = compute_dtype if compute_dtype is not None else weights[embed_name].dtype
        device = torch.device(device) if device is not None else weights[embed_name].device
        build = WeightBuilder(config.base, weights, dtype, device, experts)
        gdn_index = {i: n for n, i in enumerate(config.gdn_layers)}
        attn_index = {i: n for n, i in enumerate(config.attention_layers)}
        ple_index = {i: n for n, i in enumerate(config.ple_layers)}
        layers = []
        for i, kind in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            mixer: GDNParams | AttentionParams
            indexer = None
            if kind == "linear_attention":
                a = p + "linear_attn."
                mixer = GDNParams(
                    in_proj=build.split([a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight",
                                         a + "in_proj_a.weight"]),
                    conv=build.w(a + "conv1d.weight")[:, 0, :], A_log=build.w(a + "A_log", torch.float32),
                    dt_bias=build.w(a + "dt_bias", torch.float32), norm=build.w(a + "norm.weight"),
                    out_proj=build.matrix(a + "out_proj.weight"))
                state_index = gdn_index[i]
            else:
                mixer = build.attention(p)
                if config.qsa is not None:
                    x = p + "self_attn.indexer."
                    indexer = IndexerParams(qk_proj=build.matrix(x + "index_qk_proj.weight"),
                                            q_norm=build.w(x + "q_layernorm.weight"),
                                            k_norm=build.w(x + "k_layernorm.weight"))
                state_index = attn_index[i]
            ple = _ple(config, build, p + "ple.", ple_index[i]) if i in ple_index else None
            layers.append(Qwen4ExpLayerParams(
                index=i, kind=kind, state_index=state_index, mixer=mixer, indexer=indexer, mlp=build.ffn(p + "mlp."),
                attn_hc=_hyper(build, p + "attn_hyper_connection."),
                mlp_hc=_hyper(build, p + "mlp_hyper_connection."), ple=ple))
        embed = build.w(embed_name)
        head = embed if config.base.tie_word_embeddings else build.matrix("lm_head.weight")
        return cls(config=config, dtype=dtype, embed=embed, lm_head=head,
                   mixer=_hyper(build, "model.hyper_connection_mixer.", inject=False), layers=tuple(layers))

    def tensors(self) -> list[Weight]:
        """Every prepared weight (the n-gram tables and routed expert banks included)."""
        out: list[Weight] = [self.embed, self.lm_head, *_hyper_tensors(self.mixer)]
        for layer in self.layers:
            out += [*_hyper_tensors(layer.attn_hc), *_hyper_tensors(layer.mlp_hc)]
            f = layer.mlp
            out += [*f.router_shared_gate.groups, f.gate_up, f.down, *f.shared.gate_up.groups, f.shared.down]
            m = layer.mixer
            if isinstance(m, GDNParams):
                out += [*m.in_proj.groups, m.conv, m.A_log, m.dt_bias, m.norm, m.out_proj]
            else:
                out += [*m.qkv.groups, m.q_norm, m.k_norm, m.o_proj]
            if layer.indexer is not None:
                out += [layer.indexer.qk_proj, layer.indexer.q_norm, layer.indexer.k_norm]
            if layer.ple is not None:
                e = layer.ple
                out += [e.table, e.multipliers, e.head_vocab, e.head_offsets, e.key_proj, e.value_proj, e.norm_key,
                        e.norm_query, e.norm_conv, e.conv]
        return out

    def expert_banks(self) -> list[Weight]:
        """The routed experts' banks of every MoE layer (what a host-experts placement keeps on the host)."""
        return bank_tensors(self.layers)

    def ngram_tables(self) -> list[torch.Tensor]:
        """The PLE layers' n-gram tables (kept where the weights put them; only looked-up rows move)."""
        return [layer.ple.table for layer in self.layers if layer.ple is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages behind the parameters (a tied head or shared parent counts once)."""
        return resident_bytes(self.tensors())


def _hyper(build: WeightBuilder, prefix: str, inject: bool = True) -> HyperParams:
    return HyperParams(norm=build.w(prefix + "hc_norm.weight"), down=build.matrix(prefix + "input_mix_weight_down.weight"),
                       up=build.matrix(prefix + "input_mix_weight_up.weight"),
                       inject=build.matrix(prefix + "block_inject_weight.weight") if inject else None)


def _hyper_tensors(h: HyperParams) -> list[Weight]:
    return [h.norm, h.down, h.up, *([h.inject] if h.inject is not None else [])]


def _ple(config: Qwen4ExpConfig, build: WeightBuilder, prefix: str, index: int) -> PLEParams:
    e, device = config.ple, build.device

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PLEParams(
        state_index=index, table=build.weights[prefix + "ple_embedding.ngram_embedding.weight"],
        multipliers=ints(ngram_multipliers(config.base.vocab_size, e.ngram_size, index, e.seed)),
        head_vocab=ints(e.head_vocab_sizes(index)), head_offsets=ints(e.head_offsets(index)),
        key_proj=build.matrix(prefix + "key_proj.weight"), value_proj=build.matrix(prefix + "value_proj.weight"),
        norm_key=build.w(prefix + "norm_key.weight"), norm_query=build.w(prefix + "norm_query.weight"),
        norm_conv=build.w(prefix + "norm_conv.weight"), conv=build.w(prefix + "conv1d.weight")[:, 0, :])


def check_weights(config: Qwen4ExpConfig, weights: WeightSet) -> None:
    """Raise WeightsError naming every missing or mis-shaped text parameter (the source mapping's shapes)."""
    check_shapes(expected_parameters(config, ("text",)), weights, "Qwen4Exp text weights")
