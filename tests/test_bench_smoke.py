"""benchmarks/bench.py end to end on CPU with the tiny shape: checkpoint written, converted, run through the
public Engine and through transformers, every JSON field the GPU run reports is present and sane.

No test here depends on how fast this machine is: the end-to-end runs time everything with a ticking
clock (each reading 1 ms after the one before), so every figure the harness computes is a deterministic
function of the engine's schedule and the harness's arithmetic, and a sign or window mistake shows on
any machine."""

from __future__ import annotations

import itertools
import json
import os
import random

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")
pytest.importorskip("transformers")

from benchmarks import bench  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


class TickingClock:
    """A deterministic monotonic clock: every reading is 1 ms after the previous one, on any thread."""

    def __init__(self) -> None:
        self._ticks = itertools.count(1)

    def __call__(self) -> float:
        return next(self._ticks) * 1e-3  # itertools.count is atomic under the GIL


@pytest.fixture
def ticking_clock(monkeypatch):
    monkeypatch.setattr(bench, "clock", TickingClock())


@pytest.mark.usefixtures("ticking_clock")
def test_bench_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    prof = tmp_path / "profiles"  # made by the harness
    argv = ["--shape", "tiny", "--device", "cpu", "--quick", "--batches", "1", "2", "4", "--contexts", "8", "24",
            "--prefill", "16", "40", "--steps", "3", "--prefill-chunk", "16", "--hf-prompt", "16",
            "--hf-new-tokens", "2", "--hf-batches", "1", "--workdir", str(tmp_path), "--json", str(out),
            "--profile", str(prof)]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["device"]["device"] == "cpu" and res["wall_s"] > 0
    ce = res["ceilings"]
    assert ce["copy_tb_s"] > 0 and ce["matmul_tflops"] > 0 and set(ce["chain_ms"]["tiny"]) == {"1", "2", "4"}

    tiny = res["shapes"]["tiny"]
    eng = tiny["engine"]
    # --quick: the longer context only at B=1 and the largest B.
    assert [(d["batch"], d["context"]) for d in eng["decode"]] == [(1, 8), (2, 8), (4, 8), (1, 24), (4, 24)]
    for d in eng["decode"]:
        assert d["tokens_per_s"] > 0 and d["ms_per_step"] > 0 and d["window_steps"] >= 3
        assert d["ttft_ms_median"] > 0 and d["ttft_ms_p90"] >= d["ttft_ms_median"]
        assert d["itl_ms_p90"] >= d["itl_ms_median"] > 0
        assert d["bytes_per_step"] > tiny["decode_weight_bytes"] and d["over_chain"] > 0
        assert d["engine_itl_ms_mean"] >= 0  # the engine's own (real) clock: only its sign is certain
    assert [p["tokens"] for p in eng["prefill"]] == [16, 40]
    assert all(p["tokens_per_s"] > 0 and len(p["seconds_all"]) == 2 for p in eng["prefill"])
    assert eng["engine_metrics"]["preemptions"] == 0
    assert eng["memory"]["max_model_len"] >= eng["max_model_len"]

    hf = tiny["hf"]
    assert "error" not in hf, hf
    assert [r["batch"] for r in hf["rows"]] == [1] and hf["rows"][0]["decode_tokens_per_s"] > 0
    r = tiny["ratios"]
    assert {"decode_b1_over_chain", "decode_b1_over_hf", "prefill_16_mfu", "prefill_16_over_hf"} <= set(r)
    assert sorted(tmp_path.iterdir()) == [out, prof]  # checkpoint and artifact removed
    # steady-window profiles at the smallest and largest B, with the full table beside the JSON
    assert [(p["batch"], p["context"]) for p in eng["profile"]] == [(1, 8), (4, 8)]
    assert all(p["window_steps"] >= 3 and p["top"] and p["top"][0]["ms_per_step"] >= 0 for p in eng["profile"])
    assert sorted(f.name for f in prof.iterdir()) == ["profile-tiny-b1.txt", "profile-tiny-b4.txt"]
    text = capsys.readouterr().out
    assert "| B | context | ms/step |" in text and "| prompt | prefill s |" in text


