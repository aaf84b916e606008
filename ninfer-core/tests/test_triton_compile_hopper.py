"""Every Triton kernel compiles for Hopper (sm_90), with and without its programmatic-dependent-launch
prologue, on this machine (Triton ships ptxas; no GPU needed). The CPU interpreter never compiles a kernel,
so this is what catches code that only a real build rejects; correctness on the device is the job of the GPU
tests (ninfer-core/tests/gpu)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_every_kernel_compiles_for_sm90(pdl):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "ninfer-core" / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "benchmarks.compile_check", "--arch", "90"] + (["--pdl"] if pdl else [])
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    # Built as a launch specializes them (aligned pointers, sizes divisible by 16): the few-row linear's weight
    # loads are cp.async-pipelined, as on the GPU, not scalar loads.
    linear = [line for line in run.stdout.splitlines() if "_linear_rows_kernel" in line]
    assert linear and all(line.endswith("cp_async") for line in linear), run.stdout
    assert "54 kernel builds for sm_90\n" in run.stdout, run.stdout
    if pdl:  # every build waits before its first global access, then lets its successor be scheduled
        assert run.stdout.count("gdc_wait gdc_launch_dependents") == 54 and "l2_prefetch" in run.stdout
    else:
        assert "gdc_wait" not in run.stdout, run.stdout
