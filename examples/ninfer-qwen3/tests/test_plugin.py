"""The Qwen3 plugin as ninfer sees it: conformance, config checks, `ninfer convert`, and public-API-only imports."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from ninfer.plugins import make_plugin_host
from ninfer.testing import check_architecture, check_plugin_module
from ninfer_qwen3.config import ConfigError, parse_config

SRC = Path(__file__).resolve().parents[1] / "src" / "ninfer_qwen3"
PUBLIC_API_DOC = Path(__file__).resolve().parents[3] / "docs" / "public-api.md"
SAMPLE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def test_conformance_and_no_torch_at_plugin_import():
    check_plugin_module("ninfer_qwen3.plugin")
    check_architecture("qwen3", sample_config=SAMPLE)
    assert make_plugin_host(strict=True).architecture("Qwen3ForCausalLM").spec.name == "qwen3"


@pytest.mark.parametrize(("change", "message"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"hidden_size": None}, "invalid Qwen3 config"),
])
def test_config_refuses_what_the_model_does_not_run(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**SAMPLE, **change})


def test_config_reads_rope_theta_old_and_new_style():
    assert parse_config({**SAMPLE, "rope_theta": 5e5}).rope_theta == 5e5
    assert parse_config({**SAMPLE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_theta == 1e6
    with pytest.raises(ConfigError, match="missing vocab_size"):
        parse_config({k: v for k, v in SAMPLE.items() if k != "vocab_size"})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_ninfer_convert_fuses_projections_and_ties_the_head(tmp_path, capsys, tied, make_qwen3_checkpoint):
    from ninfer.artifact import open_artifact
    from ninfer.cli import main

    make_qwen3_checkpoint(tmp_path / "ckpt", tie_word_embeddings=tied)
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "q.ninfer")]) == 0
    assert "architecture Qwen3ForCausalLM" in capsys.readouterr().out
    with open_artifact(tmp_path / "q.ninfer") as art:
        objects = {o.id for o in art.header.objects}
        assert {"model.layers.0.self_attn.qkv_proj", "model.layers.2.mlp.gate_up_proj"} <= objects
        assert ("lm_head.weight" in objects) is not tied
        head = [u.binding for u in art.header.uses if u.site == "lm_head"]
        assert head == (["model.embed_tokens.weight"] if tied else [])
        assert art.frontend.chat_template and art.frontend.tokenizer_json


def public_api() -> dict[str, set[str]]:
    """Module -> names, from the tables of docs/public-api.md (``*``: the module's ``__all__``)."""
    api: dict[str, set[str]] = {}
    for module, cell in re.findall(r"^\| `([\w.]+)` \| (.+) \|$", PUBLIC_API_DOC.read_text(), re.M):
        names = set(re.findall(r"`([\w*]+)`", cell))
        if "*" in names:
            names = set(importlib.import_module(module).__all__)
        api.setdefault(module, set()).update(names)
    return api


def test_every_public_name_exists():
    api = public_api()
    assert {"ninfer", "ninfer.contract", "ninfer.ops", "ninfer.testing"} <= set(api)
    missing = [f"{m}.{n}" for m, names in api.items() for n in names
               if not hasattr(importlib.import_module(m), n)]
    assert missing == []


def ninfer_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every import of a ninfer package in ``path``, and of every "module:attr" slot target."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"[\w.]+:[\w.]+", node.value):
            found.append(tuple(node.value.split(":")))
    return [(m, n) for m, n in found if m.split(".")[0].startswith("ninfer") and m.split(".")[0] != "ninfer_qwen3"]


def test_the_example_imports_only_the_public_api():
    api = public_api()
    files = sorted(SRC.rglob("*.py"))
    assert len(files) >= 5
    outside = [f"{f.name}: {m}{'.' + n if n else ''}" for f in files for m, n in ninfer_imports(f)
               if m not in api or (n is not None and n not in api[m])]
    assert outside == []
