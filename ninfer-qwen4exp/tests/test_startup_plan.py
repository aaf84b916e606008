"""Qwen4Exp Startup arithmetic from a config alone: the n-gram tables as host bytes in every placement, the
model's widths, and the features it refuses until they are built."""

from __future__ import annotations

import types

import pytest

from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer.contract.memory import WeightPlacement
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.startup import Qwen4ExpStartup, StartupError, host_tables, model_shape

RAW = dict(vocab_size=448, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=16, shared_expert_intermediate_size=16, hc_count=4, hc_lowrank=8, ple_layer_ids=[2],
           ngram_size=3, heads_per_ngram=2, ple_embed_dim=64, ngram_vocab_size_base=101, indexer_n_heads=2,
           indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, eos_token_id=3,
           layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"])


def test_ngram_tables_are_host_bytes_in_every_placement():
    all_device = WeightPlacement(name="all-device", device_bytes=1000, step_bytes=700)
    experts = WeightPlacement(name="host-experts", device_bytes=400, host_bytes=600, staging_bytes=50,
                              expert_bytes=10, experts=60, step_bytes=700)
    a, b = host_tables(all_device, 300), host_tables(experts, 300)
    assert (a.device_bytes, a.host_bytes, a.step_bytes) == (700, 300, 400)
    assert (b.device_bytes, b.host_bytes, b.step_bytes, b.staging_bytes, b.experts) == (100, 900, 400, 50, 60)
    assert host_tables(experts, 0) is experts  # no PLE: nothing moves


def test_model_shape_is_the_wide_residual_and_the_widest_mixer():
    config = parse_config(RAW)
    shape = model_shape(config)
    assert shape.hidden_size == 4 * 32 and shape.vocab_size == 448
    assert shape.mlp_width == config.base.ffn_width
    # GDN conv in+out 2 * 64; attention q+gate, k, v (8 + 4) * 16 + indexer 3 * 16; PLE rows 64 + 3 * 128 + 32
    assert shape.mixer_width == max(2 * 64, 12 * 16 + 3 * 16, 64 + 3 * 128 + 32) == 480


@pytest.mark.parametrize(("features", "match"), [
    (StartupFeatures(speculative="mtp"), "speculative='mtp' is not built yet for Qwen4Exp"),
    (StartupFeatures(speculative="dflash"), "speculative='dflash' is not built yet for Qwen4Exp"),
    (StartupFeatures(vision=True), "vision is not built yet for Qwen4Exp"),
])
def test_unbuilt_features_are_refused_before_any_weight_read(features, match):
    artifact = types.SimpleNamespace(config=RAW)  # the refusal reads nothing else
    with pytest.raises(StartupError, match=match):
        Qwen4ExpStartup().profile(artifact, StartupOptions(device="cpu", features=features))


def test_decode_runs_eagerly_while_a_step_reads_on_the_host():
    from ninfer_qwen4exp.startup import Qwen4ExpLoaded, _eager_reason

    def loaded(raw, host_experts=False):
        return Qwen4ExpLoaded(config=parse_config(raw), weights=None, load_report=None, executor=None, frontend=None,
                              compute=None, host_experts=host_experts)

    assert "PLE n-gram table lives in host memory" in _eager_reason(loaded(RAW))
    no_ple = {**RAW, "ple_layer_ids": None}
    assert "QSA block selection" in _eager_reason(loaded(no_ple))
    dense = {k: v for k, v in no_ple.items() if not k.startswith("indexer_")}
    assert "placement host-experts" in _eager_reason(loaded(dense, host_experts=True))
