"""Stacked sources: a fake MoE architecture whose expert banks are stored fused and 3-D ([E, 2I, H] gate_up,
[E, H, I] down) or per expert (gate/up [I, H], down [H, I]); both layouts give byte-identical banks, and a
per-expert checkpoint that lacks, misshapes, double-claims or mixes parts is refused by name."""

from __future__ import annotations

import json
import re
import sys
import types
from collections.abc import Collection
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ninfer import ArchitectureSpec, hookimpl
from ninfer.artifact import load_weights, open_artifact
from ninfer.artifact.mapping import SourceMapping, StackedSource
from ninfer.plugins import make_plugin_host
from ninfer_convert.convert import convert_checkpoint
from ninfer_convert.source import ConversionError

LAYERS, E, INTER, H, VOCAB = 2, 3, 4, 8, 16  # INTER: the experts' intermediate size (I)
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)\d+\.(?:gate|up|down)_proj\.weight$")


class FakeMoeMapping:
    """Logical names are the published names; per-expert parts stack into the published fused banks."""

    validated_features = ("text",)

    def __init__(self, config: dict) -> None:
        self.config = config

    def canonical_name(self, source_name: str) -> tuple[str, str] | None:
        return ("text", source_name) if source_name.startswith("model.") else None

    def stacked_sources(self, source_names: Collection[str]) -> list[StackedSource]:
        prefixes = sorted({m.group(1) for n in source_names if (m := _PER_EXPERT.match(n))})
        out = []
        for p in prefixes:
            gate_up = [f"{p}{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up")]
            out.append(StackedSource(name=p + "gate_up_proj", feature="text", parts=gate_up,
                                     part_shape=(INTER, H), shape=(E, 2 * INTER, H)))
            out.append(StackedSource(name=p + "down_proj", feature="text", parts=[f"{p}{e}.down_proj.weight" for e in range(E)],
                                     part_shape=(H, INTER), shape=(E, H, INTER)))
        return out

    def configured_features(self) -> tuple[str, ...]:
        return ("text",)

    def expected_parameters(self, features: tuple[str, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        if "text" not in features:
            return {}
        shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,)}
        for i in range(self.config["num_hidden_layers"]):
            m = f"model.layers.{i}.mlp."
            shapes.update({m + "gate.weight": (E, H), m + "experts.gate_up_proj": (E, 2 * INTER, H),
                           m + "experts.down_proj": (E, H, INTER)})
        return {n: ("text", s) for n, s in shapes.items()}

    def fused_parents(self) -> list:
        return []

    def shared_uses(self, bound: set[str], features: tuple[str, ...]) -> list:
        return []

    def embedding_vocab(self) -> int:
        return VOCAB


class _OlderMapping:  # a plugin written before stacked_sources
    validated_features = ("text",)

    def canonical_name(self, source_name): ...

    def configured_features(self): ...

    def expected_parameters(self, features): ...

    def fused_parents(self): ...

    def shared_uses(self, bound, features): ...

    def embedding_vocab(self): ...


@pytest.fixture
def host(monkeypatch):
    mod = types.ModuleType("fake_moe_plugin")
    mod.source_mapping = FakeMoeMapping
    mod.older_mapping = lambda config: _OlderMapping()

    @hookimpl
    def ninfer_register_architectures(register):
        register(ArchitectureSpec(name="fake_moe", handles=("FakeMoeForCausalLM",),
                                  source_mapping="fake_moe_plugin:source_mapping"))
        register(ArchitectureSpec(name="fake_older", handles=("FakeOlderForCausalLM",),
                                  source_mapping="fake_moe_plugin:older_mapping"))

    mod.ninfer_register_architectures = ninfer_register_architectures
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    h = make_plugin_host(autoload=False)
    h.register_module(mod, mod.__name__)
    return h


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g), "model.norm.weight": torch.ones(H)}
    for i in range(LAYERS):
        m = f"model.layers.{i}.mlp."
        w[m + "gate.weight"] = torch.randn(E, H, generator=g)
        w[m + "experts.gate_up_proj"] = torch.randn(E, 2 * INTER, H, generator=g)
        w[m + "experts.down_proj"] = torch.randn(E, H, INTER, generator=g)
    return {n: t.to(torch.bfloat16) for n, t in w.items()}


