"""Quantized artifact objects: written as their planes back to back, validated at open, loaded as QuantizedWeight
parents whose planes are views of one raw allocation (the stored bytes), bound whole, by rows or by plane."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.artifact import (
    ArtifactError,
    ArtifactWriter,
    Binding,
    Metadata,
    load_weights,
    meta_weights,
    open_artifact,
)
from ninfer.artifact.format import quantized_layout
from ninfer.cli import main as ninfer_main
from ninfer.ops.quant import QuantizedWeight, quantize_fp8_block, quantize_nvfp4

META = Metadata(name="toy", architecture="ToyForCausalLM",
                quantization={"method": "test", "formats": {"nvfp4": 1, "fp8_e4m3_block": 2},
                              "dense": {"norm": "not a linear weight"}})


def _add(w: ArtifactWriter, oid: str, q: QuantizedWeight) -> None:
    w.add_quantized_object(oid, feature="text", format=q.format, shape=q.shape, block=q.block,
                           planes=lambda: [[t] for t in q.planes()])


@pytest.fixture
def toy(tmp_path):
    torch.manual_seed(0)
    fp8 = quantize_fp8_block(torch.randn(256 + 64, 192))  # two shards: 256 rows (two full blocks), then 64
    nv = quantize_nvfp4(torch.randn(48, 64), shards=(32, 16))
    bank = QuantizedWeight(format="fp8_e4m3_block", block=(1, 64),
                           data=torch.randn(3, 8, 64).to(torch.float8_e4m3fn), scale=torch.rand(3, 8, 1) + 0.5)
    norm = torch.randn(64, dtype=torch.bfloat16)
    w = ArtifactWriter(256)
    _add(w, "fused_fp8", fp8)
    _add(w, "fused_nvfp4", nv)
    _add(w, "bank", bank)
    w.add_object("norm", feature="text", dtype="bf16", shape=(64,), nbytes=128, source=lambda: [norm])
    w.add_binding(Binding(name="a.weight", feature="text", object="fused_fp8", shape=(256, 192), rows=(0, 256)))
    w.add_binding(Binding(name="b.weight", feature="text", object="fused_fp8", shape=(64, 192), rows=(256, 320)))
    w.add_binding(Binding(name="c.weight", feature="text", object="fused_nvfp4", shape=(32, 64), rows=(0, 32)))
    w.add_binding(Binding(name="d.weight", feature="text", object="fused_nvfp4", shape=(16, 64), rows=(32, 48)))
    w.add_binding(Binding(name="m.experts.down_proj", feature="text", object="bank", shape=(3, 8, 64)))
    w.add_binding(Binding(name="d.global", feature="text", object="fused_nvfp4", shape=(16,), rows=(32, 48),
                          plane="global_scale"))
    w.add_binding(Binding(name="norm", feature="text", object="norm", shape=(64,)))
    path = tmp_path / "q.ninfer"
    w.write(path, metadata=META, config={}, features=("text",))
    return path, {"fp8": fp8, "nv": nv, "bank": bank, "norm": norm}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_planes_are_laid_out_aligned_and_in_order():
    planes = quantized_layout("nvfp4", (3, 48, 64), (1, 16))
    assert [(p.name, p.dtype, p.shape) for p in planes] == [
        ("data", "u8", (3, 48, 32)), ("scale", "f8_e4m3", (3, 48, 4)), ("global_scale", "f32", (3, 48))]
    assert [p.offset % 256 for p in planes] == [0, 0, 0] and planes[1].offset >= planes[0].nbytes
    with pytest.raises(ArtifactError, match="multiple of 16"):
        quantized_layout("nvfp4", (4, 40), (1, 16))


def test_load_gives_quantized_parents_over_one_allocation(toy):
    path, src = toy
    with open_artifact(path) as art:
        weights, report = load_weights(art)
    parent = weights.parents["fused_fp8"]
    assert isinstance(parent, QuantizedWeight) and parent.shape == (320, 192)
    assert _same(parent.data, src["fp8"].data) and _same(parent.scale, src["fp8"].scale)
    assert parent.data.untyped_storage().data_ptr() == parent.scale.untyped_storage().data_ptr()
    a, b = weights["a.weight"], weights["b.weight"]
    assert a.shape == (256, 192) and b.shape == (64, 192) and b.scale.shape == (1, 2)
    assert torch.equal(torch.cat([a.dequantize(), b.dequantize()]), src["fp8"].dequantize())
    c, d = weights["c.weight"], weights["d.weight"]
    assert _same(c.global_scale, src["nv"].global_scale[:32]) and _same(d.global_scale, src["nv"].global_scale[32:])
    assert float(c.global_scale[0]) != float(d.global_scale[0])  # each shard keeps its own global scale
    assert torch.equal(d.dequantize(), src["nv"].dequantize()[32:])
    assert _same(weights["d.global"], src["nv"].global_scale[32:])
    bank = weights["m.experts.down_proj"]
    assert bank.shape == (3, 8, 64) and torch.equal(bank.expert(1).dequantize(), src["bank"].expert(1).dequantize())
    assert _same(weights["norm"], src["norm"])
    assert weights.resident_bytes() == report.total_bytes_uploaded
    assert weights.resident_bytes() == sum(o.nbytes for o in art.header.objects)


def test_fused_returns_a_quantized_row_range(toy):
    path, src = toy
    with open_artifact(path) as art:
        weights, _ = load_weights(art)
    fused = weights.fused(["c.weight", "d.weight"])
    assert isinstance(fused, QuantizedWeight) and torch.equal(fused.dequantize(), src["nv"].dequantize())
    assert weights.fused(["a.weight", "b.weight"]).shape == (320, 192)


def test_meta_weights_share_one_storage_per_object(toy):
    path, _ = toy
    with open_artifact(path) as art:
        weights = meta_weights(art)
        sizes = {o.id: o.nbytes for o in art.header.objects}
    parent = weights.parents["fused_nvfp4"]
    assert parent.data.device.type == "meta" and parent.global_scale.dtype == torch.float32
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in parent.planes()}
    assert list(storages.values()) == [sizes["fused_nvfp4"]]
    assert weights["b.weight"].scale.shape == (1, 2)


def test_from_tensors_stacks_quantized_members_and_leaves_mixed_groups_unfused():
    from ninfer.artifact.weights import FusedParent, WeightSet

    torch.manual_seed(1)
    q, k = quantize_nvfp4(torch.randn(8, 32)), quantize_nvfp4(torch.randn(4, 32))
    ws = WeightSet.from_tensors({"q": q, "k": k, "v": torch.randn(4, 32), "w": quantize_nvfp4(torch.randn(4, 32))},
                                [FusedParent(name="qk", members=("q", "k")), FusedParent(name="vw", members=("v", "w"))])
    assert ws.params["k"].parent == "qk" and torch.equal(ws["k"].dequantize(), k.dequantize())
    assert ws.params["v"].parent == "v" and ws.params["w"].parent == "w"


def test_misshaped_scale_plane_is_refused_at_write_and_open(tmp_path):
    w = ArtifactWriter(256)
    q = quantize_fp8_block(torch.randn(128, 128))
    w.add_quantized_object("x", feature="text", format=q.format, shape=(128, 128), block=(128, 128),
                           planes=lambda: [[q.data], [q.scale, q.scale]])
    w.add_binding(Binding(name="x", feature="text", object="x", shape=(128, 128)))
    with pytest.raises(ArtifactError, match="plane scale f32\\[1, 1\\] needs 4 bytes, its source gave more"):
        w.write(tmp_path / "x.ninfer", metadata=META, config={}, features=("text",))
    assert list(tmp_path.iterdir()) == []


def test_inspect_lists_formats_and_planes(toy, capsys):
    path, _ = toy
    assert ninfer_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fp8_e4m3_block" in out and "nvfp4" in out and "dense" in out
    assert "global_scale f32[48]" in out and "block [1, 16]" in out
    assert "quantization  test: 2 weights fp8_e4m3_block, 1 weights nvfp4" in out and "left unquantized  1 weights: not a linear weight" in out
    assert ninfer_main(["inspect", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["per_format"]["nvfp4"]["objects"] == 1
    bank = next(o for o in d["quantized_objects"] if o["id"] == "bank")
    assert bank["block"] == [1, 64] and bank["planes"][1] == {"name": "scale", "dtype": "f32", "shape": [3, 8, 1]}