def test_hf_baseline_rates_come_from_one_run_and_stay_positive_under_any_clock(tmp_path):
    """Regression: the decode step was (T(N new) - T(1 new)) / (N - 1) over two separately timed runs, and
    when the runs' noise exceeded the decode time it came out negative (-421.6 tok/s on a busy 2-core
    host). A clock that advances by a random amount at every reading models that noise; the prefill and
    decode figures come from token times inside one run, so they stay positive."""
    from benchmarks import hf_baseline
    from ninfer_qwen35.testing.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "hf", mtp=False)
    rng, now = random.Random(3), [0.0]

    def jittery() -> float:
        now[0] += rng.uniform(1e-4, 0.1)
        return now[0]

    res = hf_baseline.run(ckpt, device="cpu", prompt=8, new_tokens=3, batches=(1, 2, 3), dtype="float32",
                          clock=jittery)
    assert [r["batch"] for r in res["rows"]] == [1, 2, 3]
    for r in res["rows"]:
        assert r["decode_ms_per_step"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["total_s"] > r["prefill_s"] > 0 and r["prefill_tokens_per_s"] > 0


def test_prefill_flops_counts_the_head_once_and_causal_attention():
    cfg = bench.SHAPES["9b"]
    f = bench.model_figures(cfg)
    assert round(f["decode_weight_bytes"] / 1e9, 2) == 15.87  # measured_h200.md: 15.87 GB per decode step
    one, two = bench.prefill_flops(cfg, 1), bench.prefill_flops(cfg, 2)
    per_token = two - one
    assert 2 * f["layer_matmul_params"] < per_token < 2 * f["layer_matmul_params"] * 1.01
    assert one > 2 * (f["layer_matmul_params"] + f["lm_head_params"])


def test_steady_decode_uses_only_the_window_where_all_rows_decode():
    a = {"submitted": 0.0, "times": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]}
    b = {"submitted": 0.0, "times": [1.25, 1.3, 1.4, 1.5, 1.6, 1.7]}
    d = bench.steady_decode([a, b])
    # window [1.25, 1.5]: a has 1.3..1.5 (0.1 s steps), b has 1.25..1.5 (1.25, 1.3, 1.4, 1.5).
    assert d["window_s"] == pytest.approx(0.25)
    assert d["tokens_per_s"] == pytest.approx(1 / 0.1 + 3 / 0.25)
    assert d["ttft_ms_median"] == pytest.approx(1125.0)


@pytest.mark.parametrize("argv", [["--batches", "9"], ["--steps", "2"], ["--prefill", "0"], ["--hf-new-tokens", "1"]])
def test_bad_arguments_are_refused(argv, capsys):
    assert bench.main(["--shape", "tiny", "--device", "cpu", *argv]) == 2
    assert "bench:" in capsys.readouterr().err


def test_a_failing_shape_is_reported_and_cleaned_up(tmp_path, monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(bench, "bench_engine", broken)
    out = tmp_path / "bench.json"
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--no-ceilings", "--no-hf", "--workdir", str(tmp_path),
                       "--json", str(out)]) == 1
    assert json.loads(out.read_text())["shapes"]["tiny"]["error"] == "RuntimeError: engine exploded"
    assert list(tmp_path.iterdir()) == [out]
    assert "FAILED: tiny" in capsys.readouterr().out


@pytest.mark.usefixtures("ticking_clock")
def test_artifact_cache_is_built_once_and_reused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    argv = ["--shape", "tiny", "--device", "cpu", "--no-ceilings", "--no-hf", "--quick", "--batches", "1",
            "--contexts", "8", "--prefill", "16", "--steps", "3", "--prefill-chunk", "16",
            "--workdir", str(tmp_path / "work"), "--artifact-cache", str(cache), "--json", str(tmp_path / "a.json")]
    assert bench.main(argv) == 0
    first = json.loads((tmp_path / "a.json").read_text())["shapes"]["tiny"]
    assert "artifact_reused" not in first and [f.name for f in cache.iterdir()] == ["tiny.ninfer"]
    monkeypatch.setattr(bench, "write_source", lambda *a, **k: pytest.fail("the cached artifact was rebuilt"))
    assert bench.main(argv) == 0
    second = json.loads((tmp_path / "a.json").read_text())["shapes"]["tiny"]
    assert second["artifact_reused"] == str(cache / "tiny.ninfer") and second["engine"]["decode"]
    assert list((tmp_path / "work").iterdir()) == []  # the per-run folders are removed, the cache stays


