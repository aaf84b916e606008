"""The Qwen4Exp source mapping from a config alone: names, shapes, stacked n-gram tables, fused parents."""

import pytest

from ninfer.artifact.mapping import SourceMapping
from ninfer.contract.quant import A16_ONLY
from ninfer_qwen4exp.config import ConfigError, parse_config
from ninfer_qwen4exp.source_mapping import (
    activation_permit,
    expected_parameters,
    ngram_tables,
    source_mapping,
)
from ninfer_qwen4exp.testing import tiny_text_config


def raw(variant="full", **overrides):
    return {"architectures": ["Qwen4ExpForCausalLM"], "mtp_num_hidden_layers": 1,
            **tiny_text_config(variant, layers=4, eos_token_id=400, **overrides)}


def test_the_mapping_fills_the_contract():
    m = source_mapping(raw())
    assert isinstance(m, SourceMapping)
    assert m.configured_features() == ("text", "mtp") and m.embedding_vocab() == 512


def test_expected_names_and_shapes():
    c = parse_config(raw())
    text = {n: s for n, (f, s) in expected_parameters(c, ("text",)).items()}
    wide = 4 * 64
    assert text["model.hyper_connection_mixer.input_mix_weight_down.weight"] == (16, wide)
    assert "model.hyper_connection_mixer.block_inject_weight.weight" not in text
    assert text["model.layers.0.attn_hyper_connection.block_inject_weight.weight"] == (4, wide)
    assert text["model.layers.3.self_attn.indexer.index_qk_proj.weight"] == (5 * 16, 64)
    assert text["model.layers.3.self_attn.q_proj.weight"] == (2 * 4 * 16, 64)  # queries and their gate
    assert text["model.layers.1.ple.ple_embedding.ngram_embedding.weight"] == (896, 8)  # primes 211..229, padded
    assert text["model.layers.2.ple.ple_embedding.ngram_embedding.weight"] == (968, 8)  # the next four primes
    assert text["model.layers.1.ple.key_proj.weight"] == (wide, 32)
    assert text["model.layers.2.ple.conv1d.weight"] == (wide, 1, 4)
    assert not any("ple." in n for n in text if n.startswith(("model.layers.0.", "model.layers.3.")))
    assert not any(n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) for n in text)
    assert "model.norm.weight" not in text
    mtp = {n: s for n, (f, s) in expected_parameters(c, ("mtp",)).items()}
    assert mtp["mtp.pre_fc_norm_hidden.weight"] == (wide,) and mtp["mtp.fc_embedding.weight"] == (64, 64)
    assert "mtp.layers.0.self_attn.indexer.k_layernorm.weight" in mtp and "mtp.norm.weight" not in mtp
    assert ngram_tables(c) == ("model.layers.1.ple.ple_embedding.ngram_embedding.weight",
                               "model.layers.2.ple.ple_embedding.ngram_embedding.weight")


def test_names_of_the_vl_layout_and_buffers():
    m = source_mapping(raw())
    assert m.canonical_name("model.language_model.layers.0.attn_hyper_connection.hc_norm.weight") == (
        "text", "model.layers.0.attn_hyper_connection.hc_norm.weight")
    assert m.canonical_name("model.language_model.layers.1.ple.ple_embedding.layer_multipliers") is None
    assert m.canonical_name("model.layers.1.ple.ple_embedding.ngram_heads_offsets") is None


def test_table_shards_stack_in_shard_order():
    m = source_mapping(raw(split_ngram_parts=3))
    names = [f"model.language_model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_{k}.weight"
             for i in (1, 2) for k in range(3)]
    groups = {g.name: g for g in m.stacked_sources(names)}
    g = groups["model.layers.1.ple.ple_embedding.ngram_embedding.weight"]
    assert g.parts == tuple(names[:3]) and g.shape == (896, 8)
    assert [g.shape_of(k) for k in range(3)] == [(299, 8), (299, 8), (298, 8)]


def test_fused_parents_are_qwen35s():
    groups = {g.name: g.members for g in source_mapping(raw()).fused_parents()}
    assert groups["model.layers.3.self_attn.qkv_proj"] == tuple(
        f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv")
    assert "mtp.layers.0.mlp.router_shared_gate" in groups
    assert not any("ple" in n or "hyper_connection" in n for n in groups)


def test_activation_permits():
    assert activation_permit("model.layers.0.attn_hyper_connection.input_mix_weight_up.weight") == A16_ONLY
    assert activation_permit("model.layers.3.self_attn.indexer.index_qk_proj.weight") == A16_ONLY
    assert activation_permit("model.layers.0.mlp.experts.gate_up_proj") != A16_ONLY


def test_unknown_layer_type_is_refused_by_name():
    bad = raw()
    bad["layer_types"] = ["linear_attention", "sliding_attention", "linear_attention", "indexed_attention"]
    with pytest.raises(ConfigError, match="sliding_attention"):
        source_mapping(bad)
