"""Qwen4Exp source mapping: Hugging Face tensor names -> logical parameters, features and fused parents.

Logical names are the flat text-only Hugging Face names, as for Qwen3.5 (``model.layers.{i}...``,
``lm_head.weight``, ``mtp.*``, ``visual.*``; the VL checkpoints' ``model.language_model.*`` / ``model.visual.*``
are renamed the same way). What Qwen4Exp shares with Qwen3.5 MoE (GDN, gated attention, the MoE block with its
expert banks, the vision tower) is named and shaped by ``ninfer_qwen35.source_mapping``. Beyond it:

- no per-layer ``input_layernorm`` / ``post_attention_layernorm`` and no final ``model.norm``: every layer has
  ``attn_hyper_connection.*`` and ``mlp_hyper_connection.*`` (``hc_norm``, ``input_mix_weight_down`` / ``_up``,
  ``block_inject_weight``) and ``model.hyper_connection_mixer.*`` (no inject) makes the H-wide output;
- attention layers carry the QSA indexer (``self_attn.indexer.{index_qk_proj, q_layernorm, k_layernorm}``);
- PLE layers carry ``ple.*``; the n-gram table ``ple.ple_embedding.ngram_embedding.weight`` [rows, head_dim] is
  published as ``...ngram_embedding.shard_{k}.weight`` row chunks (``split_ngram_parts``), assembled here into one
  object of its own (the loader may keep it in host memory). The table's hash buffers (``layer_multipliers``,
  ``ngram_heads_*``) follow from the config and are not stored;
- MTP (SGLang ``qwen4_exp_mtp``): ``mtp.fc_embedding`` / ``mtp.fc_hidden`` [H, H], ``mtp.pre_fc_norm_embedding``
  [H], ``mtp.pre_fc_norm_hidden`` [hc*H], one indexed-attention layer and ``mtp.hyper_connection_mixer``.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ninfer.artifact.mapping import StackedSource
from ninfer.artifact.weights import FusedParent
from ninfer.contract.quant import A16_ONLY
from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen35 import source_mapping as qwen35

FEATURES = qwen35.FEATURES
NGRAM_TABLE = "ple.ple_embedding.ngram_embedding.weight"  # the suffix of every layer's n-gram table
# The n-gram embedding's buffers: derived from the config (PLEConfig.head_vocab_sizes / head_offsets, the hash
# multipliers), so a checkpoint that stores them has them skipped.
_PLE_BUFFERS = re.compile(r"\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$")
_NGRAM_SHARD = re.compile(r"^(.+\.ple\.ple_embedding\.ngram_embedding\.)shard_(\d+)\.weight$")
_PREFIX_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def canonical_name(hf_name: str) -> tuple[str, str] | None:
    """(feature, logical name) for a checkpoint tensor name, or None for names the model does not use."""
    if _PLE_BUFFERS.search(hf_name):
        return None
    return qwen35.canonical_name(hf_name)


# Hyper-connection mixes and inject gates, the QSA indexer's scores and the PLE gate feed sigmoids, ReLU top-k
# selection and a signed square root, where an FP8 input's rounding changes decisions: A16 only.
_A16_ONLY = re.compile(r"(hyper_connection|hyper_connection_mixer)\.\w+\.weight$|indexer\.index_qk_proj\.weight$"
                       r"|\.ple\.(key_proj|value_proj)\.weight$|mtp\.fc_(embedding|hidden)\.weight$")


def activation_permit(name: str) -> frozenset[str]:
    """The activation permit of the linear ``name`` (a logical parameter name); Qwen3.5's for the shared parts."""
    return A16_ONLY if _A16_ONLY.search(name) else qwen35.activation_permit(name)


def _hyper_connection(prefix: str, c: Qwen4ExpConfig, *, inject: bool = True) -> dict[str, tuple[int, ...]]:
    wide = c.hc_hidden_size
    names = {prefix + "hc_norm.weight": (wide,), prefix + "input_mix_weight_down.weight": (c.hc_lowrank, wide),
             prefix + "input_mix_weight_up.weight": (wide, c.hc_lowrank)}
    if inject:
        names[prefix + "block_inject_weight.weight"] = (c.hc_count, wide)
    return names


def _ple(prefix: str, c: Qwen4ExpConfig, ple_index: int) -> dict[str, tuple[int, ...]]:
    p, wide, e = c.ple, c.hc_hidden_size, c.ple.embed_dim
    return {prefix + NGRAM_TABLE: (p.table_rows(ple_index), p.head_dim),
            prefix + "ple.key_proj.weight": (wide, e), prefix + "ple.value_proj.weight": (c.hidden_size, e),
            prefix + "ple.norm_key.weight": (wide,), prefix + "ple.norm_query.weight": (wide,),
            prefix + "ple.norm_conv.weight": (wide,), prefix + "ple.conv1d.weight": (wide, 1, p.conv_kernel_size)}


def layer_names(prefix: str, kind: str, c: Qwen4ExpConfig, ple_index: int | None) -> dict[str, tuple[int, ...]]:
    """One decoder layer: Qwen3.5's mixer and MoE block without its two norms, the hyper-connections, the
    indexer on attention layers, PLE where configured."""
    if kind not in ("linear_attention", "indexed_attention"):
        raise ValueError(f"unknown Qwen4Exp layer type {kind!r} (known: linear_attention, indexed_attention)")
    shared = qwen35.layer_names(prefix, "linear_attention" if kind == "linear_attention" else "full_attention",
                                 c.base)
    names = {n: s for n, s in shared.items() if not n.endswith(_PREFIX_NORMS)}
    names.update(_hyper_connection(prefix + "attn_hyper_connection.", c))
    names.update(_hyper_connection(prefix + "mlp_hyper_connection.", c))
    if kind == "indexed_attention" and c.qsa is not None:
        q, i = c.qsa, prefix + "self_attn.indexer."
        names.update({i + "index_qk_proj.weight": ((q.n_heads + 1) * q.head_dim, c.hidden_size),
                      i + "q_layernorm.weight": (q.head_dim,), i + "k_layernorm.weight": (q.head_dim,)})
    if ple_index is not None:
        names.update(_ple(prefix, c, ple_index))
    return names


