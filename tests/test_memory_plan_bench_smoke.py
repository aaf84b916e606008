"""benchmarks/memory_plan.py end to end on CPU with the tiny shape: the sparse artifact is a valid .ninfer (its
checksums verify over the zero data), a budget too small is refused by the plan and by the Engine start alike, a
budget that fits starts an Engine whose MemorySummary and workload reach the JSON. Timings are reported, never
asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")

from benchmarks import memory_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_sparse_artifact_is_the_converters_header_over_zeros(tmp_path):
    from ninfer.artifact import open_artifact

    path = memory_plan.write_sparse_artifact("tiny", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.ninfer"]  # the source is gone
    with open_artifact(path) as art:
        art.verify()  # every checksum matches the bytes read (zeros for the weights, the real resources)
        features = {o.feature for o in art.header.objects}
        assert {"text", "mtp"} <= features
        assert art.frontend is not None


def test_zero_crcs_match_zlib():
    import zlib

    sizes = [0, 1, 5000, 16 * memory_plan.MIB + 3, 5000]
    crcs = memory_plan.zero_crcs(sizes)
    assert crcs == {n: zlib.crc32(bytes(n)) for n in sizes}


def test_refused_and_fitting_budgets_reach_the_json(tmp_path):
    out = tmp_path / "plan.json"
    assert memory_plan.main(["--shapes", "tiny", "--device", "cpu", "--budgets-mib", "0.01", "64",
                             "--max-concurrency", "2", "--speculative", "none", "mtp", "--prompt-tokens", "12",
                             "--max-tokens", "3", "--workdir", str(tmp_path / "work"), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["speculative"], r["budget_bytes"]): r for r in data["rows"]}
    small, big = int(0.01 * memory_plan.MIB), 64 * memory_plan.MIB
    assert set(rows) == {(s, b) for s in ("none", "mtp") for b in (small, big)}
    for spec in ("none", "mtp"):
        refused = rows[spec, small]
        assert not refused["plan"]["fits"] and "does not fit" in refused["plan"]["error"]
        assert refused["refusal"]["refused"] and refused["refusal"]["error_type"] == "PlanError"
        assert "engine" not in refused
        fits = rows[spec, big]
        assert fits["plan"]["fits"] and fits["plan"]["kv_tokens"] > 0
        eng = fits["engine"]
        assert eng["memory"]["budget_bytes"] == big and eng["kv_tokens"] == eng["memory"]["kv_pages"] * \
            eng["memory"]["page_size"]
        assert eng["workload_ok"], eng["workload_errors"]
        assert eng["workload_requests"] == 2 and eng["workload_generated"] == 2 * 3
        assert eng["peak_within_budget"] is None  # the CPU has no allocator to read
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())  # artifacts removed
