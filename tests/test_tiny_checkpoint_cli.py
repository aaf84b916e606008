"""``ninfer tiny-checkpoint`` end to end, offline: write a Hugging Face checkpoint, ``ninfer convert`` it,
generate a few tokens on the CPU (the CLI and the public Engine)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")
pytest.importorskip("transformers")

import ninfer  # noqa: E402
from ninfer.cli import main  # noqa: E402
from ninfer.contract.prompt import TextInput  # noqa: E402
from ninfer.contract.request import GenerationRequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

HF_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_tiny_checkpoint_converts_and_generates(tmp_path, capsys):
    ckpt, art = tmp_path / "tiny", tmp_path / "tiny.ninfer"
    assert main(["tiny-checkpoint", str(ckpt), "--seed", "7", "--layers", "8"]) == 0
    assert f"next: ninfer convert {ckpt} {art}" in capsys.readouterr().out
    assert sorted(f.name for f in ckpt.iterdir()) == HF_FILES
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["num_hidden_layers"] == 8
    assert config["mtp_num_hidden_layers"] == 1
    assert "chat_template" in json.loads((ckpt / "tokenizer_config.json").read_text())

    assert main(["convert", str(ckpt), str(art)]) == 0
    assert "features text, mtp" in capsys.readouterr().out
    assert main(["generate", str(art), "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0",
                 "--ignore-eos", "--device", "cpu"]) == 0
    with ninfer.Engine(art, ninfer.EngineConfig(device="cpu", max_concurrency=1)) as engine:
        res = engine.generate(GenerationRequest(input=TextInput(text="Hello"), sampling=SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=120)
    assert res.usage.completion_tokens == 4


def test_the_same_seed_writes_the_same_weights_and_a_used_directory_is_refused(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["tiny-checkpoint", str(tmp_path / name), "--seed", "3", "--no-mtp"]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["tiny-checkpoint", str(tmp_path / "a")]) == 2
    assert "exists and is not an empty directory; nothing was written" in capsys.readouterr().err
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a", "b"]  # no partial folder left behind
    with pytest.raises(SystemExit) as info:
        main(["tiny-checkpoint", str(tmp_path / "c"), "--layers", "3"])
    assert info.value.code == 2 and "must be >= 4" in capsys.readouterr().err


def test_a_tiny_moe_checkpoint_converts_and_inspect_shows_its_expert_banks(tmp_path, capsys, monkeypatch):
    ckpt, art = tmp_path / "moe", tmp_path / "moe.ninfer"
    monkeypatch.setenv("NINFER_COMMAND", "scripts/ninfer")  # as the checkout's wrapper runs it
    assert main(["tiny-checkpoint", str(ckpt), "--moe", "--no-mtp"]) == 0
    out = capsys.readouterr().out
    assert "(Qwen3_5MoeForCausalLM, 4 layers" in out and f"next: scripts/ninfer convert {ckpt} {art}" in out
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"] and config["num_experts"] == 8
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(art)]) == 0
    assert main(["inspect", str(art)]) == 0
    assert "expert banks" in capsys.readouterr().out
    assert main(["generate", str(art), "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0",
                 "--ignore-eos", "--device", "cpu"]) == 0
