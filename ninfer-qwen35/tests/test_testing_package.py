"""``ninfer_qwen35.testing`` imports no torch until a helper that needs it is used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _loaded_after(code: str) -> list[str]:
    probe = code + "; print(__import__('json').dumps([m for m in ('torch', 'transformers') if m in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", "import sys; " + probe], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_package_loads_no_torch():
    assert _loaded_after("import ninfer_qwen35.testing") == []


def test_names_load_their_submodule_on_access():
    import ninfer_qwen35.testing as testing
    from ninfer_qwen35.testing import float32_program, model_from_hf
    from ninfer_qwen35.testing.hf_model import model_from_hf as direct

    assert model_from_hf is direct and callable(float32_program)
    assert "make_tiny_checkpoint" in dir(testing)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        testing.nope  # noqa: B018