def _split(fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert layout of the same weights: gate = rows 0..I-1 of an expert's gate_up, up = rows I..2I-1."""
    out = {}
    for n, t in fused.items():
        if n.endswith("experts.gate_up_proj"):
            p = n[: -len("gate_up_proj")]
            for e in range(E):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :INTER].clone()
                out[f"{p}{e}.up_proj.weight"] = t[e, INTER:].clone()
        elif n.endswith("experts.down_proj"):
            p = n[: -len("down_proj")]
            for e in range(E):
                out[f"{p}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[n] = t
    return out


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor], arch: str = "FakeMoeForCausalLM") -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [arch], "num_hidden_layers": LAYERS}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {c: i for i, c in enumerate("abcd")}}}))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _fails(tmp_path: Path, host, tensors: dict[str, torch.Tensor], match: str) -> None:
    src = _checkpoint(tmp_path / "bad", tensors)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConversionError, match=match):
        convert_checkpoint(src, out_dir / "m.ninfer", host=host)
    assert list(out_dir.iterdir()) == []


def test_fake_mapping_fills_the_contract():
    assert isinstance(FakeMoeMapping({}), SourceMapping)
    assert not isinstance(_OlderMapping(), SourceMapping)


def test_per_expert_and_fused_layouts_bind_identical_expert_banks(tmp_path, host):
    fused = _weights()
    whole = convert_checkpoint(_checkpoint(tmp_path / "fused", fused), tmp_path / "fused.ninfer", host=host)
    split = convert_checkpoint(_checkpoint(tmp_path / "split", _split(fused)), tmp_path / "split.ninfer", host=host)
    assert whole.skipped == split.skipped == ()
    assert split.tensors == 2 + LAYERS * (1 + 3 * E) and whole.tensors == 2 + 3 * LAYERS
    assert split.objects == whole.objects
    with open_artifact(tmp_path / "fused.ninfer") as a, open_artifact(tmp_path / "split.ninfer") as b:
        wa, _ = load_weights(a, features=("text",), host=host)
        wb, _ = load_weights(b, features=("text",), host=host)
        assert sorted(wa) == sorted(wb) == sorted(fused)
        for name, t in fused.items():
            assert wb[name].dtype == torch.bfloat16 and wb[name].shape == t.shape
            assert torch.equal(wa[name], t) and torch.equal(wb[name], t), name
        banks = {o.id: o for o in a.header.objects if "experts" in o.id}
        assert {o.id: (o.shape, o.checksum) for o in banks.values()} == {
            o.id: (o.shape, o.checksum) for o in b.header.objects if "experts" in o.id}
        assert a.metadata.source_digest != b.metadata.source_digest  # the digest names the source tensors


