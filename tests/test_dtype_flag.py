"""``--dtype`` (one shared flag on generate, score, plan and serve) reaches the model's startup: the plan charges
float32 weights, generate runs in float32, and a dtype outside float32 / bfloat16 / float16 is a usage error."""

from __future__ import annotations

import json
import re

import pytest

from ninfer.cli import main

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _weights(capsys, *args: str) -> tuple[dict, str]:
    assert main(["plan", "--device", "cpu", "--json", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    return report, report["categories"]["weights"]


def test_plan_charges_the_dtype_asked_for(capsys):
    stored, stored_bytes = _weights(capsys)
    wide, wide_bytes = _weights(capsys, "--dtype", "float32")
    assert stored["dtype"] == "bfloat16" and wide["dtype"] == "float32"
    assert wide_bytes >= 2 * stored_bytes  # every bfloat16 weight is prepared as float32: twice its bytes at least


def test_generate_runs_in_the_dtype_asked_for(capsys):
    args = ["generate", "--prompt", "ROMEO:", "--max-tokens", "4", "--temperature", "0", "--ignore-eos",
            "--device", "cpu"]
    shown = {}
    for dtype in ("bfloat16", "float32"):
        assert main([*args, "--dtype", dtype]) == 0
        out, err = capsys.readouterr()
        assert out and "4 generated tokens" in err, err
        shown[dtype] = re.search(r"weights ([\d.]+ [KMG]iB)", err).group(1)
    assert shown["float32"] != shown["bfloat16"], shown


@pytest.mark.parametrize("command", ["generate", "score", "plan", "serve"])
def test_a_dtype_it_cannot_run_is_a_usage_error(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--dtype", "float8", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"ninfer {command}: error: argument --dtype: invalid choice: 'float8' (choose from" in err, err
