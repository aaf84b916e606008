"""Qwen3 Startup (plugin slot ``startup``): the shared dense start (``ninfer.models.common.dense``) with Qwen3's
config, Parameters, model calls, KV pool and widths. The runtime plans the memory (docs/memory.md); the shared
parts build a Program of exactly the granted capacity."""

from __future__ import annotations

from ninfer.contract import ModelShape
from ninfer.models.common.dense import DenseStartup
from ninfer.models.common.qwen import QwenFrontend
from ninfer_qwen3.config import Qwen3Config, parse_config
from ninfer_qwen3.model import Qwen3Model, Qwen3Parameters, kv_pool
from ninfer_qwen3.source_mapping import EMBED


class Qwen3Startup(DenseStartup):
    architecture, embed = "qwen3", EMBED
    parse_config = staticmethod(parse_config)
    parameters = staticmethod(Qwen3Parameters.from_weights)
    model = staticmethod(Qwen3Model)
    kv_pool = staticmethod(kv_pool)

    def shape(self, c: Qwen3Config) -> ModelShape:
        return ModelShape(hidden_size=c.hidden_size, vocab_size=c.vocab_size, mlp_width=2 * c.intermediate_size,
                          mixer_width=(c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim)

    def frontend(self, artifact, options) -> QwenFrontend:
        return QwenFrontend.from_resources(artifact.frontend, chat_template_override=options.chat_template,
                                           special_tokens_in_content=options.special_tokens_in_content,
                                           constraint_limits=options.constraint_limits)
