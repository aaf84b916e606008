"""The .ninfer v3 container on its own: writer/reader round trip, framing and structural validation."""

from __future__ import annotations

import json
import os
import struct
import zlib

import pytest
import torch

from ninfer.artifact import (
    ArtifactError,
    ArtifactWriter,
    Binding,
    ChecksumError,
    FrontendSection,
    Metadata,
    Use,
    bind,
    load_weights,
    open_artifact,
)
from ninfer.artifact.format import MAGIC, PREFIX_SIZE, align_up, header_from_json, header_to_json, pack_prefix

META = Metadata(name="toy", architecture="ToyForCausalLM")


def _write(path, *, fail_after: int | None = None, alignment: int = 256):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    gate, up = torch.randn(4, 8, generator=g).to(torch.bfloat16), torch.randn(6, 8, generator=g).to(torch.bfloat16)
    vis = torch.randn(3, 5, generator=g)
    w = ArtifactWriter(alignment)
    w.add_object("embed", feature="text", dtype="bf16", shape=(16, 8), nbytes=256, source=lambda: [emb])

    def gate_up():
        yield gate
        if fail_after is not None:
            raise OSError("disk went away")
        yield up

    w.add_object("gate_up", feature="text", dtype="bf16", shape=(10, 8), nbytes=160, source=gate_up)
    w.add_object("vis", feature="vision", dtype="f32", shape=(3, 5), nbytes=60, source=lambda: [vis])
    w.add_resource("tok", b'{"model": {}}')
    w.add_binding(Binding(name="embed.weight", feature="text", object="embed", shape=(16, 8)))
    w.add_binding(Binding(name="gate.weight", feature="text", object="gate_up", shape=(4, 8), rows=(0, 4)))
    w.add_binding(Binding(name="up.weight", feature="text", object="gate_up", shape=(6, 8), rows=(4, 10)))
    w.add_binding(Binding(name="vis.weight", feature="vision", object="vis", shape=(3, 5)))
    for n, f in (("embed.weight", "text"), ("gate.weight", "text"), ("up.weight", "text"), ("vis.weight", "vision")):
        w.add_use(Use(site=n, feature=f, binding=n))
    w.add_use(Use(site="lm_head", feature="text", binding="embed.weight"))
    w.write(path, metadata=META, config={"architectures": ["ToyForCausalLM"]}, features=("text", "vision"),
            frontend=FrontendSection(tokenizer="tok", eos_token_ids=(1,)))
    return {"embed.weight": emb, "gate.weight": gate, "up.weight": up, "vis.weight": vis}


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy.ninfer"
    return path, _write(path)


