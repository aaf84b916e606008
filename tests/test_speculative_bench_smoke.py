"""benchmarks/speculative.py end to end on CPU (tiny shape, two units; the embedded model, a few tokens): both
parts run, every speculative unit of part 1 produced its tokens, part 2's greedy outputs reached the JSON with an
acceptance length per speculative run. Timings are reported, never asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ninfer_qwen35")

from benchmarks import speculative  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_both_parts_run_and_write_their_rows(tmp_path):
    out = tmp_path / "spec.json"
    assert speculative.main(["--shape", "tiny", "--device", "cpu", "--steps", "2", "--tokens", "6", "--batch", "2",
                             "--k", "2", "--context", "12", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["batch"], r["k"]) for r in data["part1"]] == [(2, 0), (2, 2)]
    assert all(1.0 <= r["tokens_per_unit"] <= r["k"] + 1 for r in data["part1"])
    assert all(set(r["implied_speedup"]) == set(speculative.PUBLISHED) for r in data["part1"] if r["k"])
    part2 = {r["k"]: r for r in data["part2"]}
    assert set(part2) == {0, 2} and part2[0]["acceptance_length"] is None
    assert all(1.0 <= part2[k]["acceptance_length"] <= k + 1 for k in (2,))


def test_bad_arguments_are_refused():
    assert speculative.main(["--shape", "tiny", "--device", "cpu", "--k", "4"]) == 2
    assert speculative.main(["--shape", "tiny", "--device", "cpu", "--batch", "9"]) == 2


def test_implied_speedup_is_tokens_per_unit_over_the_unit_cost():
    assert speculative.implied_speedup(1.0, 2, (0.5, 0.5, 0.5)) == pytest.approx(1.75)
    assert speculative.implied_speedup(2.0, 1, (1.0,)) == pytest.approx(1.0)
