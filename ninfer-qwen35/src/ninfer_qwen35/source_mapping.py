"""Qwen3.5 source mapping: Hugging Face tensor names -> logical parameters, features and fused parents.

Logical names are the flat text-only Hugging Face names (``model.layers.{i}...``, ``lm_head.weight``),
``mtp.*`` for the MTP block and ``visual.*`` for the vision tower. The official VL checkpoints name the
language model ``model.language_model.*`` and the vision tower ``model.visual.*``.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ninfer.artifact.mapping import StackedSource
from ninfer.artifact.weights import FusedParent
from ninfer.contract.quant import A16_ONLY, ALLOW_A4, ALLOW_A8
from ninfer_qwen35.config import Qwen35Config

FEATURES = ("text", "vision", "mtp")


def canonical_name(hf_name: str) -> tuple[str, str] | None:
    """(feature, logical name) for a checkpoint tensor name, or None for names the model does not use."""
    if hf_name.startswith("model.language_model."):
        return "text", "model." + hf_name[len("model.language_model."):]
    if hf_name.startswith("model.visual."):
        return "vision", "visual." + hf_name[len("model.visual."):]
    if hf_name.startswith("visual."):
        return "vision", hf_name
    if hf_name.startswith("mtp."):
        return "mtp", hf_name
    if hf_name.startswith("model.") or hf_name == "lm_head.weight":
        return "text", hf_name
    return None


# Activation permits of the linears (a quantized weight's input precision; ninfer.contract.quant). The gate inputs of
# GDN (in_proj_b / in_proj_a: beta and decay), the router and shared-expert gate, the MTP's fc and the head feed
# softmaxes, sigmoids and exponentials where an FP8 input's rounding is amplified: A16 only. The MLPs tolerate
# coarser inputs than attention and GDN's projections.
_A16_ONLY = re.compile(r"(in_proj_[ab]|mlp\.gate|shared_expert_gate|mtp\.fc|lm_head|embed_tokens)\.weight$")
_ALLOW_A4 = re.compile(r"mlp\.(shared_expert\.)?(gate_proj|up_proj|down_proj)\.weight$|mlp\.experts\.")


def activation_permit(name: str) -> frozenset[str]:
    """The activation permit of the linear ``name`` (a logical parameter name)."""
    if _A16_ONLY.search(name):
        return A16_ONLY
    return ALLOW_A4 if _ALLOW_A4.search(name) else ALLOW_A8


def _ffn_names(m: str, c: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """A layer's MLP: the dense SwiGLU, or the sparse MoE block (router ``gate``, the routed experts as the
    published fused banks ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I], the shared
    expert and its gate)."""
    H = c.hidden_size
    if c.moe is None:
        return {m + "gate_proj.weight": (c.intermediate_size, H), m + "up_proj.weight": (c.intermediate_size, H),
                m + "down_proj.weight": (H, c.intermediate_size)}
    E, inter, shared = c.moe.num_experts, c.moe.moe_intermediate_size, c.moe.shared_expert_intermediate_size
    return {m + "gate.weight": (E, H), m + "experts.gate_up_proj": (E, 2 * inter, H),
            m + "experts.down_proj": (E, H, inter), m + "shared_expert.gate_proj.weight": (shared, H),
            m + "shared_expert.up_proj.weight": (shared, H), m + "shared_expert.down_proj.weight": (H, shared),
            m + "shared_expert_gate.weight": (1, H)}


def layer_names(prefix: str, kind: str, c: Qwen35Config) -> dict[str, tuple[int, ...]]:
    H = c.hidden_size
    names: dict[str, tuple[int, ...]] = {
        f"{prefix}input_layernorm.weight": (H,),
        f"{prefix}post_attention_layernorm.weight": (H,),
        **_ffn_names(f"{prefix}mlp.", c),
    }
    if kind == "linear_attention":
        a = f"{prefix}linear_attn."
        hv = c.linear_num_value_heads
        names.update({
            a + "in_proj_qkv.weight": (c.conv_dim, H),
            a + "in_proj_z.weight": (c.value_dim, H),
            a + "in_proj_b.weight": (hv, H),
            a + "in_proj_a.weight": (hv, H),
            a + "conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim),
            a + "dt_bias": (hv,),
            a + "A_log": (hv,),
            a + "norm.weight": (c.linear_value_head_dim,),
            a + "out_proj.weight": (H, c.value_dim),
        })
    else:
        a = f"{prefix}self_attn."
        d = c.head_dim
        names.update({
            a + "q_proj.weight": (2 * c.num_attention_heads * d, H),
            a + "k_proj.weight": (c.num_key_value_heads * d, H),
            a + "v_proj.weight": (c.num_key_value_heads * d, H),
            a + "o_proj.weight": (H, c.num_attention_heads * d),
            a + "q_norm.weight": (d,),
            a + "k_norm.weight": (d,),
        })
    return names


def expected_parameters(c: Qwen35Config, features: tuple[str, ...] = ("text",)) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Logical name -> (feature, shape) of every parameter the selected features need (text and mtp)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    H = c.hidden_size
    if "text" in features:
        out["model.embed_tokens.weight"] = ("text", (c.vocab_size, H))
        out["model.norm.weight"] = ("text", (H,))
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = ("text", (c.vocab_size, H))
        for i, kind in enumerate(c.layer_types):
            for n, shape in layer_names(f"model.layers.{i}.", kind, c).items():
                out[n] = ("text", shape)
    if "mtp" in features and c.mtp_num_hidden_layers:
        out["mtp.fc.weight"] = ("mtp", (H, 2 * H))
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{n}.weight"] = ("mtp", (H,))
        for j in range(c.mtp_num_hidden_layers):
            for n, shape in layer_names(f"mtp.layers.{j}.", "full_attention", c).items():
                out[n] = ("mtp", shape)
    return out


# HF Qwen3_5VisionConfig defaults, for keys a config.json leaves out.
_VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "in_channels": 3, "patch_size": 16,
                    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304}


def vision_parameters(c: Qwen35Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Logical name -> ("vision", shape) of the vision tower (qwen35_arch.md section 3), from config.vision."""
    if not c.vision:
        return {}
    v = {**_VISION_DEFAULTS, **c.vision}
    h, inter = v["hidden_size"], v["intermediate_size"]
    out_h = v.get("out_hidden_size", c.hidden_size)
    merged = h * v["spatial_merge_size"] ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "visual.patch_embed.proj.weight": (h, v["in_channels"], v["temporal_patch_size"], v["patch_size"],
                                           v["patch_size"]),
        "visual.patch_embed.proj.bias": (h,),
        "visual.pos_embed.weight": (v["num_position_embeddings"], h),
        "visual.merger.norm.weight": (h,), "visual.merger.norm.bias": (h,),
        "visual.merger.linear_fc1.weight": (merged, merged), "visual.merger.linear_fc1.bias": (merged,),
        "visual.merger.linear_fc2.weight": (out_h, merged), "visual.merger.linear_fc2.bias": (out_h,),
    }
    for j in range(v["depth"]):
        b = f"visual.blocks.{j}."
        shapes.update({
            b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,), b + "norm2.bias": (h,),
            b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
            b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
            b + "mlp.linear_fc1.weight": (inter, h), b + "mlp.linear_fc1.bias": (inter,),
            b + "mlp.linear_fc2.weight": (h, inter), b + "mlp.linear_fc2.bias": (h,),
        })
    return {n: ("vision", shape) for n, shape in shapes.items()}


