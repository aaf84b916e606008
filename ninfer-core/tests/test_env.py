"""The environment-variable registry: one place, documented, and the only reader of NINFER_* names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ninfer import env

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_is_the_registry():
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert env.markdown_table() in doc


def test_library_code_reads_ninfer_variables_only_through_the_registry():
    """No ``os.environ[...]`` / ``os.getenv`` / ``environ.get`` of a NINFER_* name outside ninfer/env.py, and
    every NINFER_* name the packages mention is registered."""
    direct = re.compile(r"(environ(\.get)?|getenv)\(?\[?\s*[\"']NINFER_")
    mentioned = re.compile(r"NINFER_[A-Z0-9_]+")
    registered = {v.name for v in env.REGISTRY}
    offenders, unknown = [], set()
    for path in ROOT.glob("ninfer-*/src/**/*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name == "env.py" and path.parent.name == "ninfer":
            continue
        if direct.search(text):
            offenders.append(str(path.relative_to(ROOT)))
        unknown |= set(mentioned.findall(text)) - registered
    assert not offenders, f"read NINFER_* directly (use ninfer.env.get): {offenders}"
    assert not unknown, f"NINFER_* names not in ninfer/env.py: {sorted(unknown)}"


def test_values_are_parsed_and_malformed_ones_name_the_variable():
    assert env.get("NINFER_PLUGINS", {}) is None
    assert env.get("NINFER_PLUGINS", {"NINFER_PLUGINS": ""}) == ()
    assert env.get("NINFER_EXTRA_PLUGINS", {"NINFER_EXTRA_PLUGINS": "a, b,"}) == ("a", "b")
    assert env.get("NINFER_STRICT_PLUGINS", {"NINFER_STRICT_PLUGINS": "yes"}) is True
    assert env.get("NINFER_PDL", {}) is None and env.get("NINFER_PDL", {"NINFER_PDL": "0"}) is False
    assert env.get("NINFER_OPS", {"NINFER_OPS": " Torch "}) == "torch"
    assert env.get("NINFER_VRAM_BUDGET_MIB", {"NINFER_VRAM_BUDGET_MIB": "1024"}) == 1024
    with pytest.raises(env.EnvError, match="NINFER_OPS='cuda': expected one of"):
        env.get("NINFER_OPS", {"NINFER_OPS": "cuda"})
    with pytest.raises(env.EnvError, match="NINFER_PDL='maybe'"):
        env.get("NINFER_PDL", {"NINFER_PDL": "maybe"})
    with pytest.raises(env.EnvError, match="NINFER_VRAM_BUDGET_MIB='-5': expected a positive"):
        env.get("NINFER_VRAM_BUDGET_MIB", {"NINFER_VRAM_BUDGET_MIB": "-5"})
    with pytest.raises(KeyError, match="NINFER_NOPE is not a registered"):
        env.get("NINFER_NOPE")


def test_env_command_shows_values_and_names_a_bad_one(capsys, monkeypatch):
    from ninfer.cli import main

    monkeypatch.setenv("NINFER_OPS", "torch")
    assert main(["env"]) == 0
    assert "NINFER_OPS" in capsys.readouterr().out
    monkeypatch.setenv("NINFER_OPS", "gpu")
    assert main(["env"]) == 1
    assert "error: NINFER_OPS='gpu'" in capsys.readouterr().out


def test_env_command_masks_secrets(capsys, monkeypatch):
    from ninfer.cli import main

    assert env.variable("NINFER_API_KEY").secret
    monkeypatch.setenv("NINFER_API_KEY", "sk-very-secret-key")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "sk-very-secret-key" not in out
    line = next(x for x in out.splitlines() if x.startswith("NINFER_API_KEY"))
    assert "<set, 18 chars>" in line
    monkeypatch.delenv("NINFER_API_KEY")
    assert main(["env"]) == 0
    assert "<unset>" in next(x for x in capsys.readouterr().out.splitlines() if x.startswith("NINFER_API_KEY"))


def test_a_malformed_secret_is_named_but_not_quoted():
    secret = env.EnvVar(name="NINFER_X", kind="count", default=None, meaning="", parse=env._count, secret=True)
    with pytest.raises(env.EnvError) as info:
        secret.read({"NINFER_X": "hunter2"})
    assert "hunter2" not in str(info.value) and "NINFER_X=<secret>" in str(info.value)
