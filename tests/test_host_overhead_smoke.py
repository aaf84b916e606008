"""benchmarks/host_overhead.py runs end to end on CPU (tiny shape, a few steps)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ninfer_qwen35")

from benchmarks.host_overhead import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.mark.parametrize("options", [[], ["--no-forward"]])
def test_host_overhead_benchmark_smoke(tmp_path, capsys, options):
    out = tmp_path / "rows.json"
    assert main(["--batch", "1", "2", "--steps", "3", "--context", "6", "--json", str(out), *options]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        # Timings of this machine: only their presence and sign are certain (each is a window, or a window
        # less the windows nested in it, on a monotonic clock).
        assert all(r[k] >= 0 for k in ("host_us", "load_us", "model_us", "engine_host_us", "engine_publish_us"))
        assert r["steps"] == 3  # three steady B-row cycles were found (every request starts together)
        assert r["load_ops"] <= 3  # the packed inputs go up in one copy (plus a table segment at most)
    assert "host" in capsys.readouterr().out


def test_host_overhead_rejects_bad_batch():
    assert main(["--batch", "9"]) == 2
