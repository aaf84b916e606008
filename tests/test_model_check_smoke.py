"""benchmarks/model_check runs on CPU (tiny shape). Without CUDA both bf16 paths are the torch references,
so they must agree exactly and the check must pass."""

import math

from benchmarks.model_check import run


def test_model_check_tiny_cpu():
    res = run("tiny", "cpu", 40)
    fast, ref = res["fast_bf16"], res["reference_bf16"]
    assert math.isfinite(fast["rel_all"]) and fast["rel_all"] == ref["rel_all"]
    assert 0 < fast["rel_all"] < 0.2 and fast["top1_agree"] >= 0.8
    chunked = res["fast_bf16_chunk8"]  # the prompt in 8-token chunks: the state hand-over between chunks
    assert abs(chunked["rel_all"] - ref["rel_all"]) < 0.02 and chunked["top1_regret"] < 0.05
    assert res["ok"]
