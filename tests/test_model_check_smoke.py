"""benchmarks/model_check runs on CPU (tiny shape): bf16 path against the fp32 reference path."""

import math

from benchmarks.model_check import run


def test_model_check_tiny_cpu():
    res = run("tiny", "cpu", 40)
    assert math.isfinite(res["rel_all"]) and res["rel_all"] < 0.2  # bf16 noise on a 64-wide random model
    assert res["top1_agree"] >= 0.8
