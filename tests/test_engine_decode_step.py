"""benchmarks/decode_step.py runs end to end on CPU with the tiny shape (the GPU run uses --shape 9b)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ninfer_qwen35")

from benchmarks.decode_step import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_decode_step_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--steps", "2", "--context", "6", "--batch", "1", "2",
                 "--engine", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    # Timings of this machine: only their presence and sign are certain (windows on a monotonic clock).
    assert all(r["ms_median"] >= 0 and r["tokens_per_s"] >= 0 and r["engine_ms_per_step"] >= 0 for r in rows)
    assert "ms/step" in capsys.readouterr().out


def test_decode_step_benchmark_rejects_bad_batch():
    assert main(["--shape", "tiny", "--device", "cpu", "--batch", "9"]) == 2
