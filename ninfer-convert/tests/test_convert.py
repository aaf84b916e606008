"""ninfer convert: bad input gives a clear error naming the tensor or field, and never a partial output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("ninfer_qwen35")

from safetensors.torch import load_file, save_file  # noqa: E402

from ninfer.artifact import load_weights, open_artifact  # noqa: E402
from ninfer.cli import main as ninfer_main  # noqa: E402
from ninfer_convert.convert import convert_checkpoint  # noqa: E402
from ninfer_convert.source import Checkpoint, ConversionError  # noqa: E402
from ninfer_qwen35.testing.checkpoints import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    return {"text": make_tiny_checkpoint(root / "text", layout="text"),
            "vl": make_tiny_checkpoint(root / "vl", layout="vl")}


@pytest.fixture
def text_ckpt(base, tmp_path):
    return Path(shutil.copytree(base["text"], tmp_path / "src"))


@pytest.fixture
def vl_ckpt(base, tmp_path):
    return Path(shutil.copytree(base["vl"], tmp_path / "src"))


def _edit_tensors(ckpt: Path, edit) -> None:
    path = ckpt / "model.safetensors"
    tensors = dict(load_file(str(path)))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(ckpt: Path, edit) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg.get("text_config", cfg), cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _fails(ckpt: Path, tmp_path: Path, match: str) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    with pytest.raises(ConversionError, match=match):
        convert_checkpoint(ckpt, out_dir / "model.ninfer")
    assert list(out_dir.iterdir()) == []  # no partial or temporary file


def test_convert_cli_and_summary(text_ckpt, tmp_path, capsys):
    out = tmp_path / "m.ninfer"
    assert ninfer_main(["convert", str(text_ckpt), str(out), "--name", "tiny-qwen", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out and "features text, mtp" in captured.out and "GB/s" in captured.out
    assert "converting src" in captured.err  # the progress line
    with open_artifact(out) as art:
        assert art.metadata.name == "tiny-qwen" and art.metadata.architecture == "Qwen3_5ForCausalLM"


def test_the_default_name_is_the_checkpoint_folders(text_ckpt, tmp_path):
    """Without --name the artifact, and so the model ``ninfer serve`` names, is called after its checkpoint folder;
    a snapshot of the Hugging Face cache after its repository id."""
    snapshot = tmp_path / "hub" / "models--acme--tiny-qwen" / "snapshots" / ("ab" * 20)
    shutil.copytree(text_ckpt, snapshot)
    assert ninfer_main(["convert", str(text_ckpt) + "/", str(tmp_path / "a.ninfer")]) == 0
    assert ninfer_main(["convert", str(snapshot), str(tmp_path / "b.ninfer")]) == 0
    names = []
    for out in ("a.ninfer", "b.ninfer"):
        with open_artifact(tmp_path / out) as art:
            names.append(art.metadata.name)
    assert names == ["src", "acme/tiny-qwen"]


def test_missing_tensor(text_ckpt, tmp_path):
    _edit_tensors(text_ckpt, lambda t: t.pop("model.layers.2.linear_attn.in_proj_z.weight"))
    _fails(text_ckpt, tmp_path, r"missing tensor 'model\.layers\.2\.linear_attn\.in_proj_z\.weight'")


def test_missing_mtp_tensor(text_ckpt, tmp_path):
    _edit_tensors(text_ckpt, lambda t: t.pop("mtp.fc.weight"))
    _fails(text_ckpt, tmp_path, r"missing tensor 'mtp\.fc\.weight'")


def test_misshaped_tensor(vl_ckpt, tmp_path):
    index = json.loads((vl_ckpt / "model.safetensors.index.json").read_text())
    name = "model.language_model.layers.3.self_attn.k_proj.weight"
    shard = vl_ckpt / index["weight_map"][name]
    tensors = dict(load_file(str(shard)))
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _fails(vl_ckpt, tmp_path, rf"tensor '{name}' has shape \[31, 64\] but config.json implies \[32, 64\]")


def test_unknown_architecture(text_ckpt, tmp_path):
    _edit_config(text_ckpt, lambda text, top: top.update(architectures=["MysteryForCausalLM"]))
    _fails(text_ckpt, tmp_path, "unknown architecture.*'MysteryForCausalLM'")


def test_no_architectures_field(text_ckpt, tmp_path):
    _edit_config(text_ckpt, lambda text, top: top.pop("architectures"))
    _fails(text_ckpt, tmp_path, "no 'architectures'")


def test_config_with_fewer_layers_than_the_weights(text_ckpt, tmp_path):
    def edit(text, top):
        text["num_hidden_layers"] = 3
        text["layer_types"] = text["layer_types"][:3]
    _edit_config(text_ckpt, edit)
    _fails(text_ckpt, tmp_path, r"'model\.layers\.3\..*' .*config disagrees with the weights")


def test_config_with_another_hidden_size(text_ckpt, tmp_path):
    _edit_config(text_ckpt, lambda text, top: text.update(hidden_size=128))
    _fails(text_ckpt, tmp_path, r"has shape \[512, 64\] but config.json implies \[512, 128\]")


def test_config_without_mtp_but_mtp_weights(text_ckpt, tmp_path):
    _edit_config(text_ckpt, lambda text, top: text.update(mtp_num_hidden_layers=0))
    _fails(text_ckpt, tmp_path, "has mtp tensors .* does not configure mtp")


def test_invalid_config_field(text_ckpt, tmp_path):
    _edit_config(text_ckpt, lambda text, top: text.pop("hidden_size"))
    _fails(text_ckpt, tmp_path, "config.json.*hidden_size")


def test_tokenizer_larger_than_embedding(text_ckpt, tmp_path):
    def edit(tensors):
        for n in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[n] = tensors[n][:300].clone()
    _edit_tensors(text_ckpt, edit)
    _edit_config(text_ckpt, lambda text, top: text.update(vocab_size=300))
    _fails(text_ckpt, tmp_path, "tokenizer.json has token id .* 300 rows")


def test_missing_tokenizer(text_ckpt, tmp_path):
    (text_ckpt / "tokenizer.json").unlink()
    _fails(text_ckpt, tmp_path, "tokenizer.json not found")


def test_corrupt_safetensors(text_ckpt, tmp_path):
    (text_ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    _fails(text_ckpt, tmp_path, "cannot read safetensors file .*model.safetensors")


def test_index_names_a_missing_shard(vl_ckpt, tmp_path):
    index = json.loads((vl_ckpt / "model.safetensors.index.json").read_text())
    (vl_ckpt / index["weight_map"]["mtp.fc.weight"]).unlink()
    _fails(vl_ckpt, tmp_path, "shard not found: .*model-mtp.safetensors")


def test_failure_mid_write_keeps_the_old_output(text_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "model.ninfer"
    out.write_bytes(b"previous artifact")
    real_read = Checkpoint.read

    def flaky(self, name):
        if name.startswith("model.layers.2."):
            raise ConversionError(f"cannot read tensor {name!r}: simulated I/O error")
        return real_read(self, name)

    monkeypatch.setattr(Checkpoint, "read", flaky)
    with pytest.raises(ConversionError, match="simulated"):
        convert_checkpoint(text_ckpt, out)
    assert out.read_bytes() == b"previous artifact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ninfer", "src"]


def test_cli_reports_errors(text_ckpt, tmp_path, capsys):
    _edit_tensors(text_ckpt, lambda t: t.pop("model.norm.weight"))
    assert ninfer_main(["convert", str(text_ckpt), str(tmp_path / "x.ninfer")]) == 2
    err = capsys.readouterr().err
    assert "missing tensor 'model.norm.weight'" in err and "nothing was written" in err
    assert not (tmp_path / "x.ninfer").exists()


def test_vision_config_without_vision_weights_is_noted(vl_ckpt, tmp_path):
    index_path = vl_ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {k: v for k, v in load_file(str(vl_ckpt / shard)).items() if not k.startswith("model.visual.")}
        save_file(tensors, str(vl_ckpt / shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("model.visual.")}
    index_path.write_text(json.dumps(index))
    summary = convert_checkpoint(vl_ckpt, tmp_path / "m.ninfer")
    assert summary.features == ("text", "mtp") and any("vision" in n for n in summary.notes)
    with open_artifact(tmp_path / "m.ninfer") as art:
        weights, _ = load_weights(art, features=("text", "mtp"))
        assert torch.equal(weights["mtp.fc.weight"], load_file(str(vl_ckpt / "model-mtp.safetensors"))["mtp.fc.weight"])


def test_chat_template_jinja_file_wins(text_ckpt, tmp_path):
    (text_ckpt / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    convert_checkpoint(text_ckpt, tmp_path / "m.ninfer")
    with open_artifact(tmp_path / "m.ninfer") as art:
        assert art.frontend.chat_template == "{{ messages[0]['content'] }}"


def test_named_chat_templates_and_no_generation_config(text_ckpt, tmp_path):
    cfg_path = text_ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    cfg_path.write_text(json.dumps(cfg))
    (text_ckpt / "generation_config.json").unlink()
    seen = []
    convert_checkpoint(text_ckpt, tmp_path / "m.ninfer", progress=lambda done, total: seen.append((done, total)))
    with open_artifact(tmp_path / "m.ninfer") as art:
        fe = art.frontend
        assert fe.chat_template == "D" and fe.generation_config == {}
        assert fe.eos_token_ids == (fe.special_tokens["<|endoftext|>"],)  # falls back to config.json
        assert seen[-1][0] == seen[-1][1] == sum(o.nbytes for o in art.header.objects)


def test_convert_tiny_makes_a_checkpoint_when_empty(tmp_path):
    from ninfer_qwen35.testing.checkpoints import convert_tiny

    out = convert_tiny(tmp_path / "empty", tmp_path / "t.ninfer")
    with open_artifact(out) as art:
        assert art.features == ("text", "mtp")


def test_tied_checkpoint_with_a_stray_lm_head_copy(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tied", layout="text", tie_word_embeddings=True, mtp=False)
    _edit_tensors(ckpt, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    summary = convert_checkpoint(ckpt, tmp_path / "m.ninfer")
    assert summary.skipped == ("lm_head.weight",) and summary.features == ("text",)
    with open_artifact(tmp_path / "m.ninfer") as art:
        assert "lm_head.weight" not in art.bindings
        assert any(u.site == "lm_head" and u.binding == "model.embed_tokens.weight" for u in art.uses)


def test_vision_tensors_are_validated_too(vl_ckpt, tmp_path):
    index = json.loads((vl_ckpt / "model.safetensors.index.json").read_text())
    name = "model.visual.blocks.1.attn.qkv.bias"
    shard = vl_ckpt / index["weight_map"][name]
    tensors = dict(load_file(str(shard)))
    tensors.pop(name)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"].pop(name)
    (vl_ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(vl_ckpt, tmp_path, r"missing tensor 'visual\.blocks\.1\.attn\.qkv\.bias' \(vision\)")
