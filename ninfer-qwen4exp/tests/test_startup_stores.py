"""Qwen4Exp's stores: the StateImage fields and the KV pool its Startup declares, from a meta config."""

from __future__ import annotations

import pytest
import torch

from ninfer.core.device import Device
from ninfer.core.state_store import StateImageStorage
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.state import kv_pools, state_layout


def raw_config(**over) -> dict:
    """A tiny Qwen4Exp text config in transformers' names (QSA on the attention layer, PLE on layer 2)."""
    raw = dict(vocab_size=448, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=16, shared_expert_intermediate_size=16, hc_count=4, hc_lowrank=8,
               ple_layer_ids=[2], ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=101,
               make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
               indexer_budget=8, indexer_compress_ratio=4, eos_token_id=3, rms_norm_eps=1e-6,
               max_position_embeddings=4096, tie_word_embeddings=False, model_type="qwen4_exp_text",
               layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"])
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not None}


def test_state_layout_adds_ple_conv_and_ngram_history():
    config = parse_config(raw_config())
    layout = state_layout(config, "float32")
    names = [f.name for f in layout.fields]
    assert names == ["conv", "recurrent", "ple_conv", "ngram"]
    ple_conv, ngram = layout.field("ple_conv"), layout.field("ngram")
    # (kernel - 1) * dilation (= ngram_size) earlier positions of the 4 x 32 wide residual, for the one PLE layer
    assert (ple_conv.shape, ple_conv.layers, ple_conv.dtype) == ((9, 128), 1, "float32")
    assert (ngram.shape, ngram.layers, ngram.dtype) == ((2,), 1, "int64")
    conv, rec = layout.field("conv"), layout.field("recurrent")
    assert conv.layers == rec.layers == 3  # one per GDN layer
    assert conv.shape == (2 * 2 * 8 + 4 * 8, 3) and rec.shape == (4, 8, 8) and rec.dtype == "float32"
    aligned = [-(-n // 256) * 256 for n in (64 * 3 * 4 * 3, 4 * 8 * 8 * 4 * 3, 9 * 128 * 4, 2 * 8)]
    assert layout.nbytes_per_slot == sum(aligned)


def test_state_layout_without_ple_is_qwen35s():
    config = parse_config(raw_config(ple_layer_ids=None))
    layout = state_layout(config, "bfloat16")
    assert [f.name for f in layout.fields] == ["conv", "recurrent"]
    assert layout.field("conv").dtype == "bfloat16" and layout.field("recurrent").dtype == "float32"


def test_state_storage_views_of_the_layout():
    """The int64 n-gram history and the PLE conv history are typed views of each slot's one image."""
    config = parse_config(raw_config())
    states = StateImageStorage(state_layout(config, "bfloat16"), 3, Device.parse("cpu"))
    ngram, ple = states.view("ngram"), states.view("ple_conv")
    assert ngram.shape == (3, 1, 2) and ngram.dtype == torch.int64
    assert ple.shape == (3, 1, 9, 128) and ple.dtype == torch.bfloat16
    a, b = states.allocate(), states.allocate()
    ngram[a, 0] = torch.tensor([7, 3])
    ple[a].fill_(1.5)
    states.copy_slot(a, b)  # a fork copies the whole image: the histories come with it
    assert ngram[b, 0].tolist() == [7, 3] and bool((ple[b] == 1.5).all())
    host = states.save(b)
    states.zero(b)
    states.restore(b, host)
    assert ngram[b, 0].tolist() == [7, 3]


def test_kv_pool_main_over_the_attention_layers():
    config = parse_config(raw_config(indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None,
                                     indexer_budget=None, indexer_compress_ratio=None))
    (pool,) = kv_pools(config, page_size=8, dtype="float32")
    assert (pool.name, pool.layers, pool.kv_heads, pool.head_dim, pool.page_size) == ("main", 1, 2, 16, 8)
    assert pool.dtype == "float32"


def test_layout_refuses_a_config_without_gdn_layers():
    with pytest.raises(ValueError, match="no linear_attention layers"):
        state_layout(parse_config(raw_config(num_hidden_layers=1, layer_types=["indexed_attention"],
                                             ple_layer_ids=None)))
