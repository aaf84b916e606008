"""The tiny Qwen4Exp checkpoints: written by transformers' own classes in the published tensor names, every
parameter non-trivial, deterministic from the seed, loadable back by transformers."""

import json

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402

from ninfer_qwen4exp.testing import VARIANTS, make_tiny_checkpoint  # noqa: E402


def tensors(ckpt) -> dict:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "full", variant="full", seed=3)


def test_published_names_and_files(full):
    names = set(tensors(full))
    config = json.loads((full / "config.json").read_text())
    assert config["architectures"] == ["Qwen4ExpForCausalLM"] and config["model_type"] == "qwen4_exp_text"
    assert config["mtp_num_hidden_layers"] == 1 and config["eos_token_id"] is not None
    # the n-gram tables as split_ngram_parts row chunks, the experts one by one, no final norm
    assert {f"model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_{k}.weight" for i in (1, 2) for k in range(4)} <= names
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names and "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert "model.hyper_connection_mixer.input_mix_weight_up.weight" in names and "model.norm.weight" not in names
    assert "mtp.layers.0.self_attn.indexer.index_qk_proj.weight" in names and "mtp.fc_hidden.weight" in names
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (full / f).is_file()
    vocab = json.loads((full / "tokenizer.json").read_text())
    top = max([*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab["added_tokens"])])
    assert top < config["vocab_size"]


def test_every_parameter_is_perturbed(full):
    for name, t in tensors(full).items():
        if t.is_floating_point():  # norms (zeros in transformers' init), the PLE conv (zeros), dt_bias (ones)
            assert t.std() > 0.01 and not torch.all(t == t.flatten()[0]), name


def test_transformers_loads_it_back_unchanged(full):
    import transformers

    model = transformers.Qwen4ExpForCausalLM.from_pretrained(full, dtype=torch.float32)
    saved = tensors(full)
    state = model.state_dict()
    assert torch.equal(state["model.layers.1.ple.ple_embedding.ngram_embedding.weight"],
                       torch.cat([saved[f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{k}.weight"]
                                  for k in range(4)]))
    assert torch.equal(state["model.layers.3.self_attn.indexer.k_layernorm.weight"],
                       saved["model.layers.3.self_attn.indexer.k_layernorm.weight"])


def test_the_seed_decides_the_weights(tmp_path, full):
    again = tensors(make_tiny_checkpoint(tmp_path / "again", variant="full", seed=3))
    other = tensors(make_tiny_checkpoint(tmp_path / "other", variant="full", seed=4))
    first = tensors(full)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["model.hyper_connection_mixer.hc_norm.weight"],
                           other["model.hyper_connection_mixer.hc_norm.weight"])


def test_bf16_and_fused_experts(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "b", variant="plain", dtype="bfloat16", experts="fused", mtp=False)
    saved = tensors(ckpt)
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert saved["model.layers.0.mlp.experts.down_proj"].dtype == torch.bfloat16
    assert saved["model.layers.0.linear_attn.A_log"].dtype == torch.float32  # as published
    assert not any(n.startswith("mtp.") or ".experts.0." in n for n in saved)


def test_variants_are_data_and_bad_choices_are_refused(tmp_path):
    assert set(VARIANTS) >= {"plain", "qsa", "ple", "full"}
    with pytest.raises(ValueError, match="unknown tiny Qwen4Exp variant 'nope'"):
        make_tiny_checkpoint(tmp_path / "x", variant="nope")
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_checkpoint(tmp_path / "y", dtype="float16")
