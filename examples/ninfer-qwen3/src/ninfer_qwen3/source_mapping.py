"""Qwen3 source mapping (plugin slot ``source_mapping``, the ``ninfer.artifact.mapping.SourceMapping`` shape):
Hugging Face tensor names are the logical names; q/k/v and gate/up are stored fused so one matmul serves each."""

from __future__ import annotations

from collections.abc import Collection

from ninfer.artifact import Use
from ninfer.artifact.mapping import StackedSource
from ninfer.models.common.weights import FusedParent
from ninfer_qwen3.config import Qwen3Config, parse_config

EMBED = "model.embed_tokens.weight"


def expected_parameters(c: Qwen3Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Logical name -> ("text", shape) of every parameter the config implies."""
    H, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            a + "q_proj.weight": (c.num_attention_heads * d, H), a + "k_proj.weight": (c.num_key_value_heads * d, H),
            a + "v_proj.weight": (c.num_key_value_heads * d, H), a + "o_proj.weight": (H, c.num_attention_heads * d),
            a + "q_norm.weight": (d,), a + "k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        })
    return {name: ("text", shape) for name, shape in shapes.items()}


def fused_parents(c: Qwen3Config) -> list[FusedParent]:
    groups = []
    for i in range(c.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        groups.append(FusedParent(name=a + "qkv_proj", members=[a + f"{x}_proj.weight" for x in "qkv"]))
        groups.append(FusedParent(name=m + "gate_up_proj", members=[m + "gate_proj.weight", m + "up_proj.weight"]))
    return groups


class Qwen3SourceMapping:
    validated_features = ("text",)

    def __init__(self, config: Qwen3Config) -> None:
        self.config = config

    def canonical_name(self, source_name: str) -> tuple[str, str] | None:
        if source_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # a tied checkpoint may still ship a copy; the head reads the embedding instead
        if source_name.startswith("model.") or source_name == "lm_head.weight":
            return "text", source_name
        return None

    def stacked_sources(self, source_names: Collection[str]) -> tuple[StackedSource, ...]:
        return ()  # Qwen3 checkpoints store every parameter whole

    def configured_features(self) -> tuple[str, ...]:
        return ("text",)

    def expected_parameters(self, features: tuple[str, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return expected_parameters(self.config) if "text" in features else {}

    def fused_parents(self) -> list[FusedParent]:
        return fused_parents(self.config)

    def shared_uses(self, bound: set[str], features: tuple[str, ...]) -> list[Use]:
        tied = self.config.tie_word_embeddings and EMBED in bound
        return [Use(site="lm_head", feature="text", binding=EMBED)] if tied else []

    def embedding_vocab(self) -> int:
        return self.config.vocab_size


def source_mapping(raw_config: dict) -> Qwen3SourceMapping:
    return Qwen3SourceMapping(parse_config(raw_config))
