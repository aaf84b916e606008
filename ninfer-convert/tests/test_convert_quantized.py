"""Published quantized checkpoints convert with their bytes kept: every quantized linear's ``dequantize()`` after
``load_weights`` equals the published format's own dequantization of the source tensors (written here), fused
shards keep their own scales, inspect shows the formats, ``--quantize`` round-trips within the format's error,
and bad scales or unsupported schemes are refused by name with nothing written."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("ninfer_qwen35")

from safetensors.torch import load_file, save_file  # noqa: E402

from ninfer.artifact import load_weights, open_artifact  # noqa: E402
from ninfer.cli import main as ninfer_main  # noqa: E402
from ninfer.ops.quant import QuantizedWeight  # noqa: E402
from ninfer_convert.convert import convert_checkpoint  # noqa: E402
from ninfer_convert.source import ConversionError  # noqa: E402
from ninfer_qwen35.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from ninfer_qwen35.testing.quantized_checkpoints import quantize_tiny_checkpoint  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("qbase")
    return {"dense": make_tiny_checkpoint(root / "dense"), "moe": make_tiny_checkpoint(root / "moe", moe=True),
            "moe128": make_tiny_checkpoint(root / "moe128", moe=True, moe_intermediate_size=128, mtp=False)}


def _copy(base: dict, kind: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base[kind], tmp_path / "src"))


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _published_dequant(src: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The format's definition applied to the stored tensors of the quantized weight stored as ``name``."""
    data = src[name].float() if src[name].dtype == torch.float8_e4m3fn else None
    if data is not None:
        scale = src.get(name + "_scale_inv", src.get(name + "_scale")).float()
        n, k = data.shape[-2:]
        if scale.numel() == 1:
            return data * scale.reshape(())
        if scale.shape[-1] == 1:
            return data * scale
        b0, b1 = math.ceil(n / scale.shape[-2]), math.ceil(k / scale.shape[-1])
        b0, b1 = (128, 128) if scale.shape[-2:] == (math.ceil(n / 128), math.ceil(k / 128)) else (b0, b1)
        return data * scale.repeat_interleave(b0, -2)[..., :n, :].repeat_interleave(b1, -1)[..., :k]
    base = name.removesuffix("_packed")
    packed = src[name]
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()
    values = torch.tensor(E2M1)[codes]
    if base + "_scale_2" in src:
        g = float(src[base + "_scale_2"])
    else:
        g = float(torch.tensor(1.0, dtype=torch.float64) / src[base + "_global_scale"].double())
        g = float(torch.tensor(g, dtype=torch.float32))
    return values * src[base + "_scale"].float().repeat_interleave(16, -1) * g


def _logical(name: str) -> tuple[str, int | None, slice]:
    """Where a stored quantized weight lives in the artifact: (logical name, expert, rows of the expert)."""
    name = name.removesuffix("_packed").replace("model.language_model.", "model.", 1)
    m = _EXPERT.match(name)
    if m is None:
        return name, None, slice(None)
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    bank = f"{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}"
    return bank, e, {"gate": "gate", "up": "up", "down": "all"}[kind]


def _load(out: Path):
    with open_artifact(out) as art:
        return load_weights(art, features=art.features)[0]


