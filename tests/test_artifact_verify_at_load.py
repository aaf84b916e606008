"""Loading checks the checksum of everything it reads, weights and Frontend resources, as it reads them.

A corrupted copy of the embedded model (a zeroed region in one ``down_proj``, or an edited chat template)
fails to load with an error naming the object and the file; ``verify=False`` / ``--no-verify`` loads it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ninfer
from ninfer.artifact import ChecksumError, Materializer, open_artifact, plan_load, resolve_load
from ninfer.cli import main
from ninfer.contract import GenerationRequest, SamplingParams, TextInput

DOWN_PROJ = "model.layers.3.mlp.down_proj.weight"
TEMPLATE = "frontend/chat_template.jinja"
EMBED = "model.embed_tokens.weight"  # 2 MiB: several chunks at 1 MiB


def _zero_a_region(data: bytes) -> bytes:
    at, n = len(data) // 3, min(64 << 10, len(data) // 3)
    assert any(data[at:at + n])  # the region really changes
    return data[:at] + bytes(n) + data[at + n:]


def _edit_template(data: bytes) -> bytes:
    assert b"assistant" in data
    return data.replace(b"assistant", b"ASSISTANT", 1)  # same length: the framing stays valid


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _corrupted_copy(tmp_path: Path, object_id: str, edit) -> Path:
    dst = tmp_path / "copy.ninfer"
    shutil.copyfile(ninfer.default_model_path(), dst)
    with open_artifact(dst, verify=False) as art:
        obj = art.objects[object_id]
        start = art.data_start + obj.offset
    with open(dst, "r+b") as f:
        f.seek(start)
        data = f.read(obj.nbytes)
        f.seek(start)
        f.write(edit(data))
    return dst


def _generates(engine) -> None:
    result = engine.generate(GenerationRequest(input=TextInput(text="ROMEO:"),
                                               sampling=SamplingParams(max_tokens=3, ignore_eos=True)), timeout=120)
    assert result.usage.completion_tokens == 3


@pytest.mark.parametrize("object_id,edit", [(DOWN_PROJ, _zero_a_region), (TEMPLATE, _edit_template)])
def test_engine_refuses_a_corrupted_object_and_verify_false_loads_it(tmp_path, object_id, edit, one_cpu_thread):
    bad = _corrupted_copy(tmp_path, object_id, edit)
    with pytest.raises(ChecksumError) as err:
        ninfer.Engine(bad, ninfer.EngineConfig(device="cpu"))
    message = str(err.value)
    assert repr(object_id) in message and str(bad) in message and "corrupted" in message
    with ninfer.Engine(bad, ninfer.EngineConfig(device="cpu", verify=False)) as engine:
        _generates(engine)


def test_commands_name_the_corrupted_object_and_no_verify_loads(tmp_path, capsys, one_cpu_thread):
    bad = str(_corrupted_copy(tmp_path, DOWN_PROJ, _zero_a_region))
    commands = {"generate": ["generate", bad, "--prompt", "ROMEO:", "--max-tokens", "2", "--device", "cpu"],
                "score": ["score", bad, "To be, or not to be.", "--device", "cpu"]}
    for name, argv in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"ninfer {name}: ") and DOWN_PROJ in err and bad in err, err
        assert main([*argv, "--no-verify"]) == 0, capsys.readouterr().err
        capsys.readouterr()
    assert main(["inspect", bad, "--verify"]) == 2 and DOWN_PROJ in capsys.readouterr().err


def test_serve_refuses_a_corrupted_artifact_before_serving(tmp_path, capsys):
    pytest.importorskip("ninfer_serve")
    bad = str(_corrupted_copy(tmp_path, TEMPLATE, _edit_template))
    # Port 0: the default port (8000) may be taken by another suite or a server running here, and a busy port
    # is refused before the model is read.
    assert main(["serve", bad, "--device", "cpu", "--no-warmup", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer serve: ") and TEMPLATE in err and err.count("\n") == 1, err


def test_objects_read_in_several_chunks_are_verified_whole(tmp_path):
    """Chunk crcs computed out of order join into the object's crc: a clean load passes, a flipped byte in
    the last chunk of a multi-chunk object is found."""
    def load(path: Path, *, verify: bool):
        with open_artifact(path, verify=verify) as art:
            assert art.objects[EMBED].nbytes > 1 << 20
            resolved = resolve_load(plan_load(art, ("text",)), "cpu")
            return Materializer(art, resolved, chunk_bytes=1 << 20).run()[1]

    assert load(Path(ninfer.default_model_path()), verify=True).verified
    bad = _corrupted_copy(tmp_path, EMBED, _flip_last_byte)
    with pytest.raises(ChecksumError, match=EMBED):
        load(bad, verify=True)
    assert not load(bad, verify=False).verified


@pytest.mark.gpu
def test_cuda_load_verifies_while_uploading(tmp_path):
    from ninfer.artifact import load_weights

    bad = _corrupted_copy(tmp_path, DOWN_PROJ, _zero_a_region)
    with open_artifact(ninfer.default_model_path()) as art:
        assert load_weights(art, features=("text",), device="cuda")[1].verified
    with open_artifact(bad) as art, pytest.raises(ChecksumError, match=DOWN_PROJ):
        load_weights(art, features=("text",), device="cuda")
    with open_artifact(bad, verify=False) as art:
        assert not load_weights(art, features=("text",), device="cuda")[1].verified
