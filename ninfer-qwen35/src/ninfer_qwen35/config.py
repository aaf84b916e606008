"""Qwen3.5 config: parsed from a Hugging Face config.json (flat text-only or VL with text_config)."""

from __future__ import annotations

from typing import Any, Literal

import attrs
from attrs import validators as v

LayerType = Literal["linear_attention", "full_attention"]


class ConfigError(ValueError):
    """config.json is missing a field or disagrees with itself."""


@attrs.frozen(kw_only=True)
class MoEConfig:
    """The sparse MoE block of Qwen3.5 MoE (HF ``Qwen3_5MoeTextConfig``): every layer's MLP is ``num_experts``
    routed SwiGLU experts of ``moe_intermediate_size``, ``num_experts_per_tok`` chosen per token (softmax, top-k
    renormalised), plus one shared SwiGLU expert of ``shared_expert_intermediate_size`` behind a sigmoid gate."""

    num_experts: int = attrs.field(validator=v.gt(0))
    num_experts_per_tok: int = attrs.field(validator=v.gt(0))
    moe_intermediate_size: int = attrs.field(validator=v.gt(0))
    shared_expert_intermediate_size: int = attrs.field(validator=v.gt(0))

    def __attrs_post_init__(self) -> None:
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}")


@attrs.frozen(kw_only=True)
class Qwen35Config:
    """Instance parameters of a Qwen3.5 text model (names follow HF's Qwen3_5TextConfig / Qwen3_5MoeTextConfig):
    dense (``intermediate_size``) or MoE (``moe``; every layer's MLP is the sparse block)."""

    vocab_size: int = attrs.field(validator=v.gt(0))
    hidden_size: int = attrs.field(validator=v.gt(0))
    intermediate_size: int = attrs.field(default=0, validator=v.ge(0))  # dense MLP width (0 in a MoE model)
    moe: MoEConfig | None = None
    num_hidden_layers: int = attrs.field(validator=v.gt(0))
    num_attention_heads: int = attrs.field(validator=v.gt(0))
    num_key_value_heads: int = attrs.field(validator=v.gt(0))
    head_dim: int = attrs.field(validator=v.gt(0))
    linear_conv_kernel_dim: int = attrs.field(validator=v.gt(0))
    linear_key_head_dim: int = attrs.field(validator=v.gt(0))
    linear_value_head_dim: int = attrs.field(validator=v.gt(0))
    linear_num_key_heads: int = attrs.field(validator=v.gt(0))
    linear_num_value_heads: int = attrs.field(validator=v.gt(0))
    layer_types: tuple[LayerType, ...] = attrs.field(converter=tuple)
    rms_norm_eps: float = attrs.field(default=1e-6, validator=v.gt(0.0))
    rope_theta: float = attrs.field(default=10_000_000.0, validator=v.gt(0.0))
    partial_rotary_factor: float = attrs.field(default=0.25, validator=[v.gt(0.0), v.le(1.0)])
    mrope_section: tuple[int, ...] = attrs.field(default=(11, 11, 10), converter=tuple)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = attrs.field(default=262144, validator=v.gt(0))
    hidden_act: str = attrs.field(default="silu", validator=v.in_(("silu",)))
    mtp_num_hidden_layers: int = attrs.field(default=0, validator=v.ge(0))
    # Multimodal token ids (top level of VL configs); None for text-only checkpoints.
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    eos_token_id: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    vision: dict[str, Any] | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.moe is None and self.intermediate_size <= 0:
            raise ConfigError("a dense Qwen3.5 config needs intermediate_size > 0 (a MoE config gives num_experts, "
                              "num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size)")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                              f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise ConfigError(f"unknown layer_types {bad}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                              f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")

    # -- derived geometry ---------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def ffn_width(self) -> int:
        """Elements per token a layer's feed-forward activations hold at once (gate and up of what runs)."""
        if self.moe is None:
            return 2 * self.intermediate_size
        m = self.moe
        return 2 * m.moe_intermediate_size * m.num_experts_per_tok + 2 * m.shared_expert_intermediate_size \
            + m.num_experts + 1

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
             "linear_num_value_heads")
_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def parse_config(raw: dict[str, Any]) -> Qwen35Config:
    """Parse config.json. Accepts the VL layout (``text_config`` + top-level vision ids) and flat text-only."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must be a JSON object")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    is_moe = "num_experts" in text
    missing = [k for k in (*_REQUIRED, *(_MOE if is_moe else ("intermediate_size",))) if k not in text]
    if missing:
        raise ConfigError(f"config.json is missing {', '.join(missing)}")
    n = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}")
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos = () if eos is None else (tuple(eos) if isinstance(eos, list | tuple) else (eos,))
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    try:
        return Qwen35Config(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            intermediate_size=0 if is_moe else text["intermediate_size"],
            moe=MoEConfig(**{k: text[k] for k in _MOE}) if is_moe else None, num_hidden_layers=n,
            num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=text["linear_key_head_dim"], linear_value_head_dim=text["linear_value_head_dim"],
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            layer_types=layer_types, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 10_000_000.0)),
            partial_rotary_factor=rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)),
            mrope_section=rope.get("mrope_section", (11, 11, 10)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=text.get("max_position_embeddings", 262144),
            hidden_act=text.get("hidden_act", "silu"),
            mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0)),
            image_token_id=raw.get("image_token_id"), video_token_id=raw.get("video_token_id"),
            vision_start_token_id=raw.get("vision_start_token_id"),
            vision_end_token_id=raw.get("vision_end_token_id"),
            eos_token_id=eos, vision=raw.get("vision_config"),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid Qwen3.5 config: {exc}") from exc
