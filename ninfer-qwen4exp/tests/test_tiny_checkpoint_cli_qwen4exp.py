"""``ninfer tiny-checkpoint --arch qwen4exp [--vl]``: the shared command picks Qwen4Exp's maker from the registry;
what it writes converts."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")

from ninfer.cli import main  # noqa: E402


def test_text_checkpoint_writes_and_converts(tmp_path, capsys):
    ckpt = tmp_path / "q4"
    assert main(["tiny-checkpoint", str(ckpt), "--arch", "qwen4exp", "--variant", "ple", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "wrote a tiny random qwen4exp ple checkpoint" in out and "(Qwen4ExpForCausalLM, 4 layers, MTP" in out
    config = json.loads((ckpt / "config.json").read_text())
    assert config["ple_layer_ids"] == [2, 3] and config["dtype"] == "bfloat16"
    assert main(["convert", str(ckpt), str(tmp_path / "q4.ninfer")]) == 0
    assert "features text, mtp" in capsys.readouterr().out


def test_vl_checkpoint_writes_and_converts(tmp_path, capsys):
    ckpt = tmp_path / "vl"
    assert main(["tiny-checkpoint", str(ckpt), "--arch", "qwen4exp", "--vl", "--no-mtp"]) == 0
    assert "(Qwen4ExpForConditionalGeneration, 4 layers, seed 0" in capsys.readouterr().out
    assert (ckpt / "preprocessor_config.json").is_file() and (ckpt / "model.safetensors.index.json").is_file()
    assert main(["convert", str(ckpt), str(tmp_path / "vl.ninfer")]) == 0
    assert "features text, vision" in capsys.readouterr().out


def test_a_variant_the_architecture_lacks_is_refused_leaving_nothing(tmp_path, capsys):
    assert main(["tiny-checkpoint", str(tmp_path / "x"), "--arch", "qwen4exp", "--moe"]) == 2
    err = capsys.readouterr().err
    assert "unknown tiny Qwen4Exp variant 'moe'; known: plain, qsa, ple, full" in err and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as info:
        main(["tiny-checkpoint", str(tmp_path / "y"), "--arch", "qwen9"])
    assert info.value.code == 2 and "invalid choice: 'qwen9'" in capsys.readouterr().err
