"""Qwen4Exp Startup arithmetic from a config alone: where each placement keeps the n-gram tables, the model's
widths, why decode runs eagerly, and the features it refuses until they are built."""

from __future__ import annotations

import types

import pytest

from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer.contract.memory import WeightPlacement
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.startup import Qwen4ExpStartup, StartupError, model_shape, table_placements

RAW = dict(vocab_size=448, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=16, shared_expert_intermediate_size=16, hc_count=4, hc_lowrank=8, ple_layer_ids=[2],
           ngram_size=3, heads_per_ngram=2, ple_embed_dim=64, ngram_vocab_size_base=101, indexer_n_heads=2,
           indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, eos_token_id=3,
           layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"])


def test_the_ngram_tables_on_the_device_first_then_in_host_memory():
    all_device = WeightPlacement(name="all-device", device_bytes=1000, step_bytes=700)
    experts = WeightPlacement(name="host-experts", device_bytes=400, host_bytes=600, staging_bytes=50,
                              expert_bytes=10, experts=60, step_bytes=700)
    a, t, b = table_placements((all_device, experts), 300)
    assert (a.name, t.name, b.name) == ("all-device", "host-tables", "host-experts")
    assert (a.device_bytes, a.host_bytes, a.step_bytes) == (1000, 0, 400)  # a step reads only looked-up rows
    assert (t.device_bytes, t.host_bytes, t.step_bytes) == (700, 300, 400)
    assert (b.device_bytes, b.host_bytes, b.step_bytes, b.staging_bytes, b.experts) == (100, 900, 400, 50, 60)
    dense = WeightPlacement(name="all-device", device_bytes=1000)  # step_bytes 0: a step reads every byte
    assert [p.step_bytes for p in table_placements((dense,), 300)] == [700, 700]
    assert table_placements((all_device, experts), 0) == (all_device, experts)  # no PLE: nothing moves


def test_model_shape_is_the_wide_residual_and_the_widest_mixer():
    config = parse_config(RAW)
    shape = model_shape(config)
    assert shape.hidden_size == 4 * 32 and shape.vocab_size == 448
    assert shape.mlp_width == config.base.ffn_width
    # GDN conv in+out 2 * 64; attention q+gate, k, v (8 + 4) * 16 + indexer 3 * 16; PLE rows 64 + 3 * 128 + 32
    assert shape.mixer_width == max(2 * 64, 12 * 16 + 3 * 16, 64 + 3 * 128 + 32) == 480


@pytest.mark.parametrize(("features", "match"), [
    (StartupFeatures(speculative="dflash"), "speculative='dflash' is not built yet for Qwen4Exp"),
])
def test_unbuilt_features_are_refused_before_any_weight_read(features, match):
    artifact = types.SimpleNamespace(config=RAW)  # the refusal reads nothing else
    with pytest.raises(StartupError, match=match):
        Qwen4ExpStartup().profile(artifact, StartupOptions(device="cpu", features=features))


def test_decode_runs_eagerly_while_a_step_reads_on_the_host():
    from ninfer_qwen4exp.startup import Qwen4ExpLoaded, _eager_reason

    def loaded(raw, host_experts=False, host_tables=False):
        return Qwen4ExpLoaded(config=parse_config(raw), weights=None, load_report=None, executor=None, frontend=None,
                              compute=None, host_experts=host_experts, host_tables=host_tables)

    assert "PLE n-gram tables live in host memory" in _eager_reason(loaded(RAW, host_tables=True))
    assert "PLE n-gram tables" in _eager_reason(loaded(RAW, host_experts=True, host_tables=True))
    assert "placement host-experts" in _eager_reason(loaded({**RAW, "ple_layer_ids": None}, host_experts=True))
    # QSA and device tables decode through graphs; the routed experts then decide (their Triton kernel or not)
    reason = _eager_reason(loaded(RAW))
    assert reason is None or "MoE routed experts run the torch reference" in reason


# The published Qwen3.8-Flash-Next text config (shared/reference/qwen35_arch.md section 8; the context limit is
# the family's published 262,144).
PUBLISHED = dict(
    vocab_size=248320, hidden_size=2560, num_hidden_layers=48, num_attention_heads=24, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=640, shared_expert_intermediate_size=640, norm_topk_prob=True, hc_count=4, hc_lowrank=320,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
    ple_layer_ids=[2], ple_embed_dim=2560, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=128, seed=1234,
    output_gate_type="sigmoid", eos_token_id=248044, tie_word_embeddings=False, max_position_embeddings=262144,
    rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                            mrope_section=[11, 11, 10], mrope_interleaved=True))


def test_the_published_shape_fits_an_80_gb_card_with_experts_and_ngram_tables_on_the_host():
    """The profile of the published shape (bf16 meta weights bound as the converter binds them): about 95 GiB of
    n-gram table and 225 GiB of routed experts; neither all-device nor host-tables (the table on the host) fits
    80 GB, host-experts (both on the host) does, with an expert cache and a full 262,144-token context."""
    import torch

    from ninfer.artifact.weights import WeightSet
    from ninfer.core.device_plan import GIB, DeviceRoom, PlanError, plan_memory
    from ninfer_qwen4exp.source_mapping import expected_parameters, fused_parents, ngram_tables
    from ninfer_qwen4exp.startup import weights_profile
    from ninfer_qwen35.startup import BANKS

    config = parse_config(PUBLISHED)
    fp32 = ("A_log", "linear_attn.norm.weight")  # fp32 in published checkpoints
    tensors = {n: torch.empty(s, dtype=torch.float32 if n.endswith(fp32) else torch.bfloat16, device="meta")
               for n, (_, s) in expected_parameters(config, ("text",)).items()}
    weights = WeightSet.from_tensors(tensors, fused_parents(config))
    options = StartupOptions(device="cuda", max_concurrency=4, dtype="bfloat16")
    profile = weights_profile(config, weights, options, architecture="Qwen4ExpForCausalLM",
                              tables=[weights.parents[n] for n in ngram_tables(config)],
                              bank_parents=[t for n, t in weights.parents.items() if n.endswith(BANKS)])
    everything, host_tables, hosted = profile.placements
    tables = config.ple.table_rows(0) * config.ple.head_dim * 2
    experts = 48 * 512 * 3 * 640 * 2560 * 2
    assert 95 * GIB < tables < 96 * GIB and 224 * GIB < experts < 226 * GIB
    assert everything.host_bytes == 0 and host_tables.host_bytes == tables and hosted.host_bytes == tables + experts
    assert hosted.device_bytes == everything.device_bytes - tables - experts < 10 * GIB
    assert hosted.expert_bytes == 3 * 640 * 2560 * 2 and hosted.experts == 48 * 512
    room = DeviceRoom(is_cuda=True, budget_bytes=80 * 10**9)
    for placement in (everything, host_tables):
        with pytest.raises(PlanError, match="does not fit"):
            plan_memory(profile, options, room, placement=placement, host_available=512 * GIB)
    plan = plan_memory(profile, options, room, placement=hosted, host_available=512 * GIB)
    assert plan.max_model_len == 262144 and plan.capacity().expert_cache_slots > 48 * 10
    assert plan.host.weights_bytes == tables + experts
    with pytest.raises(PlanError, match="host weights 320.37 GiB"):  # the host must hold tables and experts
        plan_memory(profile, options, room, placement=hosted, host_available=256 * GIB)
