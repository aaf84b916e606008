"""Every device suite of ``scripts/gpu`` (``benchmarks/gpu.py``) once on the CPU at a tiny shape: the benchmark it runs
ends well and prints its table's columns and writes its JSON keys; and ``bench --baseline``'s comparison on fake
results. No figure is compared with a threshold: a ticking clock (1 ms a reading) times what the Engine publishes."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import sys

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")
pytest.importorskip("transformers")

from benchmarks import gpu, harness  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture
def ticking_clock(monkeypatch):
    ticks = itertools.count(1)
    monkeypatch.setattr(harness, "clock", lambda: next(ticks) * 1e-3)  # itertools.count is atomic under the GIL


def _tiny(tmp_path):
    w = str(tmp_path / "work")
    return {
        "bench": ("bench", ["--shape", "tiny", "--device", "cpu", "--quick", "--batches", "1", "2", "--contexts", "8",
                            "--prefill", "16", "--steps", "3", "--prefill-chunk", "16", "--hf-prompt", "16",
                            "--hf-new-tokens", "2", "--hf-batches", "1", "--workdir", w]),
        "bench-nvfp4": ("bench", ["--shape", "tiny", "--device", "cpu", "--quick", "--batches", "1", "--contexts", "8",
                                  "--prefill", "16", "--steps", "3", "--prefill-chunk", "16", "--no-hf",
                                  "--quantize", "nvfp4", "--profile", str(tmp_path / "profiles"), "--workdir", w]),
        "numerics": ("model_check", ["--shape", "tiny", "--device", "cpu", "--tokens", "16"]),
        "numerics-nvfp4": ("model_check", ["--shape", "tiny", "--device", "cpu", "--tokens", "16", "--quantize",
                                           "nvfp4"]),
        "numerics-graphs": ("program_check", ["--shape", "tiny", "--device", "cpu", "--steps", "2", "--batch", "1", "2"]),
        "cache": ("context_cache", ["--shape", "tiny", "--device", "cpu", "--history", "40", "--answer", "2", "--new",
                                    "3", "--reps", "1", "--batches", "1", "--context", "24", "--steps", "3",
                                    "--decode-reps", "1", "--prefill-chunk", "32", "--grids", "none", "--workdir", w]),
        "speculative": ("speculative", ["--shape", "tiny", "--device", "cpu", "--steps", "2", "--tokens", "6",
                                        "--batch", "2", "--k", "2", "--context", "12"]),
        "moe": ("moe", ["--shape", "tiny", "--layers", "4", "--device", "cpu", "--context", "12", "--steps", "3",
                        "--prefill", "40", "--prefill-chunk", "16", "--budget-gib", "0.01", "--hf-new-tokens", "2",
                        "--workdir", w]),
        "moe-fp8": ("moe", ["--shape", "tiny", "--layers", "4", "--device", "cpu", "--batches", "1", "--context", "8",
                            "--steps", "2", "--prefill", "16", "--prefill-chunk", "16", "--no-host", "--no-hf",
                            "--quantize", "fp8", "--profile", str(tmp_path / "profiles"), "--workdir", w]),
        "moe-qwen4exp": ("moe", ["--shape", "qwen4exp-tiny", "--layers", "4", "--device", "cpu", "--batches", "1", "2",
                                 "--context", "8", "--steps", "2", "--prefill", "16", "--prefill-chunk", "16",
                                 "--budget-gib", "0.01", "--hf-new-tokens", "2", "--workdir", w]),
        "moe-full-depth": ("moe_full_depth", ["--shape", "tiny", "--device", "cpu", "--context", "8", "--steps", "2",
                                              "--engine"]),
        "vision": ("vision", ["--device", "cpu", "--vision", "tiny", "--text-shape", "tiny", "--out-hidden", "64",
                              "--images", "64x1", "--warmup", "1", "--repeats", "2", "--ttft-side", "64",
                              "--ttft-repeats", "2", "--workdir", w]),
        "start": ("start", ["--model", "default", "--device", "cpu", "--max-concurrency", "1", "--workdir", w]),
    }


# suite -> (a line of its table's header, the JSON's top-level keys it must have)
EXPECTED = {
    "bench": (["| B | context | ms/step | tokens/s | bytes floor ms | chain ms | ours/chain | HF tokens/s | ours/HF |",
               "| prompt | prefill s | tokens/s | model TFLOP/s | MFU % | HF tokens/s (B=1) | ours/HF |"],
              {"device", "ceilings", "shapes", "wall_s"}),
    "bench-nvfp4": (["| B | context | ms/step | tokens/s | bytes floor ms |"], {"device", "ceilings", "shapes", "wall_s"}),
    "numerics": (["| shape | tokens | path | logits rel err all | per position max / median | top-1 regret"],
                 {"shape", "tokens", "fast_bf16", "ok"}),
    "numerics-nvfp4": (["| tiny | 16 | fast_nvfp4 vs fp32 |", "| tiny | 16 | fast_nvfp4 vs fast bf16 |"],
                       {"fast_nvfp4", "fast_nvfp4_vs_bf16", "quantized_linears", "ok"}),
    "numerics-graphs": (["B=1: graph vs static tokens equal"], {"check", "ok", "results"}),
    "cache": (["| measurement | cache on | cache off | gain | detail |",
               "| checkpoint grid | grid saves | fresh TTFT ms |"], {"device", "shapes", "wall_s"}),
    "speculative": (["B  k   ms/unit  x plain", "B  k     tok/s  speedup accept len"], {"part1", "part2"}),
    "moe": (["| B | ms/step (4 L) | tok/s (4 L) | head ms | per-layer ms | full-depth ms | full-depth tok/s "
             "| floor ms (full) |"], {"all_device", "host_experts", "plan", "hf", "copy_tb_s", "targets"}),
    "moe-fp8": (["## all-device, fp8 weights (floor columns: bf16's)", "- fp8 over bf16, decode B=1: ",
                 "- B=1 profiled: device busy - ms/step, - launches/step; top: "],
                {"all_device", "quantized", "plan", "copy_tb_s", "targets"}),
    "moe-qwen4exp": (["# Qwen4Exp qwen4exp-tiny", "| B | missed experts/step (4 L / full) | host floor ms (4 L / full) |",
                      "ours / transformers at B=1, 4 layers: decode"],
                     {"all_device", "host_experts", "plan", "hf", "copy_tb_s", "host_read_gb_s", "targets"}),
    "moe-full-depth": (["| run | B | ms/step | tok/s | floor ms | of floor | engine ms/step |"],
                       {"runs", "summary", "copy_tb_s", "distinct_experts", "targets"}),
    "vision": (["| images | tokens | variant | ms | TFLOP/s | rel error vs fp32 |",
                "| images | patches | variant | ms / call | images/s |", "| engine | TTFT ms (median) |"],
               {"attention", "encoder", "ttft", "wall_s"}),
    "start": (["| Triton cache | start s |"], {"model", "device", "runs"}),
}


@pytest.mark.usefixtures("ticking_clock")
@pytest.mark.parametrize("suite", sorted(EXPECTED))
def test_suite_runs_tiny_on_cpu(suite, tmp_path, monkeypatch):
    name, argv = _tiny(tmp_path)[suite]
    mod = __import__(f"benchmarks.{name}", fromlist=["main"])
    if suite == "start":  # one start is enough to check the table (each is a server process)
        monkeypatch.setattr(mod, "RUNS", ("cold",))
    out = tmp_path / f"{suite}.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = mod.main([*argv, "--json", str(out)])
    text = stdout.getvalue()
    assert code == 0, text
    headers, keys = EXPECTED[suite]
    for header in headers:
        assert header in text, text
    assert keys <= set(json.loads(out.read_text())), sorted(json.loads(out.read_text()))
    if suite == "bench-nvfp4":  # the bytes floor is the quantized artifact's, under the bf16 model's
        (shape,) = json.loads(out.read_text())["shapes"].values()
        assert shape["quantize"] == "nvfp4" and 0 < shape["decode_weight_bytes"] < 2 * shape["layer_matmul_params"]
    if suite in ("moe", "moe-qwen4exp"):  # Qwen4Exp's PLE is timed apart, once per forward; Qwen3.5 has none
        decode = json.loads(out.read_text())["all_device"]["decode"]
        assert all((d["once_ms"] > 0) == (suite == "moe-qwen4exp") for d in decode), decode
    profiles = {"moe-fp8": ["profile-tiny-all_device-b1.txt", "profile-tiny-quantized-b1.txt"],
                "bench-nvfp4": ["profile-tiny-b1.txt"]}
    if suite in profiles:  # the profile tables, one per run and B
        assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == profiles[suite]
    work = tmp_path / "work"
    assert not work.exists() or not any(work.iterdir())  # checkpoints and artifacts removed


def test_help_lists_every_suite(capsys):
    with pytest.raises(SystemExit) as exit:
        gpu.main(["--help"])
    assert exit.value.code == 0
    listed = capsys.readouterr().out
    for suite in ("tests", "bench", "numerics", "cache", "speculative", "moe", "vision", "start", "tune", "train"):
        assert f"    {suite}" in listed, listed


def test_the_script_lists_the_suites_without_carried_wheels(tmp_path):
    """scripts/gpu as the device runs it (python3 first on PATH), with no .whl folder to install."""
    import os
    import shutil
    import subprocess

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    if not shutil.which("bash") or any((gpu.ROOT / ".whl").glob("*.whl")):
        pytest.skip("no bash, or carried wheels the script would install")
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(gpu.ROOT / "scripts" / "gpu"), "--help"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "    bench" in run.stdout and "    start" in run.stdout


@pytest.mark.parametrize("argv, expected", [
    (["tests", "-k", "linear"], "-m pytest -q -p no:cacheprovider -m gpu --timeout=300 --durations=15 --ignore=tests/clients -k linear"),
    (["bench", "--shapes", "9b", "--batches", "1,8", "--no-hf"],
     "-m benchmarks.bench --shape 9b --quick --batches 1 8 --json"),
    (["numerics", "--shapes", "9b"], "-m benchmarks.program_check --shape 9b --batch 1 8"),
    (["numerics", "--shapes", "9b", "--quantize", "fp8"], "-m benchmarks.model_check --shape 9b --tokens 512 --quantize fp8"),
    (["cache"], "-m benchmarks.context_cache --shape 9b"),
    (["speculative"], "-m benchmarks.speculative --shape 9b"),
    (["moe", "--full-depth"], "-m benchmarks.moe_full_depth --engine"),
    (["moe", "--shape", "qwen4exp", "--no-hf"], "-m benchmarks.moe --shape qwen4exp --workdir /tmp/moe"),
    (["moe", "--quantize", "fp8", "--no-hf"], "-m benchmarks.moe --shape 35b-a3b --quantize fp8 --workdir /tmp/moe"),
    (["moe", "--shape", "qwen4exp", "--profile"], "-m benchmarks.moe --shape qwen4exp --profile "),
    (["start", "--model", "qwen4exp-published", "--runs", "cold"],
     "-m benchmarks.start --model qwen4exp-published --runs cold --timeout 450"),
    (["vision", "--no-hf"], "-m benchmarks.vision --workdir /tmp/vision"),
    (["start"], "-m benchmarks.start --model 9b"),
    (["tune", "--family", "linear"], "-m ninfer.ops.triton.tune --family linear"),
    (["train", "--dropout", "0.1"], "tools/train_tiny/run_gpu.sh"),
])
def test_each_suite_says_what_it_runs(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu.main([argv[0], "--dry-run", *argv[1:]]) == 0
    assert expected in capsys.readouterr().out


def test_options_of_one_suite_are_refused_by_another(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["cache", "--full-depth"])


def _bench_json(scale: float) -> dict:
    decode = [{"batch": b, "context": 1024, "tokens_per_s": scale * 100 * b} for b in (1, 8)]
    prefill = [{"tokens": 4096, "tokens_per_s": scale * 20000}]
    return {"shapes": {s: {"engine": {"decode": decode, "prefill": prefill}} for s in ("0.8b", "9b")}}


def test_baseline_runs_before_after_before_and_compares(tmp_path, monkeypatch, capsys):
    base = tmp_path / "old"
    (base / "benchmarks").mkdir(parents=True)  # an older tree: no benchmarks/gpu.py
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    calls = []

    def fake_run(args, name, cmd, *, cwd=gpu.ROOT, env=None, timeout=None):
        calls.append((name, cmd, cwd, env["PYTHONPATH"].split(":")[0]))
        path = cmd[cmd.index("--json") + 1]
        scale = {"bench_before0": 1.0, "bench_after1": 1.01, "bench_before2": 0.98}[name]
        with open(path, "w") as f:
            json.dump(_bench_json(scale), f)
        return 0

    monkeypatch.setattr(gpu, "run", fake_run)
    assert gpu.main(["bench", "--baseline", str(base), "--no-hf", "--batches", "1,8"]) == 0
    assert [c[0] for c in calls] == ["bench_before0", "bench_after1", "bench_before2"]
    old, new = calls[0], calls[1]
    assert old[1][:3] == [sys.executable, "-m", "benchmarks.bench"] and "--quick" in old[1]  # its own harness
    assert old[2] == base and old[3] == str(base / "ninfer-core" / "src")  # its own packages first
    assert new[1][:4] == [sys.executable, "-m", "benchmarks.gpu", "bench"] and new[2] == gpu.ROOT
    table = capsys.readouterr().out
    assert "| shape | batch | phase | before tok/s | after tok/s | after/before |" in table
    assert "| 9b | 8 | decode 1024 | 792.0 | 808.0 | 1.020 |" in table  # the mean of the two before runs
    assert "| 0.8b | 1 | prefill 4096 | 19800.0 | 20200.0 | 1.020 |" in table
    rows = json.loads((tmp_path / "out" / "bench_compare.json").read_text())
    assert len(rows) == 6 and {r["phase"] for r in rows} == {"decode 1024", "prefill 4096"}


def test_compare_keeps_only_what_both_sides_measured():
    before = _bench_json(1.0)
    after = _bench_json(2.0)
    del after["shapes"]["9b"]
    rows = gpu.compare([before], [after])
    assert {r["shape"] for r in rows} == {"0.8b"} and all(r["after_over_before"] == 2.0 for r in rows)


def test_quantize_runs_bf16_then_the_format_and_compares(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    calls = []

    def fake_run(args, name, cmd, *, cwd=gpu.ROOT, env=None, timeout=None):
        calls.append((name, cmd))
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump(_bench_json({"bench_bf16": 1.0, "bench_fp8": 1.6}[name]), f)
        return 0

    monkeypatch.setattr(gpu, "run", fake_run)
    assert gpu.main(["bench", "--quantize", "fp8", "--no-hf", "--shapes", "9b", "--batches", "1,8"]) == 0
    assert [c[0] for c in calls] == ["bench_bf16", "bench_fp8"]
    assert "--quantize" not in calls[0][1] and calls[1][1][-2:] == ["--quantize", "fp8"]
    out = capsys.readouterr().out
    assert "| shape | batch | phase | bf16 tok/s | fp8 tok/s | fp8/bf16 |" in out and "| 1.600 |" in out
    with pytest.raises(SystemExit):
        gpu.main(["bench", "--quantize", "fp8", "--baseline", str(tmp_path)])


_SPAWNER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
print("spawned", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split()[2] != "Z"


def _wait_gone(pid: int, seconds: float = 20.0) -> bool:
    import time

    end = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.skipif(sys.platform != "linux", reason="process groups as Linux has them")
def test_a_step_past_its_timeout_is_stopped_with_its_children(tmp_path, monkeypatch):
    """A timed-out step stops as a whole: a process it started (as pytest starts its workers) does not run on into
    the next step."""
    import time
    from types import SimpleNamespace

    monkeypatch.setenv("OUT", str(tmp_path))
    pidfile = tmp_path / "child.pid"
    t = time.monotonic()
    rc = gpu.run(SimpleNamespace(dry_run=False), "sleeper", [sys.executable, "-c", _SPAWNER, str(pidfile)],
                 timeout=2)
    assert rc == 124 and time.monotonic() - t < 30
    assert _wait_gone(int(pidfile.read_text()))
    assert "spawned" in (tmp_path / "sleeper.log").read_text()


@pytest.mark.skipif(sys.platform != "linux", reason="process groups as Linux has them")
def test_terminating_the_suite_stops_its_running_step(tmp_path):
    """``timeout N scripts/gpu SUITE`` sends SIGTERM to the suite's process: the step under way stops with it."""
    import os
    import signal
    import subprocess
    import time

    pidfile = tmp_path / "child.pid"
    script = ("import sys; from types import SimpleNamespace; from benchmarks import gpu; import signal; "
              "signal.signal(signal.SIGTERM, gpu._terminated); "
              f"gpu.run(SimpleNamespace(dry_run=False), 'sleeper', [sys.executable, '-c', {_SPAWNER!r}, {str(pidfile)!r}])")
    suite = subprocess.Popen([sys.executable, "-c", script], cwd=gpu.ROOT, env={**os.environ, "OUT": str(tmp_path)})
    try:
        end = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < end:
            time.sleep(0.1)
        child = int(pidfile.read_text())
        suite.send_signal(signal.SIGTERM)
        assert suite.wait(30) == 128 + signal.SIGTERM
        assert _wait_gone(child)
    finally:
        suite.kill()