def _check_bytes_kept(ckpt: Path, out: Path) -> dict:
    src = _tensors(ckpt)
    weights = _load(out)
    quantized = [n for n, t in src.items() if t.dtype in (torch.float8_e4m3fn, torch.uint8) and n.endswith(
        ("weight", "weight_packed", "_proj"))]
    assert quantized
    for name in quantized:
        lname, e, part = _logical(name)
        w = weights[lname]
        assert isinstance(w, QuantizedWeight), lname
        got = w.dequantize() if e is None else w.expert(e).dequantize()
        if part in ("gate", "up"):
            half = got.shape[0] // 2
            got = got[:half] if part == "gate" else got[half:]
        # NVFP4 multiplies three factors: the order of the products may differ in the last bit
        exact = src[name].dtype == torch.float8_e4m3fn
        torch.testing.assert_close(got, _published_dequant(src, name), rtol=0 if exact else 1e-6, atol=0)
        data = w.data if e is None else w.data[e]
        if part in ("gate", "up"):
            data = data[:data.shape[0] // 2] if part == "gate" else data[data.shape[0] // 2:]
        assert torch.equal(data.view(torch.uint8), src[name].view(torch.uint8)), name  # the stored bytes
    return weights


@pytest.mark.parametrize("scheme", ["fp8", "ct_fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "ct_nvfp4",
                                    "modelopt_nvfp4"])
def test_dense_checkpoint_keeps_its_quantized_bytes(base, tmp_path, scheme):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), scheme)
    out = tmp_path / "q.ninfer"
    summary = convert_checkpoint(ckpt, out)
    weights = _check_bytes_kept(ckpt, out)
    assert not isinstance(weights["model.embed_tokens.weight"], QuantizedWeight)
    assert not isinstance(weights["model.layers.0.linear_attn.in_proj_a.weight"], QuantizedWeight)
    assert isinstance(weights["mtp.layers.0.self_attn.q_proj.weight"], QuantizedWeight)
    assert weights.params["model.layers.0.mlp.up_proj.weight"].parent == "model.layers.0.mlp.gate_up_proj"
    # in_proj_qkv / z are quantized, in_proj_b / a are not: the GDN group is stored as fused runs, [qkv; z] only
    # where in_proj_qkv's 64 rows fill the scale blocks (not FP8's 128-row ones)
    a = "model.layers.0.linear_attn."
    assert weights.params[a + "in_proj_b.weight"].parent == a + "in_proj_qkvzba[2:4]"
    blocks = scheme in ("fp8", "ct_fp8_block")
    z_parent = "in_proj_z.weight" if blocks else "in_proj_qkvzba[0:2]"
    assert weights.params[a + "in_proj_z.weight"].parent == a + z_parent
    runs = "3 fused runs (members [0:1], [1:2], [2:4])" if blocks else "2 fused runs (members [0:2], [2:4])"
    assert any("in_proj_qkvzba: members are stored in different formats (dense, " in n and n.endswith(runs)
               for n in summary.notes)
    with open_artifact(out) as art:
        q = art.metadata.quantization
    assert q["dense"]["model.layers.0.linear_attn.out_proj.weight"] == "stored unquantized in the checkpoint"
    assert any(s.endswith(("input_scale", "input_global_scale")) for s in summary.skipped) == (scheme != "fp8")


def test_fp8_blocks_keep_fused_shards_only_on_block_boundaries(base, tmp_path):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), "fp8", scale_dtype=torch.bfloat16)
    summary = convert_checkpoint(ckpt, tmp_path / "q.ninfer")
    weights = _check_bytes_kept(ckpt, tmp_path / "q.ninfer")
    assert weights["model.layers.0.mlp.gate_proj.weight"].scale.dtype == torch.float32  # bf16 scales widened
    # q fills its blocks, k does not: [q; k] share a parent, v has its own
    q = "model.layers.3.self_attn."
    assert weights.params[q + "k_proj.weight"].parent == q + "qkv_proj[0:2]"
    assert weights.params[q + "v_proj.weight"].parent == q + "v_proj.weight"
    assert any("qkv_proj: member rows [128, 32, 32] do not all end on the 128-row" in n and
               n.endswith("stored as 2 fused runs (members [0:2], [2:3])") for n in summary.notes)


