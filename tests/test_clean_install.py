"""Acceptance: core + qwen35 install with the constraints file, and a third-party plugin shows up in
`ninfer archs --all` after installing it, with no change to ninfer-core.

Two cheaper halves of one clean install (which takes minutes, most of it unpacking torch): pip resolves every
dependency of the two packages under the constraints as for an empty environment (a dry run: nothing is
downloaded or installed), and the packages built as wheels into a clean venv, with only what the plugin
commands import (no torch), register through their entry points; the embedded model comes with ninfer-qwen35."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = str(ROOT / "requirements/constraints-cpu.txt")
PIP_TIMEOUT_S = 600  # generous: a loaded 2-core machine builds the packages slowly


def pip(python: str | Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True,
                          timeout=PIP_TIMEOUT_S, **kwargs)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_the_dependencies_resolve_under_the_constraints(tmp_path):
    report = tmp_path / "report.json"
    pip(sys.executable, "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
        "-c", CONSTRAINTS, str(ROOT / "ninfer-core"), str(ROOT / "ninfer-qwen35"))
    found = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert {"ninfer-core", "ninfer-qwen35", "torch", "triton", "xgrammar", "transformers"} <= set(found)
    assert found["torch"].startswith("2.13.0") and found["triton"] == "3.6.0"  # the constraints, not the newest


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory) -> Path:
    """A venv with ninfer-core and ninfer-qwen35 installed as wheels (--no-deps), beside the few packages the
    plugin commands import."""
    env_dir = tmp_path_factory.mktemp("clean") / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    pip(py, "install", "-q", "-c", CONSTRAINTS, "pluggy", "attrs", "cattrs")
    pip(py, "install", "-q", "--no-deps", str(ROOT / "ninfer-core"), str(ROOT / "ninfer-qwen35"))
    return env_dir


def ninfer(env_dir: Path, *args: str):
    proc = subprocess.run([str(env_dir / "bin" / "ninfer"), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_installed_packages_register_through_entry_points(clean_venv):
    names = [p["name"] for p in ninfer(clean_venv, "plugins", "--json")["plugins"]]
    assert names in (["qwen35"], ["example_arch", "qwen35"])  # the example plugin if its test ran first
    assert [a["name"] for a in ninfer(clean_venv, "archs", "--json")] == ["qwen35", "qwen35_moe"]
    assert sys.version_info >= (3, 11)


@pytest.mark.slow
def test_the_embedded_model_comes_with_the_qwen35_wheel_not_with_core(clean_venv):
    py = clean_venv / "bin" / "python"
    proc = subprocess.run([str(py), "-c", "import ninfer, pathlib; print(ninfer.default_model_path()); "
                           "print(*pathlib.Path(ninfer.__file__).parent.rglob('*.ninfer'))"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model, core_models = (proc.stdout.splitlines() + [""])[:2]
    assert Path(model).is_file() and Path(model).parent.parent.name == "ninfer_qwen35", model
    assert core_models == ""  # the core wheel ships no model


@pytest.mark.slow
def test_a_third_party_plugin_shows_up_once_installed(clean_venv):
    pip(clean_venv / "bin" / "python", "install", "-q", "--no-deps", str(ROOT / "tests/example_plugin"))
    archs = ninfer(clean_venv, "archs", "--json", "--all")
    assert sorted(a["name"] for a in archs) == ["example_arch", "qwen35", "qwen35_moe"]
    assert [a["name"] for a in ninfer(clean_venv, "archs", "--json")] == ["qwen35", "qwen35_moe"]  # an example