def test_gpu_only_report_paths_format_a_9b_result():
    """Peak memory, device-busy profiles and the issue's targets appear only in GPU runs: check their
    report paths on a result shaped like one (figures made up for the formatting, not measurements)."""
    decode = [{"batch": B, "context": 1024, "ms_per_step": 5.0 + B * 0.01, "tokens_per_s": B * 1000 / (5.0 + B * 0.01),
               "bytes_per_step": bench.decode_bytes(bench.SHAPES["9b"], B, 1024), "chain_ms": 4.9,
               "over_chain": 4.9 / (5.0 + B * 0.01), "ttft_ms_median": 90.0, "ttft_ms_p90": 120.0,
               "itl_ms_median": 5.0, "itl_ms_p90": 5.5} for B in (1, 8)]
    shape = {"shape": "9b", **bench.model_figures(bench.SHAPES["9b"]),
             "engine": {"start_s": 12.0, "graphs": True, "decode": decode,
                        "prefill": [{"tokens": 512, "seconds": 0.02, "tokens_per_s": 25600.0, "model_tflops": 357.0},
                                    {"tokens": 4096, "seconds": 0.12, "tokens_per_s": 34133.0, "model_tflops": 484.0}],
                        "profile": [{"batch": 1, "context": 1024, "device_busy_ms_per_step": 4.6,
                                     "top": [{"name": "gemv", "ms_per_step": 3.9, "calls_per_step": 96}]},
                                    {"batch": 8, "context": 1024, "error": "RuntimeError: CUPTI"}],
                        "peak_memory_bytes": 20 << 30, "plan": {"kv_pages": 1100}},
             "hf": {"transformers": "5.17.0", "fla": True, "prompt": 512, "new_tokens": 64,
                    "rows": [{"batch": 1, "decode_ms_per_step": 136.0, "decode_tokens_per_s": 7.35,
                              "prefill_tokens_per_s": 4200.0},
                             {"batch": 8, "decode_ms_per_step": 112.0, "decode_tokens_per_s": 71.0,
                              "prefill_tokens_per_s": 26000.0}]}}
    ceilings = {"copy_tb_s": 4.3, "matmul_tflops": 790.0, "matmul_dtype": "bfloat16", "chain_ms": {"9b": {"1": 4.9}}}
    shape["ratios"] = bench.ratios(shape, ceilings)
    shape["targets"] = bench.check_targets(bench.TARGETS["9b"], shape["ratios"])
    assert shape["targets"]["decode_b1_tokens_per_s"]["met"] is True
    assert shape["targets"]["decode_b8_tokens_per_s"]["met"] is True
    assert shape["targets"]["prefill_4096_mfu"]["met"] is True
    assert shape["ratios"]["decode_b1_over_hf"] == pytest.approx(decode[0]["tokens_per_s"] / 7.35)
    text = bench.markdown({"device": {"name": "NVIDIA H200", "device": "cuda", "torch": "2.11", "triton": "3.6"},
                           "ceilings": ceilings, "shapes": {"9b": shape, "0.8b": {"shape": "0.8b", "error": "OOM"}}})
    assert "Peak device memory 20.00 GiB" in text and "device busy 4.600 ms/step" in text
    assert "Profile B=8 failed" in text and "## 0.8b: FAILED: OOM" in text
    assert "target prefill_4096_mfu >= 0.5: measured 0.61 -> met" in text


def test_an_in_process_run_leaves_the_plugin_environment_as_it_was(monkeypatch):
    """bench.main registers the Qwen3.5 plugin through NINFER_EXTRA_PLUGINS for its own run only."""
    from benchmarks import bench

    monkeypatch.delenv("NINFER_EXTRA_PLUGINS", raising=False)
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--batches", "0"]) == 2  # refused arguments
    assert "NINFER_EXTRA_PLUGINS" not in os.environ
    monkeypatch.setenv("NINFER_EXTRA_PLUGINS", "x")
    bench.main(["--shape", "tiny", "--device", "cpu", "--batches", "0"])
    assert os.environ["NINFER_EXTRA_PLUGINS"] == "x"
