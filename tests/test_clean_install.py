"""Acceptance: in a clean venv, core + qwen35 install with the constraints file; a third-party plugin
shows up in `ninfer archs` after installing it, with no change to ninfer-core."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_clean_venv_install(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"

    def pip(*args):
        proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "-c",
                               str(ROOT / "requirements/constraints-cpu.txt"), *args],
                              capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-4000:]

    pip(str(ROOT / "ninfer-core"), str(ROOT / "ninfer-qwen35"))
    ninfer = env_dir / "bin" / "ninfer"
    plugins = json.loads(subprocess.run([str(ninfer), "plugins", "--json"], capture_output=True, text=True,
                                        check=True).stdout)
    assert [p["name"] for p in plugins["plugins"]] == ["qwen35"]
    archs = json.loads(subprocess.run([str(ninfer), "archs", "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    assert [a["name"] for a in archs] == ["qwen35", "qwen35_moe"]
    pip(str(ROOT / "tests/example_plugin"))
    archs = json.loads(subprocess.run([str(ninfer), "archs", "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    assert sorted(a["name"] for a in archs) == ["example_arch", "qwen35", "qwen35_moe"]
    assert sys.version_info >= (3, 11)
