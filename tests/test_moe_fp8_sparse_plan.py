"""The 35B-A3B in Qwen's fine-grained FP8 planned for one 80 GB card: a sparse artifact of the published shape at
full depth (``benchmarks/sparse.py``: the real converter imports an FP8 checkpoint whose data is a hole, bytes as
stored) and ``ninfer plan`` on it. All its weights fit on the card beside more than 200k tokens of KV (issue 46's
target), where the bf16 model's weights take 64.6 GiB of it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ninfer_convert")

from benchmarks.harness import run_with_plugins  # noqa: E402
from benchmarks.sparse import fp8_tensors, write_sparse_artifact  # noqa: E402

H100_MIB = 81559  # an 80 GB card's memory


def _plan(art, capsys) -> dict:
    from ninfer.cli import main

    assert main(["plan", str(art), "--device", "cuda", "--vram-budget", str(H100_MIB), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_fp8_release_quantizes_what_qwen_quantizes():
    tensors = {"model.layers.0.mlp.experts.gate_up_proj": ([256, 1024, 2048], "BF16", 2),
               "model.layers.0.mlp.gate.weight": ([256, 2048], "BF16", 2),
               "model.layers.0.linear_attn.out_proj.weight": ([2048, 4096], "BF16", 2),
               "model.layers.0.self_attn.q_proj.weight": ([8192, 2048], "BF16", 2),
               "model.layers.0.input_layernorm.weight": ([2048], "BF16", 2)}
    out, kept = fp8_tensors(tensors)
    assert out["model.layers.0.mlp.experts.gate_up_proj"] == ([256, 1024, 2048], "F8_E4M3", 1)
    assert out["model.layers.0.mlp.experts.gate_up_proj_scale_inv"] == ([256, 8, 16], "F32", 4)
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"] == ([64, 16], "F32", 4)
    assert kept == ["model.layers.0.linear_attn.out_proj", "model.layers.0.mlp.gate"]
    assert out["model.layers.0.input_layernorm.weight"] == ([2048], "BF16", 2)


def test_the_35b_a3b_in_fp8_fits_one_80_gb_card_with_room_for_context(tmp_path, capsys):
    fp8 = run_with_plugins(lambda _: write_sparse_artifact("35b-a3b", tmp_path, fp8=True), None)
    bf16 = run_with_plugins(lambda _: write_sparse_artifact("35b-a3b", tmp_path), None)
    quantized, dense = _plan(fp8, capsys), _plan(bf16, capsys)
    assert quantized["fits"] and quantized["placement"] == "all-device", quantized
    assert quantized["kv_tokens"] >= 200_000 and quantized["kv_tokens"] > 3 * dense["kv_tokens"]
    gib = 1 << 30
    assert 30 * gib < quantized["categories"]["weights"] < 36 * gib < 60 * gib < dense["categories"]["weights"]
