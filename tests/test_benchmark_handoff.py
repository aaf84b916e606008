"""benchmarks/handoff.py's smoke run on the CPU (Triton's interpreter): both consumer modes give 2 W x, and the
counter mode leaves its counters at zero."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from benchmarks import handoff  # noqa: E402
from ninfer.ops.triton._arrivals import arrival_counters  # noqa: E402


def test_smoke_run_checks_both_modes(tmp_path, capsys):
    out = tmp_path / "handoff.json"
    assert handoff.main(["--device", "cpu", "--pairs", "2", "--rows", "64", "--cols", "128", "--block-k", "64",
                         "--block", "32", "--json", str(out)]) == 0
    assert "producers, wait, counter checked" in capsys.readouterr().out
    assert out.exists()
    assert not arrival_counters(torch.device("cpu"), 2)[:2].any()


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        handoff.main(["--device", "cpu", "--rows", "60", "--block-n", "8"])
