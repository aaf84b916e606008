"""benchmarks/load_throughput.py runs end to end on the CPU with the tiny shape (the GPU run uses --shape 9b)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ninfer_convert")
pytest.importorskip("ninfer_qwen35")

ROOT = Path(__file__).resolve().parents[2]


def test_load_throughput_tiny_cpu(tmp_path):
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.load_throughput", "--shape", "tiny", "--device", "cpu",
                           "--workdir", str(tmp_path), "--repeats", "2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["load_bytes"] == res["source_bytes"] > 0 and len(res["load_s"]) == 2
    assert res["convert_gb_s"] > 0 and res["load_best_gb_s"] > 0
    assert len(res["load_no_verify_s"]) == 2 and res["load_no_verify_best_gb_s"] > 0  # side by side
    assert "| convert" in proc.stdout and "| load text (verified)" in proc.stdout
    assert "| load text (no verify)" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["res.json"]  # workdir cleaned up