def test_expert_bank_rows_are_gate_then_up_per_expert(tmp_path, host):
    split = _split(_weights())
    convert_checkpoint(_checkpoint(tmp_path / "split", split), tmp_path / "m.ninfer", host=host)
    with open_artifact(tmp_path / "m.ninfer") as art:
        w, _ = load_weights(art, features=("text",), host=host)
    bank = w["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(bank[2, :INTER], split["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(bank[2, INTER:], split["model.layers.1.mlp.experts.2.up_proj.weight"])
    down = split["model.layers.0.mlp.experts.1.down_proj.weight"]
    assert torch.equal(w["model.layers.0.mlp.experts.down_proj"][1], down)


def test_missing_expert_is_named(tmp_path, host):
    split = _split(_weights())
    del split["model.layers.1.mlp.experts.2.up_proj.weight"]
    _fails(tmp_path, host, split, r"'model\.layers\.1\.mlp\.experts\.gate_up_proj' is stacked from 6 tensors but "
                                  r"the checkpoint lacks 1 of them: 'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'")


def test_misshaped_expert_is_named(tmp_path, host):
    split = _split(_weights())
    split["model.layers.0.mlp.experts.1.down_proj.weight"] = torch.zeros(H, INTER + 1, dtype=torch.bfloat16)
    _fails(tmp_path, host, split, r"tensor 'model\.layers\.0\.mlp\.experts\.1\.down_proj\.weight' has shape \[8, 5\] "
                                  r"but 'model\.layers\.0\.mlp\.experts\.down_proj' stacks parts of \[8, 4\]")


def test_expert_of_another_dtype_is_named(tmp_path, host):
    split = _split(_weights())
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    split[name] = split[name].float()
    _fails(tmp_path, host, split, r"the parts of 'model\.layers\.0\.mlp\.experts\.gate_up_proj' differ in dtype: "
                                  r".*is bf16, 'model\.layers\.0\.mlp\.experts\.2\.gate_proj\.weight' is f32")


def test_fused_bank_and_per_expert_parts_of_one_layer_are_refused(tmp_path, host):
    fused = _weights()
    tensors = _split(fused)
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = fused["model.layers.1.mlp.experts.gate_up_proj"]
    _fails(tmp_path, host, tensors, r"'model\.layers\.1\.mlp\.experts\.gate_up_proj' \(stacked from 6 tensors .*\) "
                                    r"and 'model\.layers\.1\.mlp\.experts\.gate_up_proj' both map to .*holds both "
                                    r"the whole tensor and its parts")


def test_a_source_claimed_by_two_groups_is_refused(tmp_path, host, monkeypatch):
    real = FakeMoeMapping.stacked_sources

    def overlapping(self, names):
        groups = real(self, names)
        twin = groups[0]
        return [*groups, StackedSource(name="model.layers.0.mlp.experts.twin", feature="text", parts=twin.parts,
                                       part_shape=twin.part_shape, shape=twin.shape)]

    monkeypatch.setattr(FakeMoeMapping, "stacked_sources", overlapping)
    _fails(tmp_path, host, _split(_weights()), r"tensor 'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' is "
                                               r"declared a part of both 'model\.layers\.0\.mlp\.experts\.gate_up_proj' "
                                               r"and 'model\.layers\.0\.mlp\.experts\.twin'")


def test_an_expert_beyond_the_config_is_not_part_of_the_model(tmp_path, host):
    split = _split(_weights())
    split["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(H, INTER, dtype=torch.bfloat16)
    _fails(tmp_path, host, split, r"'model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight' .* is not part of the model")


def test_stacked_bank_shape_is_checked_against_the_config(tmp_path, host, monkeypatch):
    real = FakeMoeMapping.expected_parameters

    def wider(self, features):
        out = dict(real(self, features))
        out["model.layers.0.mlp.experts.down_proj"] = ("text", (E + 1, H, INTER))
        return out

    monkeypatch.setattr(FakeMoeMapping, "expected_parameters", wider)
    _fails(tmp_path, host, _split(_weights()), r"tensor 'model\.layers\.0\.mlp\.experts\.down_proj' \(stacked from 3 "
                                               r"tensors .*\) has shape \[3, 8, 4\] but config\.json implies \[4, 8, 4\]")


def test_a_group_that_cannot_form_its_shape_is_refused():
    with pytest.raises(ValueError, match=r"3 parts of \[4, 8\] cannot be viewed as \[3, 8, 8\]"):
        StackedSource(name="x", feature="text", parts=("a", "b", "c"), part_shape=(4, 8), shape=(3, 8, 8))


def test_a_mapping_older_than_stacked_sources_is_named(tmp_path, host):
    src = _checkpoint(tmp_path / "old", _weights(), arch="FakeOlderForCausalLM")
    with pytest.raises(ConversionError, match=r"_OlderMapping lacks \['stacked_sources'\] of "
                                              r"ninfer\.artifact\.mapping\.SourceMapping"):
        convert_checkpoint(src, tmp_path / "m.ninfer", host=host)


def test_inspect_shows_expert_banks(tmp_path, host, capsys):
    from ninfer.cli import main as ninfer_main

    convert_checkpoint(_checkpoint(tmp_path / "split", _split(_weights())), tmp_path / "m.ninfer", host=host)
    assert ninfer_main(["inspect", str(tmp_path / "m.ninfer")], host=host) == 0
    out = capsys.readouterr().out
    assert "expert banks  text gate_up_proj: 2 layers x 3 experts x [8, 8] bf16, 768 bytes" in out
    assert "expert banks  text down_proj: 2 layers x 3 experts x [8, 4] bf16, 384 bytes" in out
    assert ninfer_main(["inspect", str(tmp_path / "m.ninfer"), "--json"], host=host) == 0
    banks = json.loads(capsys.readouterr().out)["expert_banks"]
    assert banks[0] == {"feature": "text", "kind": "gate_up_proj", "layers": 2, "experts": 3, "expert_shape": [8, 8],
                        "dtype": "bf16", "bytes": 768}
