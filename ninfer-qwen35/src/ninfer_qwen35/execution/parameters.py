"""Native Parameters of Qwen3.5: the bound weights arranged per layer once, in the model dtype.

Prepared once from a WeightSet; planning (resident bytes) and execution read the same object.
Matrices stay views of the artifact's parents when dtype and device already match; the small fp32
gate parameters (A_log, dt_bias) are kept in fp32 because the gates are computed in fp32. A quantized
matrix (FP8, NVFP4) keeps its stored planes and gets the executable path its activation permit
(``source_mapping.activation_permit``) and the device allow (``ninfer.models.common.quantized``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ninfer.artifact.weights import WeightSet
from ninfer.contract.quant import A16_ONLY, intersect
from ninfer.core.device_plan import resident_bytes
from ninfer.models.common.quantized import executable
from ninfer.ops.quant import QuantizedWeight
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.execution.linear import LinearSplit, Weight
from ninfer_qwen35.source_mapping import activation_permit, expected_parameters, vision_parameters


class WeightsError(ValueError):
    """The bound weights do not match what the config requires."""


@attrs.frozen(kw_only=True, eq=False)
class MLPParams:
    gate_up: LinearSplit      # [gate; up] -> silu_and_mul
    down: Weight


@attrs.frozen(kw_only=True, eq=False)
class MoEParams:
    """The sparse MoE block: the router and the shared expert's gate in one matmul (``router_shared_gate``:
    [E routing logits | 1 gate logit]), the routed experts as fused banks (``gate_up`` [E, 2I, H], ``down``
    [E, H, I]), the shared SwiGLU expert."""

    router_shared_gate: LinearSplit
    gate_up: Weight
    down: Weight
    shared: MLPParams
    top_k: int


@attrs.frozen(kw_only=True, eq=False)
class GDNParams:
    in_proj: LinearSplit      # qkv (conv input), z (output gate), b (beta logits), a (decay input)
    conv: torch.Tensor        # [conv_dim, K]
    A_log: torch.Tensor       # [HV] fp32
    dt_bias: torch.Tensor     # [HV] fp32
    norm: torch.Tensor        # [Dv], plain weight of the gated RMSNorm
    out_proj: Weight


@attrs.frozen(kw_only=True, eq=False)
class AttentionParams:
    qkv: LinearSplit          # q (per head [query | gate]), k, v
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: Weight


@attrs.frozen(kw_only=True, eq=False)
class LayerParams:
    index: int
    kind: str                 # "linear_attention" or "full_attention"
    state_index: int          # index among the GDN layers (StateImage) or the attention layers (KV pool)
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: GDNParams | AttentionParams
    mlp: MLPParams | MoEParams


@attrs.frozen(kw_only=True, eq=False)
class Qwen35Parameters:
    config: Qwen35Config
    dtype: torch.dtype
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: Weight           # the embedding itself when tied
    layers: tuple[LayerParams, ...]

    @classmethod
    def from_weights(cls, config: Qwen35Config, weights: WeightSet, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None,
                     experts_device: torch.device | str | None = None) -> Qwen35Parameters:
        """``experts_device``: where the MoE routed expert banks live (default ``device``; "cpu" for host experts)."""
        check_weights(config, weights)
        dtype = dtype if dtype is not None else weights["model.embed_tokens.weight"].dtype
        device = torch.device(device) if device is not None else weights["model.embed_tokens.weight"].device

        build = WeightBuilder(config, weights, dtype, device, experts_device)
        w, split = build.w, build.split
        layers = []
        gdn_index = {i: n for n, i in enumerate(config.gdn_layers)}
        attn_index = {i: n for n, i in enumerate(config.attention_layers)}
        for i, kind in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            mixer: GDNParams | AttentionParams
            if kind == "linear_attention":
                a = p + "linear_attn."
                mixer = GDNParams(
                    in_proj=split([a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight",
                                   a + "in_proj_a.weight"]),
                    conv=w(a + "conv1d.weight")[:, 0, :], A_log=w(a + "A_log", torch.float32),
                    dt_bias=w(a + "dt_bias", torch.float32), norm=w(a + "norm.weight"),
                    out_proj=build.matrix(a + "out_proj.weight"))
                state_index = gdn_index[i]
            else:
                mixer = build.attention(p)
                state_index = attn_index[i]
            layers.append(build.layer(p, index=i, kind=kind, state_index=state_index, mixer=mixer))
        embed = w("model.embed_tokens.weight")
        head = embed if config.tie_word_embeddings else build.matrix("lm_head.weight")
        return cls(config=config, dtype=dtype, embed=embed, final_norm=w("model.norm.weight"), lm_head=head,
                   layers=tuple(layers))

    def tensors(self) -> list[torch.Tensor]:
        return [self.embed, self.final_norm, self.lm_head, *_layer_tensors(self.layers)]

    def expert_banks(self) -> list[torch.Tensor]:
        """The routed experts' banks of every MoE layer (what a host-experts placement keeps on the host)."""
        return bank_tensors(self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages behind the parameters (a tied head or shared parent counts once)."""
        return resident_bytes(self.tensors())


@attrs.frozen(kw_only=True, eq=False)
class MTPParams:
    """The MTP block (``mtp.*``): two input norms, the 2H -> H projection, its full-attention layers, the norm
    before the shared head. Embedding and head are the main model's."""

    pre_fc_norm_embedding: torch.Tensor
    pre_fc_norm_hidden: torch.Tensor
    fc: Weight
    layers: tuple[LayerParams, ...]  # state_index: the layer's index in the MTP's own KV pool
    norm: torch.Tensor

    @classmethod
    def from_weights(cls, config: Qwen35Config, weights: WeightSet, dtype: torch.dtype,
                     device: torch.device | str, experts_device: torch.device | str | None = None) -> MTPParams:
        if not config.mtp_num_hidden_layers:
            raise WeightsError("this Qwen3.5 config has no MTP block (mtp_num_hidden_layers is 0)")
        check_weights(config, weights, ("mtp",))
        build = WeightBuilder(config, weights, dtype, torch.device(device), experts_device)
        layers = tuple(build.layer(f"mtp.layers.{j}.", index=j, kind="full_attention", state_index=j,
                                   mixer=build.attention(f"mtp.layers.{j}."))
                       for j in range(config.mtp_num_hidden_layers))
        return cls(pre_fc_norm_embedding=build.w("mtp.pre_fc_norm_embedding.weight"),
                   pre_fc_norm_hidden=build.w("mtp.pre_fc_norm_hidden.weight"), fc=build.matrix("mtp.fc.weight"),
                   layers=layers, norm=build.w("mtp.norm.weight"))

    def tensors(self) -> list[torch.Tensor]:
        return [self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.fc, self.norm, *_layer_tensors(self.layers)]

    def expert_banks(self) -> list[torch.Tensor]:
        return bank_tensors(self.layers)


def bank_tensors(layers: tuple[LayerParams, ...]) -> list[Weight]:
    return [t for layer in layers if isinstance(layer.mlp, MoEParams) for t in (layer.mlp.gate_up, layer.mlp.down)]


def _layer_tensors(layers: tuple[LayerParams, ...]) -> list[Weight]:
    """Every prepared weight of the layers (a quantized one as itself: ``resident_bytes`` counts its planes)."""
    out: list[Weight] = []
    for layer in layers:
        out += [layer.input_norm, layer.post_norm]
        f = layer.mlp
        if isinstance(f, MoEParams):
            out += [*f.router_shared_gate.groups, f.gate_up, f.down, *f.shared.gate_up.groups, f.shared.down]
        else:
            out += [*f.gate_up.groups, f.down]
        m = layer.mixer
        if isinstance(m, GDNParams):
            out += [*m.in_proj.groups, m.conv, m.A_log, m.dt_bias, m.norm, m.out_proj]
        else:
            out += [*m.qkv.groups, m.q_norm, m.k_norm, m.o_proj]
    return out


class WeightBuilder:
    """Per-layer parameter groups from bound weights, in one dtype on one device (main layers and MTP alike)."""

    def __init__(self, config: Qwen35Config, weights: WeightSet, dtype: torch.dtype, device: torch.device,
                 experts_device: torch.device | str | None = None) -> None:
        self.config, self.weights, self.dtype, self.device = config, weights, dtype, device
        self.experts_device = torch.device(experts_device) if experts_device is not None else device

    def w(self, name: str, as_dtype: torch.dtype | None = None, device: torch.device | None = None) -> torch.Tensor:
        return self.weights[name].to(device=device or self.device, dtype=as_dtype or self.dtype)

    def matrix(self, name: str) -> Weight:
        """A linear's weight: in the model dtype, or quantized as stored with its executable path."""
        t = self.weights[name]
        if isinstance(t, QuantizedWeight):
            return executable(name, t.to(self.device), activation_permit(name), self.device)
        return t.to(device=self.device, dtype=self.dtype)

    def bank(self, name: str) -> Weight:
        """A routed expert bank where the experts live; a host bank beside a CUDA model is pinned (its uploads
        and copies run asynchronously), also when the compute dtype made it a copy of the artifact's parent."""
        q = self.weights[name]
        if isinstance(q, QuantizedWeight):
            if self.experts_device != self.device:
                raise ValueError(f"{name}: a quantized expert bank runs on the model's device; host experts take "
                                 f"bf16 banks")
            return executable(name, q.to(self.device), A16_ONLY, self.device)
        t = self.w(name, device=self.experts_device)
        if t.device.type == "cpu" and self.device.type == "cuda" and not t.is_pinned():
            t = t.pin_memory()
        return t

    def split(self, names: list[str]) -> LinearSplit:
        """One LinearSplit; each quantized matmul of it gets the intersection of its parts' permits."""
        s = LinearSplit.from_weights(self.weights, names, self.dtype, self.device)
        if not any(isinstance(g, QuantizedWeight) for g in s.groups):
            return s
        return s.with_groups([executable(", ".join(members), g, intersect(map(activation_permit, members)),
                                         self.device) if isinstance(g, QuantizedWeight) else g
                              for g, members in zip(s.groups, s.members, strict=True)])

    def attention(self, prefix: str) -> AttentionParams:
        a = prefix + "self_attn."
        return AttentionParams(qkv=self.split([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                               q_norm=self.w(a + "q_norm.weight"), k_norm=self.w(a + "k_norm.weight"),
                               o_proj=self.matrix(a + "o_proj.weight"))

    def layer(self, prefix: str, *, index: int, kind: str, state_index: int,
              mixer: GDNParams | AttentionParams) -> LayerParams:
        return LayerParams(
            index=index, kind=kind, state_index=state_index, input_norm=self.w(prefix + "input_layernorm.weight"),
            post_norm=self.w(prefix + "post_attention_layernorm.weight"), mixer=mixer, mlp=self.ffn(prefix + "mlp."))

    def ffn(self, m: str) -> MLPParams | MoEParams:
        if self.config.moe is None:
            return self.swiglu(m)
        return MoEParams(router_shared_gate=self.split([m + "gate.weight", m + "shared_expert_gate.weight"]),
                         gate_up=self.bank(m + "experts.gate_up_proj"), down=self.bank(m + "experts.down_proj"),
                         shared=self.swiglu(m + "shared_expert."), top_k=self.config.moe.num_experts_per_tok)

    def swiglu(self, m: str) -> MLPParams:
        return MLPParams(gate_up=self.split([m + "gate_proj.weight", m + "up_proj.weight"]),
                         down=self.matrix(m + "down_proj.weight"))


def check_weights(config: Qwen35Config, weights: WeightSet, features: tuple[str, ...] = ("text",)) -> None:
    """Raise WeightsError naming every missing or mis-shaped parameter of ``features``."""
    expected = expected_parameters(config, features)
    if "vision" in features:
        expected.update(vision_parameters(config))
    check_shapes(expected, weights, f"Qwen3.5 {'/'.join(features)} weights")


def check_shapes(expected: dict[str, tuple[Any, tuple[int, ...]]], weights: WeightSet, what: str) -> None:
    """Raise WeightsError naming every parameter of ``expected`` ({name: (dtype, shape)}, a source mapping's) that
    ``weights`` lacks or holds in another shape (the first eight of each); ``what`` names them in the message."""
    missing, wrong = [], []
    for name, (_, shape) in expected.items():
        if name not in weights:
            missing.append(name)
        elif tuple(weights[name].shape) != shape:
            wrong.append(f"{name} {tuple(weights[name].shape)} (want {shape})")
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if wrong:
            parts.append(f"{len(wrong)} with the wrong shape: {', '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}")
        raise WeightsError(f"{what} do not match the config: " + "; ".join(parts))
