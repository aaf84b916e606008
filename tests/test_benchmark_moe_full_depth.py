"""benchmarks/moe_full_depth.py on CPU at the tiny MoE shape (8 experts, top-2, 8 layers): random weights made in
memory (no checkpoint), two variants over two rounds in order, the engine's figure, a profile, the floor and the
table. Timings are reported, never compared with a threshold."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

pytest.importorskip("ninfer_qwen35")

import torch  # noqa: E402

from benchmarks import moe_full_depth  # noqa: E402
from benchmarks import moe_weights as mw  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_full_depth_run_times_every_variant_and_round_against_the_floor(tmp_path):
    out = tmp_path / "full.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--context", "8", "--steps", "2", "--rounds", "2", "--engine",
            "--variants", "auto", "ops_off=moe.moe_block", "--profile", "2", "--json", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert moe_full_depth.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["layers"] == mw.TINY_MOE["num_hidden_layers"] and _positive(res["copy_tb_s"])
    assert [(r["round"], r["variant"]) for r in res["runs"]] == [
        (0, "auto"), (0, "ops_off=moe.moe_block"), (1, "auto"), (1, "ops_off=moe.moe_block")]
    assert all(r["pdl"] is False and r["graphs"] is False for r in res["runs"])  # the CPU: no PDL, no graphs
    assert res["runs"][1]["ops_off"] == "moe.moe_block" and res["runs"][0]["ops_off"] is None
    assert "profile" in res["runs"][0] and "profile" not in res["runs"][1]
    assert all(isinstance(row["engine_steady"], bool) and _positive(row["engine_ms_whole_run"])
               for r in res["runs"] for row in r["rows"])
    assert (tmp_path / "profile_full_depth.txt").exists()
    for spec in ("auto", "ops_off=moe.moe_block"):
        for B in ("1", "8"):
            row = res["summary"][spec][B]
            assert len(row["ms_rounds"]) == 2 and len(row["engine_rounds"]) == 2
            assert all(_positive(row[k]) for k in ("ms_per_step", "tokens_per_s", "floor_ms", "of_floor",
                                                   "engine_ms_per_step", "distinct_experts"))
    assert res["distinct_experts"]["1"] == mw.TINY_MOE["num_experts_per_tok"]
    target = res["targets"]["decode_b1_of_floor_full_depth"]
    assert target["measured"] == res["summary"]["auto"]["1"]["of_floor"] and target["met"] is False
    assert "| auto | 1 |" in stdout.getvalue() and "at full depth (8 layers" in stdout.getvalue()


def test_auto_pdl_is_what_the_startup_would_choose(monkeypatch):
    """"auto" asks prefers_pdl with the Qwen3.5 startup's all-device placement of these weights (no CUDA is
    touched: the choice is arithmetic on the weights' bytes); on the CPU it is off."""
    from benchmarks.decode_step import auto_pdl, random_parameters
    from ninfer.core.device_plan import resident_bytes
    from ninfer_qwen35.startup import _placements

    monkeypatch.delenv("NINFER_PDL", raising=False)
    cfg = mw.moe_config("tiny")
    params = random_parameters(cfg, "cpu", torch.float32)
    banks = params[1].expert_banks()
    placement = _placements(resident_bytes(params[1].tensors()), resident_bytes(banks), banks, 2)[0]
    assert 0 < placement.step_read_bytes < placement.device_bytes  # k of 8 experts per layer
    assert auto_pdl(params, "cuda") is True and auto_pdl(params, "cpu") is False
    monkeypatch.setenv("NINFER_PDL", "0")
    assert auto_pdl(params, "cuda") is False


def test_variants_parse_into_pdl_ops_and_knobs():
    from benchmarks.moe_variants import pdl_knobs
    from ninfer.ops.triton import _pdl

    assert moe_full_depth.parse_variant("pdl=off") == {"pdl": False, "ops_off": None, "knobs": {}, "tiles": {}}
    knobs = moe_full_depth.parse_variant("prefetch_tiles=0")["knobs"]
    assert knobs == {"PREFETCH_TILES": 0}
    before = _pdl.PREFETCH_TILES
    with pdl_knobs(knobs):
        assert _pdl.PREFETCH_TILES == 0
    assert _pdl.PREFETCH_TILES == before


def test_tile_variants_patch_the_kernels_defaults_and_restore_them():
    from benchmarks.moe_variants import tiles
    from ninfer.ops.triton import attention as t_attention
    from ninfer.ops.triton import gdn as t_gdn
    from ninfer.ops.triton import linear as t_linear
    from ninfer.ops.triton import moe as t_moe
    from ninfer.ops.triton import moe_one_token as t_one

    v = moe_full_depth.parse_variant("moe_tiles=1:16,32,128,4,4+linear_tiles=2048x4096:64,128,2+gdn_block_v=32"
                                     "+attention=64,16+one_token=16,64,32,128,8,3,1,1+late_trigger=1")
    assert v["pdl"] is None and set(v["tiles"]) == {"moe", "linear", "gdn_block_v", "attention", "one_token"}
    assert v["knobs"] == {"LATE_TRIGGER": True}
    rows, before = t_moe._BY_TOKENS, t_linear.default_config(2048, 4096)
    with tiles(**v["tiles"]):
        assert t_moe.default_config(1, torch.bfloat16) == t_moe.MoeConfig(16, 32, 128, 4, 4)
        assert t_moe.default_config(8, torch.bfloat16) == dict(rows)[16]  # the other rows stay
        assert t_linear.default_config(2048, 4096)[:3] == (64, 128, 2)
        assert t_gdn._default_block_v(1, 32, 128) == 32
        assert (t_attention.DECODE_TILE_N, t_attention.MAX_DECODE_SPLITS) == (64, 16)
        assert t_one.TILES == t_one.OneTokenTiles(16, 64, 32, 128, 8, 3, preload=True)
    assert t_one.TILES == t_one.OneTokenTiles()
    assert t_moe._BY_TOKENS is rows and t_linear.default_config(2048, 4096) == before
    assert t_gdn._default_block_v(1, 32, 128) == 16
    assert (t_attention.DECODE_TILE_N, t_attention.MAX_DECODE_SPLITS) == (32, 64)
    with pytest.raises(ValueError, match="token limits"), tiles(moe={3: t_moe.MoeConfig(16, 32, 64, 4, 4)}):
        pass


@pytest.mark.parametrize("spec", ["pdl=maybe", "ops_off=", "fast", "prefetch_tiles=many", "moe_tiles=1:16,32",
                                  "linear_tiles=2048:32,128,4", "gdn_block_v=0", "attention=64", "one_token=16,64,32,128,8,3",
                                  "one_token=16,64,32,128,8,3,0,1,0", "late_trigger=2", "pdl=on+nothing=1"])
def test_bad_variants_are_refused(spec, capsys):
    assert moe_full_depth.main(["--shape", "tiny", "--device", "cpu", "--variants", spec]) == 2
    assert "variant" in capsys.readouterr().err
