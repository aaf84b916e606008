"""Qwen4ExpParameters from bound weights: what it holds and the weights it refuses, naming the tensor."""

from __future__ import annotations

import pytest
import torch

from ninfer.artifact.weights import WeightSet
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.execution.parameters import Qwen4ExpParameters, WeightsError

transformers = pytest.importorskip("transformers")

_TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
             linear_value_head_dim=8, layer_types=["linear_attention", "indexed_attention"], num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, hc_count=2,
             hc_lowrank=4, ple_layer_ids=[1], ple_embed_dim=8, heads_per_ngram=2, ngram_vocab_size_base=50,
             make_ngram_vocab_size_divisible_by=8, eos_token_id=3, indexer_n_heads=2, indexer_kv_heads=1,
             indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4)


@pytest.fixture(scope="module")
def hf_tensors():
    hf_config = transformers.Qwen4ExpTextConfig(**_TINY)
    hf = transformers.Qwen4ExpForCausalLM(hf_config)
    return parse_config(hf_config.to_dict()), {k: v.detach().clone() for k, v in hf.state_dict().items()}


def test_parameters_hold_every_part(hf_tensors):
    config, tensors = hf_tensors
    params = Qwen4ExpParameters.from_weights(config, WeightSet.from_tensors(tensors), torch.float32, "cpu",
                                             experts="cpu")
    assert [layer.ple is not None for layer in params.layers] == [True, False]
    assert [layer.indexer is not None for layer in params.layers] == [False, True]
    assert params.mixer.inject is None and params.layers[0].attn_hc.inject.shape == (2, 32)
    assert len(params.expert_banks()) == 4 and len(params.ngram_tables()) == 1
    ple = params.layers[0].ple
    emb = "model.layers.0.ple.ple_embedding."
    assert ple.multipliers.tolist() == tensors[emb + "layer_multipliers"].tolist()
    assert ple.head_vocab.tolist() == tensors[emb + "ngram_heads_vocab_sizes"].tolist()
    assert ple.head_offsets.tolist() == tensors[emb + "ngram_heads_offsets"].tolist()
    assert ple.table is tensors[emb + "ngram_embedding.weight"]  # left where the weights keep it


@pytest.mark.parametrize("name, change", [
    ("model.layers.0.attn_hyper_connection.block_inject_weight.weight", "drop"),
    ("model.hyper_connection_mixer.input_mix_weight_up.weight", "drop"),
    ("model.layers.0.ple.conv1d.weight", "drop"),
    ("model.layers.1.self_attn.indexer.index_qk_proj.weight", "shape"),
    ("model.layers.0.ple.ple_embedding.ngram_embedding.weight", "shape"),
])
def test_missing_or_misshaped_weights_are_named(hf_tensors, name, change):
    config, tensors = hf_tensors
    tensors = dict(tensors)
    if change == "drop":
        del tensors[name]
    else:
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    with pytest.raises(WeightsError, match=name.replace(".", r"\.")):
        Qwen4ExpParameters.from_weights(config, WeightSet.from_tensors(tensors), torch.float32)


def test_a_table_short_of_its_hash_heads_rows_is_refused(hf_tensors):
    config, tensors = hf_tensors
    name = "model.layers.0.ple.ple_embedding.ngram_embedding.weight"
    tensors = {**tensors, name: tensors[name][:100]}
    with pytest.raises(WeightsError, match=name.replace(".", r"\.") + r" \(100, 2\) \(want \(240, 2\)\)"):
        Qwen4ExpParameters.from_weights(config, WeightSet.from_tensors(tensors), torch.float32)
