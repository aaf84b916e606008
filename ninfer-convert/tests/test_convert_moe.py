"""A tiny Qwen3.5 MoE checkpoint (VL naming, sharded, MTP with its own MoE block) converts to the same expert
banks whether it stores them fused and 3-D (the published layout) or per expert (fine-tunes, Qwen3-MoE-style
exports): the Qwen3.5 source mapping's stacked sources."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("ninfer_qwen35")

from safetensors.torch import load_file, save_file  # noqa: E402

from ninfer.artifact import load_weights, open_artifact  # noqa: E402
from ninfer_convert.convert import convert_checkpoint  # noqa: E402
from ninfer_convert.source import ConversionError  # noqa: E402
from ninfer_qwen35.testing.checkpoints import TINY_MOE, make_tiny_checkpoint  # noqa: E402

_BANK = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def _split_experts(ckpt: Path) -> None:
    """Rewrite every fused bank of every shard (and the index) as per-expert tensors."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(str(ckpt / shard)).items():
            m = _BANK.match(name)
            if m is None:
                out[name] = t
                continue
            del index["weight_map"][name]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                parts = ({f"{e}.gate_proj.weight": t[e, :inter], f"{e}.up_proj.weight": t[e, inter:]}
                         if m.group(2) == "gate_up_proj" else {f"{e}.down_proj.weight": t[e]})
                for suffix, part in parts.items():
                    out[m.group(1) + suffix] = part.clone()
                    index["weight_map"][m.group(1) + suffix] = shard
        save_file(out, str(ckpt / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "fused", layout="vl", moe=True)


def test_per_expert_checkpoint_converts_to_the_published_banks(fused_ckpt, tmp_path):
    split = Path(shutil.copytree(fused_ckpt, tmp_path / "split"))
    _split_experts(split)
    assert any(".mlp.experts.7.up_proj.weight" in n for n in
               json.loads((split / "model.safetensors.index.json").read_text())["weight_map"])
    a = convert_checkpoint(fused_ckpt, tmp_path / "fused.ninfer")
    b = convert_checkpoint(split, tmp_path / "split.ninfer")
    assert a.features == b.features == ("text", "mtp", "vision") and a.objects == b.objects
    with open_artifact(tmp_path / "fused.ninfer") as fa, open_artifact(tmp_path / "split.ninfer") as fb:
        wa, _ = load_weights(fa, features=("text", "mtp"))
        wb, _ = load_weights(fb, features=("text", "mtp"))
        assert sorted(wa) == sorted(wb)
        banks = [n for n in wa if _BANK.match(n)]
        assert "mtp.layers.0.mlp.experts.gate_up_proj" in banks and "model.layers.0.mlp.experts.down_proj" in banks
        assert all(wb[n].shape[0] == TINY_MOE["num_experts"] for n in banks)
        for n in wa:
            assert torch.equal(wa[n], wb[n]), n


def test_per_expert_checkpoint_missing_an_expert_is_named(fused_ckpt, tmp_path):
    split = Path(shutil.copytree(fused_ckpt, tmp_path / "split"))
    _split_experts(split)
    index_path = split / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.language_model.layers.2.mlp.experts.5.down_proj.weight"
    shard = split / index["weight_map"].pop(name)
    save_file({k: v for k, v in load_file(str(shard)).items() if k != name}, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=rf"'model\.layers\.2\.mlp\.experts\.down_proj' is stacked from 8 "
                                              rf"tensors but the checkpoint lacks 1 of them: '{re.escape(name)}'"):
        convert_checkpoint(split, tmp_path / "m.ninfer")
