"""``ninfer convert`` of tiny Qwen4Exp checkpoints: every tensor lands unchanged in its artifact object (the
n-gram table assembled from its shards, the experts as banks), ``ninfer inspect`` shows the new objects, and a
checkpoint missing a tensor or with a wrong table or layer type is refused by name with no file left."""

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from ninfer.artifact import load_weights, open_artifact  # noqa: E402
from ninfer.cli import main  # noqa: E402
from ninfer_convert.convert import convert_checkpoint  # noqa: E402
from ninfer_convert.source import ConversionError  # noqa: E402
from ninfer_qwen4exp.testing import VARIANTS, make_tiny_checkpoint  # noqa: E402

TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4")
    return {v: make_tiny_checkpoint(root / v, variant=v, seed=1) for v in VARIANTS}


def artifact_weights(path, features=("text",)):
    with open_artifact(path) as art:
        weights, _ = load_weights(art, features=features, device="cpu")
        return weights, art.header


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_tensor_lands_unchanged(checkpoints, tmp_path, variant):
    out = tmp_path / f"{variant}.ninfer"
    summary = convert_checkpoint(checkpoints[variant], out)
    assert summary.architecture == "Qwen4ExpForCausalLM" and summary.features == ("text", "mtp")
    state = transformers.Qwen4ExpForCausalLM.from_pretrained(checkpoints[variant], dtype=torch.float32).state_dict()
    weights, header = artifact_weights(out)
    compared = [n for n in state if not n.endswith(("inv_freq", "layer_multipliers", "vocab_sizes", "offsets"))]
    assert all(torch.equal(weights[n], state[n]) for n in compared)
    objects = {o.id: o for o in header.objects}
    assert "model.norm.weight" not in objects and not any("input_layernorm" in o for o in objects)
    if VARIANTS[variant].get("ple_layer_ids"):  # one object per n-gram table, bound whole
        assert objects[TABLE].shape == tuple(state[TABLE].shape)
        binding = next(b for b in header.bindings if b.name == TABLE)
        assert binding.object == TABLE and binding.rows is None


def test_inspect_lists_the_new_objects(checkpoints, tmp_path, capsys):
    out = convert_checkpoint(checkpoints["full"], tmp_path / "full.ninfer").out
    assert main(["inspect", "--objects", str(out)]) == 0
    shown = capsys.readouterr().out
    for name in (TABLE, "model.layers.0.attn_hyper_connection.input_mix_weight_down.weight",
                 "model.layers.3.mlp_hyper_connection.block_inject_weight.weight",
                 "model.hyper_connection_mixer.input_mix_weight_up.weight",
                 "model.layers.3.self_attn.indexer.index_qk_proj.weight", "model.layers.2.ple.conv1d.weight",
                 "mtp.fc_hidden.weight", "mtp.hyper_connection_mixer.hc_norm.weight"):
        assert name in shown, name


def test_vl_sharded_bf16_fused_experts_and_unequal_table_shards(tmp_path):
    """The VL layout (model.language_model.*, a vision tower, several files), the fused expert banks, bf16, and a
    table cut into chunks whose last one is shorter (torch.chunk)."""
    ckpt = make_tiny_checkpoint(tmp_path / "vl", variant="full", vl=True, dtype="bfloat16", experts="fused",
                                split_ngram_parts=3)
    saved = {}
    for f in ckpt.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    prefix = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding."
    shards = [saved[f"{prefix}shard_{k}.weight"] for k in range(3)]
    assert shards[0].shape[0] > shards[2].shape[0]
    summary = convert_checkpoint(ckpt, tmp_path / "vl.ninfer")
    assert summary.architecture == "Qwen4ExpForConditionalGeneration"
    assert summary.features == ("text", "mtp", "vision")
    weights, _ = artifact_weights(summary.out, ("text", "vision"))
    assert torch.equal(weights[TABLE], torch.cat(shards))
    assert torch.equal(weights["model.layers.0.mlp.experts.gate_up_proj"],
                       saved["model.language_model.layers.0.mlp.experts.gate_up_proj"])
    assert torch.equal(weights["visual.blocks.0.attn.qkv.weight"], saved["model.visual.blocks.0.attn.qkv.weight"])


def test_quantizing_keeps_the_ngram_table_a_plain_lookup(checkpoints, tmp_path):
    out = convert_checkpoint(checkpoints["ple"], tmp_path / "q.ninfer", quantize="nvfp4").out
    with open_artifact(out) as art:
        dense = art.header.metadata.quantization["dense"]
    assert "row lookup" in dense[TABLE]


def _edited(checkpoints, tmp_path, variant, edit):
    """A copy of a tiny checkpoint with ``edit(tensors, config)`` applied."""
    src = tmp_path / "src"
    shutil.copytree(checkpoints[variant], src)
    tensors = dict(load_file(str(src / "model.safetensors")))
    config = json.loads((src / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(config))
    return src


def _drop(name):
    return lambda tensors, config: tensors.pop(name)


def _wrong_table(tensors, config):
    name = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:1]])


def _unknown_layer_type(tensors, config):
    config["layer_types"][2] = "sliding_attention"


@pytest.mark.parametrize(("edit", "named"), [
    (_drop("model.hyper_connection_mixer.input_mix_weight_up.weight"),
     "model.hyper_connection_mixer.input_mix_weight_up.weight"),
    (_drop("model.layers.0.attn_hyper_connection.block_inject_weight.weight"),
     "model.layers.0.attn_hyper_connection.block_inject_weight.weight"),
    (_drop("model.layers.2.ple.norm_conv.weight"), "model.layers.2.ple.norm_conv.weight"),
    (_drop("model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"),
     "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"),
    (_drop("model.layers.3.self_attn.indexer.q_layernorm.weight"), "model.layers.3.self_attn.indexer.q_layernorm"),
    (_wrong_table, "model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight"),
    (_unknown_layer_type, "sliding_attention"),
], ids=["mixer", "inject", "ple-norm", "table-shard", "indexer", "table-shape", "layer-type"])
def test_bad_checkpoints_are_refused_by_name_leaving_nothing(checkpoints, tmp_path, edit, named):
    src = _edited(checkpoints, tmp_path, "full", edit)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(src, out_dir / "bad.ninfer")
    assert named in str(err.value)
    assert list(out_dir.iterdir()) == []
