"""benchmarks/norm_in_linear.py's smoke run on the CPU (Triton's interpreter): the fused projection (ten term rows,
the norm's weight folded into W, rstd from the K loop) gives the norm-then-projection output."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from benchmarks import norm_in_linear  # noqa: E402

# Triton's interpreter converts 1-element arrays to ints, which numpy deprecates; not our code.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_smoke_run_checks_the_fused_projection(tmp_path, capsys):
    out = tmp_path / "nil.json"
    assert norm_in_linear.main(["--device", "cpu", "--layers", "2", "--rows", "64", "--hidden", "128",
                                "--json", str(out)]) == 0
    assert "fused checked against the parts" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][0]["max_rel_err"] < 2e-2


def test_the_check_catches_a_wrong_projection():
    chain = norm_in_linear.Chain(1, 64, 128, torch.device("cpu"))
    chain.run("fused")
    chain.ys[1].mul_(1.5)  # as if rstd or the folded weight were off
    with pytest.raises(AssertionError, match="off the parts"):
        norm_in_linear._check(chain, "")


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        norm_in_linear.main(["--device", "cpu", "--hidden", "8"])