@pytest.mark.parametrize("scheme", ["modelopt_nvfp4", "ct_fp8_channel"])
def test_mixed_format_group_is_stored_as_fused_runs_the_split_shares(base, tmp_path, scheme):
    """GDN's in_proj_qkvzba with quantized qkv / z and bf16 b / a: one parent per format run, and the prepared
    LinearSplit's matmuls are views of those parents (no joined copy)."""
    from ninfer_qwen35.execution.linear import LinearSplit

    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), scheme)
    convert_checkpoint(ckpt, tmp_path / "q.ninfer")
    a = "model.layers.0.linear_attn."
    names = [a + f"in_proj_{m}.weight" for m in ("qkv", "z", "b", "a")]
    with open_artifact(tmp_path / "q.ninfer") as art:
        objects, bindings = art.objects, art.bindings
        assert a + "in_proj_qkvzba" not in objects and not any(n in objects for n in names)
        qz, ba = objects[a + "in_proj_qkvzba[0:2]"], objects[a + "in_proj_qkvzba[2:4]"]
        assert qz.format != "dense" and ba.format == "dense" and ba.dtype == "bf16"
        assert [(bindings[n].object, bindings[n].rows) for n in names] == [
            (qz.id, (0, 64)), (qz.id, (64, 96)), (ba.id, (0, 4)), (ba.id, (4, 8))]
        assert qz.shape[0] == 96 and ba.shape[0] == 8
    weights = _load(tmp_path / "q.ninfer")
    split = LinearSplit.from_weights(weights, names, torch.bfloat16)
    assert split.members == (tuple(names[:2]), tuple(names[2:])) and split.shares_parent
    quantized, dense = split.groups
    assert quantized.data.data_ptr() == weights.parents[qz.id].data.data_ptr()
    assert quantized.scale.data_ptr() == weights.parents[qz.id].scale.data_ptr()
    assert dense.data_ptr() == weights.parents[ba.id].data_ptr()
    x = torch.randn(3, quantized.shape[1], dtype=torch.bfloat16)
    want = x.float() @ torch.cat([quantized.dequantize(), dense.float()]).T
    torch.testing.assert_close(split.matmul(x).float(), want, rtol=2e-2, atol=2e-2)


def test_nvfp4_fused_shards_keep_their_own_global_scales(base, tmp_path):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), "modelopt_nvfp4")
    convert_checkpoint(ckpt, tmp_path / "q.ninfer")
    weights = _load(tmp_path / "q.ninfer")
    src = _tensors(ckpt)
    fused = weights.fused(["model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                           "model.layers.3.self_attn.v_proj.weight"])
    assert isinstance(fused, QuantizedWeight) and fused.shape == (192, 64)
    wanted = [float(src[f"model.layers.3.self_attn.{p}_proj.weight_scale_2"]) for p in "qkv"]
    assert len(set(wanted)) == 3
    assert [float(fused.global_scale[i]) for i in (0, 128, 160)] == wanted


@pytest.mark.parametrize(("kind", "scheme", "fused_experts"), [
    ("moe", "modelopt_nvfp4", False), ("moe", "ct_nvfp4", False), ("moe", "ct_fp8_channel", False),
    ("moe", "fp8", True), ("moe128", "fp8", False)])
def test_moe_expert_banks_become_quantized_banks(base, tmp_path, kind, scheme, fused_experts):
    ckpt = quantize_tiny_checkpoint(_copy(base, kind, tmp_path), scheme, fused_experts=fused_experts)
    convert_checkpoint(ckpt, tmp_path / "q.ninfer")
    weights = _check_bytes_kept(ckpt, tmp_path / "q.ninfer")
    bank = weights["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(bank, QuantizedWeight) and bank.dim() == 3
    assert not isinstance(weights["model.layers.0.mlp.gate.weight"], QuantizedWeight)
    assert weights.params["model.layers.0.mlp.gate.weight"].parent == "model.layers.0.mlp.router_shared_gate"
    if scheme.endswith("nvfp4"):  # per-expert gate and up shards keep their own global scales
        assert bank.global_scale.shape == bank.shape[:2] and float(bank.global_scale[0, 0]) != float(
            bank.global_scale[0, -1])


def test_sharded_vl_checkpoint_keeps_the_vision_tower_unquantized(tmp_path):
    ckpt = quantize_tiny_checkpoint(make_tiny_checkpoint(tmp_path / "src", layout="vl"), "fp8")
    convert_checkpoint(ckpt, tmp_path / "q.ninfer")
    weights = _check_bytes_kept(ckpt, tmp_path / "q.ninfer")
    assert "visual.blocks.0.attn.qkv.weight" in weights
    assert not any(isinstance(w, QuantizedWeight) for n, w in weights.items() if n.startswith("visual."))


def test_modelopt_config_in_config_json(base, tmp_path):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), "modelopt_nvfp4")
    hf = json.loads((ckpt / "hf_quant_config.json").read_text())
    (ckpt / "hf_quant_config.json").unlink()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", **hf["quantization"]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    convert_checkpoint(ckpt, tmp_path / "q.ninfer")
    _check_bytes_kept(ckpt, tmp_path / "q.ninfer")


def test_static_activation_scales_are_noted_and_not_used(base, tmp_path):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), "ct_fp8_channel")
    _config(ckpt, lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False))
    summary = convert_checkpoint(ckpt, tmp_path / "q.ninfer")
    _check_bytes_kept(ckpt, tmp_path / "q.ninfer")
    with open_artifact(tmp_path / "q.ninfer") as art:
        assert "quantizes activations statically" in art.metadata.quantization["notes"][0]
    assert any("quantizes activations statically" in n for n in summary.notes)