# A per-expert routed-expert tensor (fine-tunes, Qwen3-MoE-style exports): group 1 is the layer's ``...experts.``.
_PER_EXPERT = re.compile(r"^(.+\.mlp\.experts\.)\d+\.(?:gate|up|down)_proj\.weight$")


def stacked_sources(c: Qwen35Config, source_names: Collection[str]) -> list[StackedSource]:
    """Per-expert tensors stacked into the published fused banks: ``experts.gate_up_proj`` [E, 2I, H] is, per
    expert, gate rows then up rows; ``experts.down_proj`` [E, H, I] is the experts' down_proj in order."""
    prefixes = sorted({m.group(1) for n in source_names if (m := _PER_EXPERT.match(n))})
    if c.moe is None or not prefixes:
        return []  # a dense config: per-expert names are refused as not part of the model
    E, inter, H = c.moe.num_experts, c.moe.moe_intermediate_size, c.hidden_size
    groups: list[StackedSource] = []
    for p in prefixes:
        mapped = canonical_name(p + "gate_up_proj")
        if mapped is None:
            continue
        feature, bank = mapped
        base = bank[: -len("gate_up_proj")]
        groups.append(StackedSource(name=base + "gate_up_proj", feature=feature, part_shape=(inter, H),
                                    shape=(E, 2 * inter, H),
                                    parts=[f"{p}{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up")]))
        groups.append(StackedSource(name=base + "down_proj", feature=feature, part_shape=(H, inter),
                                    shape=(E, H, inter), parts=[f"{p}{e}.down_proj.weight" for e in range(E)]))
    return groups


