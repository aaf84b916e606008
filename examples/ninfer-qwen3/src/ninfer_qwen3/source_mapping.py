"""Qwen3 source mapping (plugin slot ``source_mapping``): Hugging Face tensor names are the logical names; q/k/v
and gate/up are stored fused so one matmul serves each (``DenseSourceMapping`` does the rest)."""

from __future__ import annotations

from ninfer.models.common.dense import DenseSourceMapping
from ninfer.models.common.weights import FusedParent
from ninfer_qwen3.config import Qwen3Config, parse_config

EMBED = "model.embed_tokens.weight"


def parameter_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Logical name -> shape of every parameter the config implies."""
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
    return shapes


class Qwen3SourceMapping(DenseSourceMapping):
    embed = EMBED

    def parameters(self) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(self.config)

    def fused_parents(self) -> list[FusedParent]:
        groups = []
        for i in range(self.config.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            groups.append(FusedParent(name=a + "qkv_proj", members=[a + f"{x}_proj.weight" for x in "qkv"]))
            groups.append(FusedParent(name=m + "gate_up_proj", members=[m + "gate_proj.weight", m + "up_proj.weight"]))
        return groups


def source_mapping(raw_config: dict) -> Qwen3SourceMapping:
    return Qwen3SourceMapping(parse_config(raw_config))
