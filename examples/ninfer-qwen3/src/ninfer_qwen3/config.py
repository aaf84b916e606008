"""Qwen3 config, parsed from a Hugging Face config.json (names follow transformers' ``Qwen3Config``)."""

from __future__ import annotations

from typing import Any

import attrs
from attrs import validators as v


class ConfigError(ValueError):
    """config.json is missing a field, disagrees with itself or asks for something this plugin does not run."""


@attrs.frozen(kw_only=True)
class Qwen3Config:
    vocab_size: int = attrs.field(validator=v.gt(0))
    hidden_size: int = attrs.field(validator=v.gt(0))
    intermediate_size: int = attrs.field(validator=v.gt(0))
    num_hidden_layers: int = attrs.field(validator=v.gt(0))
    num_attention_heads: int = attrs.field(validator=v.gt(0))
    num_key_value_heads: int = attrs.field(validator=v.gt(0))
    head_dim: int = attrs.field(validator=v.gt(0))
    rms_norm_eps: float = attrs.field(default=1e-6, validator=v.gt(0.0))
    rope_theta: float = attrs.field(default=10_000.0, validator=v.gt(0.0))
    tie_word_embeddings: bool = False
    max_position_embeddings: int = attrs.field(default=32768, validator=v.gt(0))
    eos_token_id: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary embedding")


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def parse_config(raw: dict[str, Any]) -> Qwen3Config:
    """The typed config (the Startup's and the source mapping's). Refuses what the model code does not run."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must be a JSON object")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"config.json is missing {', '.join(missing)}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = [f"rope_type {rope_type!r}"] if rope_type != "default" else []
    problems += [key for key in ("attention_bias", "use_sliding_window") if raw.get(key)]
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw['hidden_act']!r}")
    if problems:
        raise ConfigError(f"this plugin does not run Qwen3 with {', '.join(problems)} (it runs default RoPE, "
                          f"no attention bias, no sliding window, silu)")
    eos = raw.get("eos_token_id")
    try:
        return Qwen3Config(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim", 128),  # transformers' Qwen3Config default, not hidden / heads
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10_000.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            eos_token_id=() if eos is None else (eos if isinstance(eos, list | tuple) else (eos,)),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid Qwen3 config: {exc}") from exc