def _patch(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _rewrite_header(path, edit) -> None:
    raw = path.read_bytes()
    _, _, _, hlen, _, _ = struct.unpack("<8sIIQII", raw[:PREFIX_SIZE])
    header = json.loads(raw[PREFIX_SIZE:PREFIX_SIZE + hlen])
    data = raw[align_up(PREFIX_SIZE + hlen, header["alignment"]):]
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    pad = align_up(PREFIX_SIZE + len(new), 256) - PREFIX_SIZE - len(new)
    path.write_bytes(pack_prefix(len(new), zlib.crc32(new)) + new + b"\0" * pad + data)


def test_round_trip_alignment_and_views(toy):
    path, src = toy
    with open_artifact(path) as art:
        assert art.metadata.name == "toy" and art.features == ("text", "vision")
        for o in art.header.objects:
            assert (art.data_start + o.offset) % 256 == 0
        weights, report = load_weights(art, features=("text",))
        assert set(weights) == {"embed.weight", "gate.weight", "up.weight"}
        for name, t in weights.items():
            assert t.dtype == src[name].dtype and torch.equal(t, src[name])
        # One physical parent for gate/up: one matmul can read both.
        assert weights.fused(["gate.weight", "up.weight"]).data_ptr() == weights["gate.weight"].data_ptr()
        assert report.objects_loaded == 2 and report.bytes_read == {"text": 256 + 160}
        assert art.bytes_read == {"text": 256 + 160}  # the vision object was never touched
        assert art.frontend.tokenizer_json == '{"model": {}}' and art.frontend.eos_token_ids == (1,)
        art.verify()
    assert torch.equal(weights["embed.weight"], src["embed.weight"])  # weights outlive the closed file


def test_header_json_round_trip(toy):
    path, _ = toy
    with open_artifact(path) as art:
        assert header_from_json(header_to_json(art.header)) == art.header


def test_shared_use_is_one_object(toy):
    path, _ = toy
    with open_artifact(path) as art:
        plan = bind(art.header, ("text",))
        assert [u.site for u in plan.uses if u.binding == "embed.weight"] == ["embed.weight", "lm_head"]
        assert [o.id for o in plan.objects].count("embed") == 1


def test_wrong_magic(toy):
    path, _ = toy
    _patch(path, 0, b"GGUF\0\0\0\0")
    with pytest.raises(ArtifactError, match="wrong magic"):
        open_artifact(path)


def test_wrong_version(toy):
    path, _ = toy
    _patch(path, 8, struct.pack("<I", 2))
    with pytest.raises(ArtifactError, match="version 2"):
        open_artifact(path)


@pytest.mark.parametrize("keep", [0, 10, 40, -1])
def test_truncated(toy, keep):
    path, _ = toy
    raw = path.read_bytes()
    path.write_bytes(raw[:keep] if keep >= 0 else raw[:-7])
    with pytest.raises(ArtifactError, match="truncated|wrong magic"):
        open_artifact(path)


def test_trailing_bytes(toy):
    path, _ = toy
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(ArtifactError, match="trailing"):
        open_artifact(path)


def test_header_corruption_is_caught_by_its_checksum(toy):
    path, _ = toy
    _patch(path, PREFIX_SIZE + 5, b"#")
    with pytest.raises(ChecksumError, match="header checksum"):
        open_artifact(path)


def test_object_checksum_mismatch(toy):
    path, src = toy
    with open_artifact(path) as art:
        obj = art.objects["gate_up"]
        where = art.data_start + obj.offset + 3
    _patch(path, where, b"\xff")
    with open_artifact(path) as art:  # framing is intact: opening works, verification names the object
        with pytest.raises(ChecksumError, match="'gate_up'"):
            art.verify()
        with pytest.raises(ChecksumError, match="'gate_up'"):
            load_weights(art, verify=True)
        with pytest.raises(ChecksumError, match="'gate_up'"):
            load_weights(art, features=("text",))  # verified by default
        weights, _ = load_weights(art, features=("text",), verify=False)  # opted out: the bytes load as stored
        assert not torch.equal(weights["gate.weight"], src["gate.weight"])


@pytest.mark.parametrize("edit, message", [
    (lambda h: h["objects"][1].update(offset=h["objects"][0]["offset"]), "overlap"),
    (lambda h: h["objects"][1].update(offset=h["objects"][1]["offset"] + 1), "aligned"),
    (lambda h: h["objects"][2].update(offset=align_up(h["data_size"], 256)), "run past"),
    (lambda h: h["objects"][0].update(shape=[16, 9]), "needs"),
    (lambda h: h["bindings"][1].update(rows=[0, 11]), "outside object"),
    (lambda h: h["bindings"][1].update(object="nope"), "missing object 'nope'"),
    (lambda h: h["uses"][0].update(binding="nope"), "missing binding 'nope'"),
    (lambda h: h.update(features=["vision"]), "required 'text'"),
    (lambda h: h["objects"][0].update(dtype="q3"), "dtype"),
    (lambda h: h.update(surprise=1), "surprise"),
    (lambda h: h.pop("metadata"), "metadata"),
])
def test_structural_validation(toy, edit, message):
    path, _ = toy
    _rewrite_header(path, edit)
    with pytest.raises(ArtifactError, match=message):
        open_artifact(path)


def test_feature_selection_errors(toy):
    path, _ = toy
    with open_artifact(path) as art:
        with pytest.raises(ArtifactError, match="has no mtp"):
            load_weights(art, features=("text", "mtp"))
        with pytest.raises(ArtifactError, match="must include 'text'"):
            load_weights(art, features=("vision",))
        with pytest.raises(ArtifactError, match="one speculative backend"):
            load_weights(art, features=("text", "mtp", "dflash"))
        with pytest.raises(ArtifactError, match="budget"):
            load_weights(art, budget_bytes=100)
        with pytest.raises(ArtifactError, match="does not bind 'missing.weight'"):
            bind(art.header, ("text",), expected={"missing.weight": (1,)})


def test_failed_write_leaves_nothing(tmp_path):
    path = tmp_path / "out.ninfer"
    with pytest.raises(OSError, match="disk went away"):
        _write(path, fail_after=1)
    assert os.listdir(tmp_path) == []


def test_short_source_is_an_error_and_leaves_nothing(tmp_path):
    w = ArtifactWriter(256)
    w.add_object("a", feature="text", dtype="f32", shape=(4,), nbytes=16, source=lambda: [b"\0" * 12])
    w.add_binding(Binding(name="a", feature="text", object="a", shape=(4,)))
    with pytest.raises(ArtifactError, match="gave 12 bytes, expected 16"):
        w.write(tmp_path / "x.ninfer", metadata=META, config={}, features=("text",))
    assert os.listdir(tmp_path) == []


def test_not_a_file_at_all(tmp_path):
    with pytest.raises(ArtifactError, match="cannot open"):
        open_artifact(tmp_path / "absent.ninfer")
    (tmp_path / "empty.ninfer").write_bytes(b"")
    with pytest.raises(ArtifactError, match="truncated"):
        open_artifact(tmp_path / "empty.ninfer")
    (tmp_path / "magic.ninfer").write_bytes(MAGIC)
    with pytest.raises(ArtifactError, match="truncated"):
        open_artifact(tmp_path / "magic.ninfer")


def test_interrupted_write_leaves_nothing(tmp_path):
    w = ArtifactWriter(256)

    def interrupted():
        yield b"\0" * 8
        raise KeyboardInterrupt

    w.add_object("a", feature="text", dtype="f32", shape=(4,), nbytes=16, source=interrupted)
    w.add_binding(Binding(name="a", feature="text", object="a", shape=(4,)))
    with pytest.raises(KeyboardInterrupt):
        w.write(tmp_path / "x.ninfer", metadata=META, config={}, features=("text",))
    assert os.listdir(tmp_path) == []


def test_bad_binding_is_refused_before_writing(tmp_path):
    w = ArtifactWriter(256)
    w.add_object("a", feature="text", dtype="f32", shape=(4,), nbytes=16, source=lambda: [b"\0" * 16])
    w.add_binding(Binding(name="a", feature="text", object="a", shape=(4,), rows=(2, 6)))
    with pytest.raises(ArtifactError, match="rows \\[2, 6\\] are outside object 'a'"):
        w.write(tmp_path / "x.ninfer", metadata=META, config={}, features=("text",))
    assert os.listdir(tmp_path) == []


def _nvfp4_writer(planes):
    w = ArtifactWriter(256)
    size = max(p.offset + p.nbytes for p in planes)
    w.add_object("q", feature="text", format="nvfp4", dtype="u8", shape=(4, 32), nbytes=size, planes=planes,
                 block=(1, 16), source=lambda: [b"\x11" * size])
    w.add_binding(Binding(name="q.weight", feature="text", object="q", shape=(4, 32)))
    return w


def test_quantized_planes_are_checked_against_the_format(tmp_path):
    from ninfer.artifact import Plane

    planes = (Plane(name="data", dtype="u8", shape=(4, 16), offset=0, nbytes=64),
              Plane(name="scale", dtype="f8_e4m3", shape=(4, 2), offset=64, nbytes=8),
              Plane(name="global_scale", dtype="f32", shape=(4,), offset=72, nbytes=16))
    _nvfp4_writer(planes).write(tmp_path / "q.ninfer", metadata=META, config={}, features=("text",))
    with open_artifact(tmp_path / "q.ninfer") as art:
        assert [p.name for p in art.objects["q"].planes] == ["data", "scale", "global_scale"]
        weights, _ = load_weights(art)
        assert weights["q.weight"].shape == (4, 32) and weights["q.weight"].global_scale.shape == (4,)
    bad = (planes[0], planes[2], planes[1])
    with pytest.raises(ArtifactError, match="has planes data u8\\[4, 16\\], global_scale"):
        _nvfp4_writer(bad).write(tmp_path / "bad.ninfer", metadata=META, config={}, features=("text",))
    one_global = (*planes[:2], Plane(name="global_scale", dtype="f32", shape=(1,), offset=72, nbytes=4))
    with pytest.raises(ArtifactError, match="global_scale f32\\[4\\]"):
        _nvfp4_writer(one_global).write(tmp_path / "bad.ninfer", metadata=META, config={}, features=("text",))
