"""Native Parameters (binding checks, LinearSplit fused/fallback, dtype), StateImage layout and KV pools."""

import pytest
import torch

from ninfer.contract.state import StateImageLayout
from ninfer.models.common.weights import WeightSet
from ninfer_qwen35.config import parse_config
from ninfer_qwen35.execution.forward_batch import ForwardBatch, ModelStateViews
from ninfer_qwen35.execution.linear import LinearSplit
from ninfer_qwen35.execution.model import Qwen35Model
from ninfer_qwen35.execution.parameters import GDNParams, Qwen35Parameters, WeightsError
from ninfer_qwen35.source_mapping import expected_parameters, fused_parents
from ninfer_qwen35.state import kv_pools, state_layout

RAW = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 2,
       "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
       "tie_word_embeddings": True}


def random_tensors(config, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen) * 0.3 for n, (_, shape) in expected_parameters(config).items()}


def test_state_layout_and_kv_pools():
    c = parse_config(RAW)
    layout = state_layout(c, "bfloat16")
    assert isinstance(layout, StateImageLayout)
    conv, rec = layout.field("conv"), layout.field("recurrent")
    assert (conv.shape, conv.dtype, conv.layers) == ((2 * 16 + 32, 3), "bfloat16", 3)
    assert (rec.shape, rec.dtype, rec.layers) == ((4, 8, 8), "float32", 3)
    (pool,) = kv_pools(c, page_size=8)
    assert (pool.name, pool.layers, pool.kv_heads, pool.head_dim, pool.page_size) == ("main", 1, 1, 16, 8)


def test_linear_split_uses_the_fused_parent_or_concatenates_once():
    c = parse_config(RAW)
    tensors = random_tensors(c)
    names = [f"model.layers.0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
    fused = LinearSplit.from_weights(WeightSet.from_tensors(tensors, fused_parents(c)), names, torch.float32)
    loose = LinearSplit.from_weights(WeightSet.from_tensors(tensors), names, torch.float32)
    assert fused.shares_parent and not loose.shares_parent
    assert fused.sizes == (64, 32, 4, 4)
    x = torch.randn(5, 32)
    for got_f, got_l, n in zip(fused(x), loose(x), names, strict=True):
        torch.testing.assert_close(got_f, x @ tensors[n].t())
        torch.testing.assert_close(got_l, got_f)
    half = LinearSplit.from_weights(WeightSet.from_tensors(tensors, fused_parents(c)), names, torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16 and not half.shares_parent


def test_parameters_bind_tied_head_and_count_shared_bytes_once():
    c = parse_config(RAW)
    params = Qwen35Parameters.from_weights(c, WeightSet.from_tensors(random_tensors(c), fused_parents(c)))
    assert params.lm_head is params.embed
    assert [layer.kind for layer in params.layers] == list(c.layer_types)
    gdn = params.layers[0].mixer
    assert isinstance(gdn, GDNParams) and gdn.conv.shape == (c.conv_dim, 4) and gdn.A_log.dtype == torch.float32
    total = sum(t.numel() for t in random_tensors(c).values()) * 4
    assert params.nbytes == total
    bf = Qwen35Parameters.from_weights(c, WeightSet.from_tensors(random_tensors(c), fused_parents(c)),
                                       torch.bfloat16)
    assert bf.embed.dtype == torch.bfloat16 and bf.layers[0].mixer.A_log.dtype == torch.float32


def test_missing_and_misshapen_weights_are_named():
    c = parse_config(RAW)
    tensors = random_tensors(c)
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    tensors["model.layers.1.linear_attn.A_log"] = torch.zeros(3)
    with pytest.raises(WeightsError, match=r"1 missing: model\.layers\.3\.self_attn\.k_norm\.weight.*"
                                           r"model\.layers\.1\.linear_attn\.A_log \(3,\) \(want \(4,\)\)"):
        Qwen35Parameters.from_weights(c, WeightSet.from_tensors(tensors))
    untied = parse_config({**RAW, "tie_word_embeddings": False})
    with pytest.raises(WeightsError, match="lm_head.weight"):
        Qwen35Parameters.from_weights(untied, WeightSet.from_tensors(random_tensors(c)))


def test_forward_rejects_state_views_of_another_layout():
    c = parse_config(RAW)
    model = Qwen35Model(Qwen35Parameters.from_weights(c, WeightSet.from_tensors(random_tensors(c))))
    one = torch.zeros(1, dtype=torch.int64)
    batch = ForwardBatch(input_ids=one, positions=one, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                         seq_lens=torch.ones(1, dtype=torch.int32), state_slots=one,
                         has_initial_state=torch.zeros(1, dtype=torch.bool),
                         block_tables=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=one, logits_indices=one,
                         max_query_len=1, max_seq_len=1)
    state = ModelStateViews(conv=torch.zeros(1, 3, c.conv_dim, 3), recurrent=torch.zeros(1, 3, 4, 8, 4),
                            kv=[(torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 16))], page_size=16)
    with pytest.raises(ValueError, match="do not match the config's StateImage layout"):
        model.forward(batch, state)


def test_text_part_of_a_vl_checkpoint_binds_the_same_parameters():
    from ninfer_qwen35.source_mapping import canonical_name

    c = parse_config({"text_config": RAW, "vision_config": {"depth": 1}, "image_token_id": 5,
                      "tie_word_embeddings": True})
    flat = random_tensors(c)
    vl = {("model.language_model." + n[len("model."):]) if n.startswith("model.") else n: t for n, t in flat.items()}
    vl["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)  # vision weights are not the text model's
    text = {}
    for name, t in vl.items():
        feature, logical = canonical_name(name)
        if feature == "text":
            text[logical] = t
    params = Qwen35Parameters.from_weights(c, WeightSet.from_tensors(text, fused_parents(c)))
    ref = Qwen35Parameters.from_weights(c, WeightSet.from_tensors(flat, fused_parents(c)))
    for a, b in zip(params.tensors(), ref.tensors(), strict=True):
        assert torch.equal(a, b)