def expected_parameters(c: Qwen4ExpConfig, features: tuple[str, ...] = ("text",)
                        ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Logical name -> (feature, shape) of every parameter the selected features need (text and mtp)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    H, V = c.hidden_size, c.base.vocab_size
    if "text" in features:
        out["model.embed_tokens.weight"] = ("text", (V, H))
        if not c.base.tie_word_embeddings:
            out["lm_head.weight"] = ("text", (V, H))
        for i, kind in enumerate(c.layer_types):
            ple_index = c.ple_layers.index(i) if i in c.ple_layers else None
            for n, shape in layer_names(f"model.layers.{i}.", kind, c, ple_index).items():
                out[n] = ("text", shape)
        for n, shape in _hyper_connection("model.hyper_connection_mixer.", c, inject=False).items():
            out[n] = ("text", shape)
    if "mtp" in features and c.base.mtp_num_hidden_layers:
        out["mtp.fc_embedding.weight"] = ("mtp", (H, H))
        out["mtp.fc_hidden.weight"] = ("mtp", (H, H))
        out["mtp.pre_fc_norm_embedding.weight"] = ("mtp", (H,))
        out["mtp.pre_fc_norm_hidden.weight"] = ("mtp", (c.hc_hidden_size,))
        for j in range(c.base.mtp_num_hidden_layers):
            for n, shape in layer_names(f"mtp.layers.{j}.", "indexed_attention", c, None).items():
                out[n] = ("mtp", shape)
        for n, shape in _hyper_connection("mtp.hyper_connection_mixer.", c, inject=False).items():
            out[n] = ("mtp", shape)
    return out


def ngram_tables(c: Qwen4ExpConfig) -> tuple[str, ...]:
    """The logical names of the n-gram tables, in PLE-layer order (one object each; candidates for host memory)."""
    return tuple(f"model.layers.{i}.{NGRAM_TABLE}" for i in c.ple_layers)


def stacked_sources(c: Qwen4ExpConfig, source_names: Collection[str]) -> list[StackedSource]:
    """Per-expert tensors stacked into the fused banks (as for Qwen3.5 MoE), and each n-gram table assembled from
    its ``shard_{k}`` row chunks in shard order."""
    groups = qwen35.stacked_sources(c.base, source_names)
    prefixes = sorted({m.group(1) for n in source_names if (m := _NGRAM_SHARD.match(n))})
    layer_of = {f"model.layers.{i}.": k for k, i in enumerate(c.ple_layers)}
    for p in prefixes:
        mapped = canonical_name(p + "weight")
        if mapped is None:
            continue
        feature, table = mapped
        layer = table[: -len(NGRAM_TABLE)]
        if layer not in layer_of:
            continue  # a table on a layer without PLE: refused by name as not part of the model
        rows = c.ple.shard_rows(layer_of[layer])
        groups.append(StackedSource(name=table, feature=feature, part_shape=(rows[0], c.ple.head_dim),
                                    shape=(sum(rows), c.ple.head_dim), last_rows=rows[-1],
                                    parts=[f"{p}shard_{k}.weight" for k in range(len(rows))]))
    return groups


def fused_parents(c: Qwen4ExpConfig) -> list[FusedParent]:
    """Qwen3.5's groups (the layers' names agree): GDN's in_proj_qkvzba, attention's qkv_proj, the router with the
    shared expert's gate, the shared expert's gate_up_proj; the n-gram tables stay objects of their own."""
    return qwen35.fused_parents(c.base)


class Qwen4ExpSourceMapping:
    """The ``source_mapping`` contract (``ninfer.artifact.mapping.SourceMapping``) for one Qwen4Exp config."""

    validated_features = ("text", "mtp", "vision")

    def __init__(self, config: Qwen4ExpConfig) -> None:
        self.config = config

    def canonical_name(self, source_name: str) -> tuple[str, str] | None:
        if source_name == "lm_head.weight" and self.config.base.tie_word_embeddings:
            return None
        return canonical_name(source_name)

    def stacked_sources(self, source_names: Collection[str]) -> list[StackedSource]:
        return stacked_sources(self.config, source_names)

    def configured_features(self) -> tuple[str, ...]:
        out = ["text"]
        if self.config.base.vision:
            out.append("vision")
        if self.config.base.mtp_num_hidden_layers:
            out.append("mtp")
        return tuple(out)

    def expected_parameters(self, features: tuple[str, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = expected_parameters(self.config, features)
        if "vision" in features:
            out.update(qwen35.vision_parameters(self.config.base))
        return out

    def fused_parents(self) -> list[FusedParent]:
        return fused_parents(self.config)

    def shared_uses(self, bound: set[str], features: tuple[str, ...]):
        """A tied lm_head reads the embedding; MTP reads the main embedding and head (as for Qwen3.5)."""
        return qwen35.Qwen35SourceMapping(self.config.base).shared_uses(bound, features)

    def embedding_vocab(self) -> int:
        return self.config.base.vocab_size


def source_mapping(raw_config: dict) -> Qwen4ExpSourceMapping:
    """Plugin slot ``source_mapping``: parse config.json and return the mapping for it."""
    from ninfer_qwen4exp.config import parse_config

    return Qwen4ExpSourceMapping(parse_config(raw_config))
