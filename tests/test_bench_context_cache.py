"""benchmarks/context_cache.py end to end on CPU with the tiny shape: every engine of the GPU run is built,
measured and closed, the JSON has every figure, the hits hit, turn 2 is identical with the cache on and
off, and nothing leaks.

Timings are the harness's ticking clock (each reading 1 ms after the one before), so no assertion here
depends on how fast this machine is; what is checked is the engine's behaviour the figures describe."""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")

from benchmarks import bench, context_cache  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

HISTORY, ANSWER, NEW = 96, 4, 5


@pytest.fixture
def ticking_clock(monkeypatch):
    ticks = itertools.count(1)
    monkeypatch.setattr(bench, "clock", lambda: next(ticks) * 1e-3)  # itertools.count is atomic under the GIL


@pytest.mark.usefixtures("ticking_clock")
def test_context_cache_benchmark_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "cache.json"
    work = tmp_path / "work"
    argv = ["--shape", "tiny", "--device", "cpu", "--history", str(HISTORY), "--answer", str(ANSWER), "--new", str(NEW),
            "--reps", "2", "--batches", "1", "2", "--context", "24", "--steps", "3", "--decode-reps", "1",
            "--prefill-chunk", "32", "--grids", "16", "32", "none", "--workdir", str(work), "--json", str(out)]
    assert context_cache.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["device"]["device"] == "cpu" and res["wall_s"] > 0
    r = res["shapes"]["tiny"]
    assert set(r["engines"]) == {"on", "off", "grid-16", "grid-32", "grid-none", "host"}
    for name, e in r["engines"].items():
        assert e["leak_free"] and e["checks"], name  # idle after every run, all free after every clear
        assert e["metrics"]["preemptions"] == 0
        assert e["start_s"] > 0 and e["warmup_s"] > 0
    assert all(r["leak_free"].values())
    for name in ("on", "grid-16", "grid-32", "grid-none"):  # the pool was sized so nothing was reclaimed
        assert sum(r["engines"][name]["metrics"]["cache_evictions"].values()) == 0, name
    assert r["engines"]["off"]["metrics"]["prefix_cache_queries"] == 0

    # 1. turn 2 restores turn 1's continuation (all but its last token) and answers as a full prefill does
    t2 = r["turn2"]
    assert t2["cached_tokens"] == [HISTORY + ANSWER - 1] * 2 and t2["prompt_tokens"] == HISTORY + ANSWER + NEW
    assert t2["outputs_equal"] == [True, True] and t2["turn1_equal"] == [True, True]
    assert t2["on_ttft_s"] > 0 and t2["off_ttft_s"] > 0 and t2["speedup"] > 0
    # 2. the identical prompt: a miss, then a hit on its prompt-end checkpoint
    rep = r["repeat"]
    assert rep["first_cached_tokens"] == [0, 0] and rep["cached_tokens"] == [HISTORY - 1] * 2
    # 3. the miss cost; 4. decode on and off at each B
    assert r["miss"]["on_ttft_s"] > 0 and r["miss"]["off_ttft_s"] > 0
    assert [(d["batch"], d["context"]) for d in r["decode"]] == [(1, 24), (2, 24)]
    assert all(d["on_tokens_per_s"] > 0 and d["off_tokens_per_s"] > 0 for d in r["decode"])
    # 5. the grid: its points, and what a prompt sharing 70 % of the tokens restores from them
    grid = {g["grid"]: g for g in r["grid"]}
    assert list(grid) == [16, 32, "none"]
    assert [grid[k]["grid_saves"] for k in grid] == [5, 2, 0]
    share = int(HISTORY * 0.7)
    assert [grid[k]["share_cached_tokens"] for k in grid] == [share // 16 * 16, share // 32 * 32, 0]
    assert grid["none"]["over_end_only_s"] == 0 and grid[16]["per_save_s"] is not None
    cal = r["calibration"]
    assert cal["image_bytes"] > 0 and cal["replica_bytes"] > cal["image_bytes"]
    assert cal["recompute_s_per_token"] > 0 and cal["transfer_s_per_byte"] > 0
    assert set(cal["cost_model_defaults"]) == {"recompute_s_per_token", "transfer_s_per_byte"}
    # 6. turn 2 restored from a host replica, with the only device slot taken by another prompt
    host = r["host_restore"]
    assert host["restored_from"] == ["host", "host"] and all(n > 0 for n in host["host_evictions"])
    assert all(0 < c <= HISTORY + ANSWER - 1 for c in host["cached_tokens"])
    assert host["outputs_equal"] == [True, True]

    assert {"turn2_speedup", "decode_b1_cost_pct", "decode_b2_cost_pct"} <= set(r["targets"])
    assert len(r["table"]) == 3 + 2 + 1
    text = capsys.readouterr().out
    assert "| measurement | cache on | cache off |" in text and "| checkpoint grid |" in text
    assert "CostModel: prefill" in text and "LEAK" not in text and res["markdown"] in text
    assert list(work.iterdir()) == []  # checkpoint and artifact removed


@pytest.mark.usefixtures("ticking_clock")
def test_artifact_is_shared_with_bench_and_reused(tmp_path, monkeypatch):
    """--artifact-cache keeps the artifact under the name bench.py gives it; a second run converts nothing."""
    cache = tmp_path / "cache"
    args = context_cache.parse_args(["--artifact-cache", str(cache)])
    first: dict = {}
    path = context_cache.artifact("tiny", args, "cpu", tmp_path, first)
    assert path == cache / "tiny.ninfer" and path.exists() and first["convert_s"] > 0
    monkeypatch.setattr(context_cache, "write_source", lambda *a, **k: pytest.fail("the cached artifact was rebuilt"))
    second: dict = {}
    assert context_cache.artifact("tiny", args, "cpu", tmp_path, second) == path
    assert second == {"artifact_reused": str(path)}


@pytest.mark.parametrize("argv", [["--batches", "9"], ["--steps", "2"], ["--share", "1.5"], ["--history", "1"],
                                  ["--reps", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    assert context_cache.main(["--shape", "tiny", "--device", "cpu", *argv]) == 2
    assert "context_cache:" in capsys.readouterr().err


def test_a_bad_grid_is_named(capsys):
    with pytest.raises(SystemExit) as exc:
        context_cache.main(["--grids", "0"])
    assert exc.value.code == 2 and "a grid must be >= 1 token" in capsys.readouterr().err


@pytest.mark.usefixtures("ticking_clock")
def test_a_failing_engine_keeps_what_was_measured(tmp_path, monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("host restore exploded")

    monkeypatch.setattr(context_cache, "measure_host", broken)
    out, work = tmp_path / "cache.json", tmp_path / "work"
    argv = ["--shape", "tiny", "--device", "cpu", "--history", "40", "--answer", "2", "--new", "3", "--reps", "1",
            "--batches", "1", "--context", "8", "--steps", "3", "--decode-reps", "1", "--prefill-chunk", "16",
            "--grids", "none", "--workdir", str(work), "--json", str(out)]
    assert context_cache.main(argv) == 1
    r = json.loads(out.read_text())["shapes"]["tiny"]
    assert r["error"] == "RuntimeError: host restore exploded"
    assert set(r["engines"]) == {"on", "off", "grid-none"} and r["engines"]["on"]["leak_free"]
    assert list(work.iterdir()) == []
    assert "FAILED: tiny" in capsys.readouterr().out
