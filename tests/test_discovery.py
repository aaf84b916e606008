"""Discovery through real, installed entry points and the conformance kit on every plugin."""

import importlib.metadata as md
import json
import shutil
import subprocess
import sys

import pytest

from ninfer.plugins import make_plugin_host
from ninfer.testing import check_architecture, check_plugin_module

INSTALLED = ("qwen35", "qwen4exp", "serve", "convert", "example_arch")


def test_entry_points_are_installed():
    names = set(md.entry_points(group="ninfer").names)
    assert set(INSTALLED) <= names


def test_real_discovery_registers_architectures():
    host = make_plugin_host(strict=True)
    assert {p.name for p in host.loaded} >= set(INSTALLED)
    archs = host.architectures()
    assert archs["qwen35"].plugin == "qwen35"
    assert archs["example_arch"].plugin == "example_arch"  # third party, no change to ninfer-core
    assert host.architecture("Qwen3_5ForCausalLM").spec.name == "qwen35"
    assert host.architecture("Qwen4ExpForCausalLM").spec.name == "qwen4exp"


@pytest.mark.parametrize("module", ["ninfer_qwen35.plugin", "ninfer_qwen4exp.plugin", "ninfer_serve.plugin",
                                    "ninfer_convert.plugin", "ninfer_example_arch.plugin"])
def test_plugin_modules_import_no_torch(module):
    check_plugin_module(module)


QWEN35_TINY = {
    "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
}


def test_qwen35_conformance():
    check_architecture("qwen35", sample_config=QWEN35_TINY)


def test_example_plugin_conformance():
    check_architecture("example_arch")


def _ninfer(*args):
    exe = shutil.which("ninfer", path=str(__import__("pathlib").Path(sys.executable).parent))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_console_script_lists_plugin_commands():
    proc = _ninfer("--help")
    assert proc.returncode == 0
    for cmd in ("archs", "plugins", "serve", "convert"):
        assert cmd in proc.stdout
    archs = json.loads(_ninfer("archs", "--json").stdout)
    assert {a["name"]: a["plugin"] for a in archs}["qwen35"] == "qwen35"
    plugins = json.loads(_ninfer("plugins", "--json").stdout)
    assert plugins["failures"] == []
