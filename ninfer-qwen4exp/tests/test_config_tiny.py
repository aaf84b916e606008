"""Our config of each tiny variant says what transformers' config and model say: geometry, hyper-connections,
QSA, PLE (down to each layer's prime head sizes and table rows)."""

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from ninfer_qwen4exp.config import parse_config  # noqa: E402
from ninfer_qwen4exp.testing import VARIANTS, tiny_text_config  # noqa: E402


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parsed_config_matches_transformers(variant):
    text = tiny_text_config(variant, layers=4, eos_token_id=400)
    hf = transformers.Qwen4ExpTextConfig(**text)
    ours = parse_config(hf.to_dict())
    b = ours.base
    assert (b.hidden_size, b.num_hidden_layers, b.vocab_size, b.head_dim) == (
        hf.hidden_size, hf.num_hidden_layers, hf.vocab_size, hf.head_dim)
    assert ours.layer_types == tuple(hf.layer_types)
    assert (ours.hc_count, ours.hc_lowrank) == (hf.hc_count, hf.hc_lowrank)
    assert ours.output_gate == (hf.output_gate_type or hf.hidden_act)
    assert (b.moe.num_experts, b.moe.num_experts_per_tok, b.moe.moe_intermediate_size,
            b.moe.shared_expert_intermediate_size) == (hf.num_experts, hf.num_experts_per_tok,
                                                       hf.moe_intermediate_size, hf.shared_expert_intermediate_size)
    assert b.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert (ours.qsa.n_heads, ours.qsa.head_dim, ours.qsa.budget, ours.qsa.compress_ratio) == (
        hf.indexer_n_heads, hf.indexer_head_dim, hf.indexer_budget, hf.indexer_compress_ratio)
    assert ours.eos_token_id == 400
    if not hf.ple_layer_ids:
        assert ours.ple is None
        return
    p = ours.ple
    assert p.layers == tuple(i - 1 for i in hf.ple_layer_ids)
    assert (p.embed_dim, p.conv_kernel_size, p.ngram_size, p.heads_per_ngram, p.split_parts, p.seed) == (
        hf.ple_embed_dim, hf.ple_conv_kernel_size, hf.ngram_size, hf.heads_per_ngram, hf.split_ngram_parts, hf.seed)
    model = transformers.Qwen4ExpForCausalLM(hf)
    for k, layer in enumerate(p.layers):
        emb = model.model.layers[layer].ple.ple_embedding
        assert p.head_vocab_sizes(k) == tuple(emb.head_vocab_sizes)
        assert p.head_offsets(k) == tuple(emb.head_offsets)
        assert (p.table_rows(k), p.head_dim) == tuple(emb.ngram_embedding.weight.shape)
        assert sum(p.shard_rows(k)) == p.table_rows(k)


def test_shard_rows_follow_torch_chunk():
    raw = {**tiny_text_config("ple", layers=4, eos_token_id=400), "split_ngram_parts": 3}
    ple = parse_config(raw).ple
    rows = ple.table_rows(0)
    assert ple.shard_rows(0) == tuple(c.shape[0] for c in torch.chunk(torch.empty(rows), 3))
    many = parse_config({**raw, "split_ngram_parts": rows - 1}).ple  # chunk gives fewer pieces than asked
    assert ple.table_rows(0) == sum(many.shard_rows(0))
    assert many.shard_rows(0) == tuple(c.shape[0] for c in torch.chunk(torch.empty(rows), rows - 1))


def test_mtp_depth_from_either_spelling():
    text = tiny_text_config("plain", layers=4, eos_token_id=400)
    assert parse_config({**text, "mtp_num_hidden_layers": 1}).base.mtp_num_hidden_layers == 1
    published = {**text, "mtp": {"hybrid": True, "layer_types": ["full_attention"], "num_hidden_layers": 1}}
    assert parse_config(published).base.mtp_num_hidden_layers == 1
    assert parse_config({"text_config": published}).base.mtp_num_hidden_layers == 1
    assert parse_config(text).base.mtp_num_hidden_layers == 0


@pytest.mark.parametrize("name", ["full_attention", "qwen_sparse_attention"])
def test_every_spelling_of_the_indexed_layer_parses_alike(name):
    # the published config says full_attention; older transformers (5.17) saves qwen_sparse_attention
    text = tiny_text_config("qsa", layers=4, eos_token_id=400)
    kinds = ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"]
    text = {**text, "layer_types": kinds}
    spelled = {**text, "layer_types": [name if t == "indexed_attention" else t for t in kinds]}
    assert parse_config(spelled) == parse_config(text)
