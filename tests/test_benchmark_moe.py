"""benchmarks/moe.py end to end on CPU at a tiny MoE shape (8 experts, top-2, 4 of 8 layers): the random checkpoint in
the published fused layout, the converter, the all-device Program runs with their bytes floors scaled to full depth,
the full-depth expert cache plan on a sparse artifact, the host-experts runs, transformers on the same checkpoint,
the JSON and the table. Timings are reported, never compared with a threshold."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")
pytest.importorskip("transformers")

from benchmarks import moe  # noqa: E402
from benchmarks import moe_weights as mw  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LAYERS, FULL = 4, mw.TINY_MOE["num_hidden_layers"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One whole run (it takes the time of the tests below together); its JSON, printed table and workdir."""
    root = tmp_path_factory.mktemp("moe")
    out, work = root / "moe.json", root / "work"
    argv = ["--shape", "tiny", "--layers", str(LAYERS), "--device", "cpu", "--context", "12", "--steps", "3",
            "--prefill", "40", "--prefill-chunk", "16", "--budget-gib", "0.01", "--hf-new-tokens", "2",
            "--host-variants", "0,0,1", "0,0,0", "--profile", "2", "--pdl", "auto", "on", "--ops-off", "moe.moe_block", "none", "none", "--workdir", str(work), "--json", str(out)]
    stdout = io.StringIO()  # capsys is per test; the run is per module
    with contextlib.redirect_stdout(stdout):
        code = moe.main(argv)
    return {"code": code, "json": json.loads(out.read_text()), "json_path": out, "table": stdout.getvalue(), "work": work}


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_the_run_succeeds_and_leaves_only_the_json(run):
    assert run["code"] == 0, run["table"]
    assert not any(run["work"].iterdir())  # checkpoint, artifact and the sparse artifact removed
    res = run["json"]
    assert res["layers"] == LAYERS and res["full_layers"] == FULL and res["config"]["num_hidden_layers"] == LAYERS
    assert res["device"]["device"] == "cpu" and _positive(res["copy_tb_s"]) and _positive(res["wall_s"])
    assert "head" in res["scaling"] and "random" in res["routing_note"]
    assert _positive(res["checkpoint_bytes"]) and res["checkpoint_bytes"] == res["weights"]["total"]
    assert "Measured at 4 layers; full depth (8 layers)" in run["table"]


def test_all_device_decode_has_its_floor_at_both_depths(run):
    res = run["json"]
    ad = res["all_device"]
    assert ad["placement"] == "all-device"
    assert [d["batch"] for d in ad["decode"]] == [1, 8]
    w, full_w = res["weights"], res["full_weights"]
    for d in ad["decode"]:
        for key in ("ms_per_step", "tokens_per_s", "head_ms", "per_layer_ms", "full_ms", "full_tokens_per_s",
                    "floor_ms", "full_floor_ms", "of_floor", "full_of_floor"):
            assert _positive(d[key]), (key, d)
        assert d["full_ms"] == pytest.approx(d["head_ms"] + FULL * d["per_layer_ms"])
        assert d["full_floor_bytes"] > d["floor_bytes"] > w["dense_read"]
        assert full_w["dense_read"] > w["dense_read"]
    b1, b8 = ad["decode"]
    assert b1["distinct_experts"] == 2  # k experts per layer for one token
    assert 2 < b8["distinct_experts"] <= 8
    assert ad["routing"]["8"]["source"] == "measured" and ad["routing"]["8"]["groups"] > 0
    p = ad["prefill"]
    assert p["tokens"] == 40 and _positive(p["tokens_per_s"]) and _positive(p["full_tokens_per_s"])
    t = res["targets"]["decode_b1_of_floor_full_depth"]
    assert t["measured"] == b1["full_of_floor"] and t["met"] is (t["measured"] >= 0.6)


def test_the_full_depth_plan_comes_from_the_sparse_artifact(run):
    plan = run["json"]["plan"]
    assert "error" not in plan, plan
    assert plan["full_layers"] == FULL and plan["budget_bytes"] == int(0.01 * mw.GIB)
    assert plan["slots_per_layer"] == plan["expert_cache_slots"] // FULL
    assert plan["placement"]["host_bytes"] == mw.weight_bytes(mw.moe_config("tiny"))["banks"]