def fused_parents(c: Qwen35Config) -> list[FusedParent]:
    """Projections stored as one physical parent so one matmul serves them (LinearSplit)."""
    groups: list[FusedParent] = []

    def layer(prefix: str, kind: str, feature: str) -> None:
        m = f"{prefix}mlp."
        if c.moe is None:
            groups.append(FusedParent(name=m + "gate_up_proj", feature=feature,
                                      members=(m + "gate_proj.weight", m + "up_proj.weight")))
        else:  # the router and the shared expert's gate read the same input: one matmul
            groups.append(FusedParent(name=m + "router_shared_gate", feature=feature,
                                      members=(m + "gate.weight", m + "shared_expert_gate.weight")))
            groups.append(FusedParent(name=m + "shared_expert.gate_up_proj", feature=feature,
                                      members=(m + "shared_expert.gate_proj.weight", m + "shared_expert.up_proj.weight")))
        if kind == "linear_attention":
            a = f"{prefix}linear_attn."
            groups.append(FusedParent(name=a + "in_proj_qkvzba", feature=feature, members=(
                a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight", a + "in_proj_a.weight")))
        else:
            a = f"{prefix}self_attn."
            groups.append(FusedParent(name=a + "qkv_proj", feature=feature, members=(
                a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")))

    for i, kind in enumerate(c.layer_types):
        layer(f"model.layers.{i}.", kind, "text")
    for j in range(c.mtp_num_hidden_layers):
        layer(f"mtp.layers.{j}.", "full_attention", "mtp")
    return groups


class Qwen35SourceMapping:
    """The ``source_mapping`` contract (``ninfer.artifact.mapping.SourceMapping``) for one Qwen3.5 config."""

    validated_features = ("text", "mtp", "vision")

    def __init__(self, config: Qwen35Config) -> None:
        self.config = config

    def canonical_name(self, source_name: str) -> tuple[str, str] | None:
        if source_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # some tied checkpoints still ship a copy; the tied head is a Use of the embedding
        return canonical_name(source_name)

    def stacked_sources(self, source_names: Collection[str]) -> list[StackedSource]:
        return stacked_sources(self.config, source_names)

    def configured_features(self) -> tuple[str, ...]:
        out = ["text"]
        if self.config.vision:
            out.append("vision")
        if self.config.mtp_num_hidden_layers:
            out.append("mtp")
        return tuple(out)

    def expected_parameters(self, features: tuple[str, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = expected_parameters(self.config, features)
        if "vision" in features:
            out.update(vision_parameters(self.config))
        return out

    def fused_parents(self) -> list[FusedParent]:
        return fused_parents(self.config)

    def shared_uses(self, bound: set[str], features: tuple[str, ...]):
        """A tied lm_head reads the embedding; MTP reads the main embedding and head (no copies of its own)."""
        from ninfer.artifact.format import Use

        embed = "model.embed_tokens.weight"
        head = embed if self.config.tie_word_embeddings else "lm_head.weight"
        uses = []
        if self.config.tie_word_embeddings and embed in bound:
            uses.append(Use(site="lm_head", feature="text", binding=embed))
        if "mtp" in features:
            uses.append(Use(site="mtp.embed_tokens", feature="mtp", binding=embed))
            uses.append(Use(site="mtp.lm_head", feature="mtp", binding=head))
        return [u for u in uses if u.binding in bound]

    def embedding_vocab(self) -> int:
        return self.config.vocab_size


def source_mapping(raw_config: dict) -> Qwen35SourceMapping:
    """Plugin slot ``source_mapping``: parse config.json and return the mapping for it."""
    from ninfer_qwen35.config import parse_config

    return Qwen35SourceMapping(parse_config(raw_config))