def test_fp8_expert_parts_that_split_a_scale_block_are_refused(base, tmp_path):
    ckpt = quantize_tiny_checkpoint(_copy(base, "moe", tmp_path), "fp8")
    _fails(ckpt, tmp_path, "its FP8 parts of 32 rows do not fill the 128-row scale blocks")


def test_inspect_lists_the_formats(base, tmp_path, capsys):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), "ct_nvfp4")
    convert_checkpoint(ckpt, tmp_path / "q.ninfer")
    capsys.readouterr()
    assert ninfer_main(["inspect", str(tmp_path / "q.ninfer")]) == 0
    out = capsys.readouterr().out
    assert "quantization  compressed-tensors nvfp4-pack-quantized" in out
    assert re.search(r"nvfp4 +\d+ +[\d,]+", out) and re.search(r"dense +\d+", out)
    assert "left unquantized" in out and "global_scale f32[" in out


@pytest.mark.parametrize(("option", "kind", "overrides", "tolerance"), [
    ("fp8", "dense", dict(hidden_size=128, head_dim=32, num_key_value_heads=4, intermediate_size=256), 0.05),
    ("nvfp4", "dense", {}, 0.15), ("nvfp4", "moe", {}, 0.15)])
def test_quantize_round_trip(base, tmp_path, option, kind, overrides, tolerance):
    ckpt = make_tiny_checkpoint(tmp_path / "src", moe=kind == "moe", **overrides) if overrides else _copy(
        base, kind, tmp_path)
    convert_checkpoint(ckpt, tmp_path / "q.ninfer", quantize=option)
    src = _tensors(ckpt)
    weights = _load(tmp_path / "q.ninfer")
    with open_artifact(tmp_path / "q.ninfer") as art:
        q = art.metadata.quantization
    assert q["method"] == f"ninfer convert --quantize {option}"
    assert q["dense"]["model.embed_tokens.weight"] == "an embedding is a row lookup, not a matmul"
    assert "GDN decay input" in q["dense"]["model.layers.0.linear_attn.in_proj_a.weight"]
    quantized = [n for n, w in weights.items() if isinstance(w, QuantizedWeight)]
    assert len(quantized) >= 10 and not set(quantized) & set(q["dense"])
    for name in quantized:
        ref = src[name].float() if name in src else None
        if ref is None:
            continue
        err = (weights[name].dequantize() - ref).norm() / ref.norm()
        assert err < tolerance, (name, float(err))
    if option == "fp8":
        assert "FP8 blocks" in q["dense"]["model.layers.0.linear_attn.in_proj_qkv.weight"]
        assert weights["model.layers.3.self_attn.k_proj.weight"].block == (128, 128)
    if kind == "moe":
        bank = weights["model.layers.0.mlp.experts.down_proj"]
        assert isinstance(bank, QuantizedWeight)
        ref = src["model.layers.0.mlp.experts.down_proj"].float()
        assert (bank.dequantize() - ref).norm() / ref.norm() < tolerance


# -- bad input ------------------------------------------------------------------------------------------------------

def _fails(ckpt: Path, tmp_path: Path, match: str, **kwargs) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    with pytest.raises(ConversionError, match=match):
        convert_checkpoint(ckpt, out_dir / "model.ninfer", **kwargs)
    assert list(out_dir.iterdir()) == []


def _edit(ckpt: Path, edit) -> None:
    path = ckpt / "model.safetensors"
    tensors = dict(load_file(str(path)))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _config(ckpt: Path, edit) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg["quantization_config"])
    (ckpt / "config.json").write_text(json.dumps(cfg))


W = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize(("scheme", "edit", "match"), [
    ("fp8", lambda t: t.pop(W + "_scale_inv"),
     f"tensor '{W}' is quantized but its scale '{W}_scale_inv' is missing \\(expected bf16 or f16 or f32 \\[1, 1\\]\\)"),
    ("fp8", lambda t: t.update({W + "_scale_inv": torch.ones(2, 1)}),
     f"scale '{W}_scale_inv' of '{W}' is f32\\[2, 1\\]; expected bf16 or f16 or f32 \\[1, 1\\]"),
    ("fp8", lambda t: t.update({W + "_scale_inv": torch.ones(1, 1, dtype=torch.int32)}),
     f"scale '{W}_scale_inv' of '{W}' is i32\\[1, 1\\]"),
    ("ct_fp8_channel", lambda t: t.update({W + "_scale": torch.ones(1, 64)}),
     f"scale '{W}_scale' of '{W}' is f32\\[1, 64\\]; expected bf16 or f16 or f32 \\[64, 1\\] or \\[64\\]"),
    ("modelopt_nvfp4", lambda t: t.pop(W + "_scale_2"), f"its scale '{W}_scale_2' is missing"),
    ("ct_nvfp4", lambda t: t.update({W + "_scale": t[W + "_scale"].float()}), f"scale '{W}_scale' of '{W}_packed' is f32"),
    ("fp8", lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}),
     "'model.norm.weight_scale_inv' is a fp8 .*scale but its weight 'model.norm.weight' is stored as bf16"),
    ("fp8", lambda t: t.pop(W), f"'{W}_scale_inv' is a fp8 .*scale but its weight '{W}' is not in the checkpoint"),
])
def test_bad_scales_are_named(base, tmp_path, scheme, edit, match):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), scheme)
    _edit(ckpt, edit)
    _fails(ckpt, tmp_path, match)


@pytest.mark.parametrize(("scheme", "edit", "match"), [
    ("fp8", lambda q: q.update(quant_method="gptq"), "quant_method 'gptq' is not supported"),
    ("fp8", lambda q: q.update(activation_scheme="static"), "activation_scheme 'static' is not supported"),
    ("fp8", lambda q: q.update(weight_block_size=None), "weight_block_size must be two positive sizes"),
    ("fp8", lambda q: q["modules_to_not_convert"].append("model.layers.0.mlp.down_proj"),
     f"tensor '{W}' is stored as f8_e4m3 but its module is in the config's modules_to_not_convert list"),
    ("ct_fp8_channel", lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"),
     "config_groups.group_0.weights .*type 'int'.* is not supported"),
    ("ct_nvfp4", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32),
     "NVFP4 needs num_bits 4, strategy 'tensor_group', group_size 16"),
    ("ct_fp8_block", lambda q: q.update(format="pack-quantized"), "format \\['pack-quantized'\\] is not supported"),
])
def test_unsupported_schemes_are_refused(base, tmp_path, scheme, edit, match):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), scheme)
    _config(ckpt, edit)
    _fails(ckpt, tmp_path, match)


def test_modelopt_algorithm_and_requantizing_are_refused(base, tmp_path):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), "modelopt_nvfp4")
    _fails(ckpt, tmp_path, "the checkpoint is already quantized \\(modelopt NVFP4\\)", quantize="fp8")
    hf = json.loads((ckpt / "hf_quant_config.json").read_text())
    hf["quantization"]["quant_algo"] = "W4A8_AWQ"
    (ckpt / "hf_quant_config.json").write_text(json.dumps(hf))
    _fails(ckpt, tmp_path, "hf_quant_config.json quantization.quant_algo 'W4A8_AWQ' is not supported")


def test_cli_refuses_with_one_line(base, tmp_path, capsys):
    ckpt = quantize_tiny_checkpoint(_copy(base, "dense", tmp_path), "fp8")
    _edit(ckpt, lambda t: t.pop(W + "_scale_inv"))
    (tmp_path / "out").mkdir()
    assert ninfer_main(["convert", str(ckpt), str(tmp_path / "out" / "m.ninfer")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{W}_scale_inv' is missing" in err[0] and err[0].endswith("nothing was written")
    assert list((tmp_path / "out").iterdir()) == []