def test_host_experts_report_the_cache_hit_rate(run):
    he = run["json"]["host_experts"]
    assert "error" not in he, he
    if "unavailable" in he:
        pytest.skip(f"host experts are not in this tree yet: {he['unavailable']}")
    assert he["placement"] == "host-experts"
    for d in he["decode"]:
        assert _positive(d["tokens_per_s"]) and _positive(d["full_tokens_per_s"])
        stats = d["experts"]
        assert stats["cache_hits"] + stats["cache_misses"] > 0
        assert 0 <= stats["hit_rate"] <= 1
        assert stats["mixed_s"] >= stats["wait_s"] + stats["team_s"] + stats["upload_s"]
    assert _positive(he["prefill"]["tokens_per_s"])
    variant, caller = he["variants"]  # no uploads and a team of one; then the caller thread computing the misses
    assert (variant["prefetch"], variant["admit"], variant["team"]) == (0, 0, 1)
    assert variant["experts"]["admitted"] == variant["experts"]["prefetched"] == 0
    assert (caller["prefetch"], caller["admit"], caller["team"]) == (0, 0, 0)
    assert caller["experts"]["mixed_calls"] > 0
    assert "per MoE call" in run["table"]


def test_transformers_ran_on_the_same_checkpoint(run):
    hf = run["json"]["hf"]
    assert "error" not in hf, hf
    row = hf["rows"][0]
    assert row["batch"] == 1 and hf["prompt"] == 40
    assert _positive(row["decode_tokens_per_s"]) and _positive(row["prefill_tokens_per_s"])
    assert "decode" in hf and "prefill" in hf


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    assert moe.main(["--shape", "tiny", "--layers", "6", "--device", "cpu", "--workdir", str(tmp_path)]) == 2
    assert "--layers must be a positive multiple of 4" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_expected_distinct_experts():
    assert mw.expected_distinct(256, 8, 1) == pytest.approx(8)
    assert mw.expected_distinct(256, 8, 8) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 8))


def test_the_checkpoint_is_written_shard_by_shard_in_the_published_layout(tmp_path):
    from safetensors import safe_open

    cfg = mw.moe_config("tiny", 4)
    total = mw.write_checkpoint(tmp_path / "ckpt", cfg, "cpu", shard_bytes=100_000)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(mw.parameters(cfg)) and index["metadata"]["total_size"] == total
    tensors = {}
    for shard in shards:
        with safe_open(str(tmp_path / "ckpt" / shard), "pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys()})
    E, inter, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    assert tuple(tensors["model.layers.0.mlp.experts.gate_up_proj"].shape) == (E, 2 * inter, H)
    assert tuple(tensors["model.layers.0.mlp.experts.down_proj"].shape) == (E, H, inter)
    assert str(tensors["model.layers.0.linear_attn.A_log"].dtype) == "torch.float32"
    router = tensors["model.layers.0.mlp.gate.weight"].float()
    assert 0.01 < float(router.std()) < 0.04  # random, so tokens spread over the experts
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == total


def test_profile_lists_host_ops_per_step_in_both_placements(run):
    for key in ("all_device", "host_experts"):
        prof = run["json"][key]["profile"]
        assert prof["batch"] == 1 and prof["steps"] == 2 and _positive(prof["ms_per_step_profiled"])
        assert prof["kernels"] == [] and prof["device_busy_ms_per_step"] == 0  # the CPU records no device kernels
        assert prof["host"] and all(_positive(e["calls_per_step"]) for e in prof["host"])
        assert (run["json_path"].parent / f"profile_{key}.txt").is_file()
    assert "#   profile host_experts B=1" in run["table"]


def test_a_second_pdl_value_adds_its_all_device_run(run):
    extra = run["json"]["all_device_pdl_on"]
    assert extra["pdl"] == "on" and [d["batch"] for d in extra["decode"]] == [1, 8]
    assert run["json"]["all_device"]["pdl"] == "auto"


def test_ops_off_values_add_all_device_runs_under_their_own_keys(run):
    """A value given twice runs twice, each under its own key (instances of the same code differ: A/B/A/B)."""
    for key in ("all_device_ops_off_moe.moe_block", "all_device_ops_off_none_1", "all_device_ops_off_none_2"):
        assert [d["batch"] for d in run["json"][key]["decode"]] == [1, 8], key


def test_the_caller_team_runs_the_collective_once_on_the_calling_thread():
    import threading

    from benchmarks.moe_variants import CallerTeam

    calls = []
    CallerTeam().run(lambda rank, size: calls.append((rank, size, threading.current_thread())))
    assert calls == [(0, 1, threading.current_thread())]
