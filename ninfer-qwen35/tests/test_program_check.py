"""The GPU Program check (benchmarks/program_check.py) runs on CPU as a smoke test (eager vs eager)."""

import json

import pytest

from benchmarks.program_check import main


def test_program_check_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "2", "--context", "5",
                 "--batch", "1", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["ok"] and not summary["graphs"] and [r["B"] for r in summary["results"]] == [1, 2]
    assert all(r["tokens_equal"] for r in summary["results"])
    assert "B=2: graph vs static tokens equal" in capsys.readouterr().out
    # --same-as: a second run must reproduce the first one's tokens and logprobs bit for bit
    again = tmp_path / "again.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "2", "--context", "5",
                 "--batch", "1", "2", "--json", str(again), "--same-as", str(out)]) == 0
    assert all(r["same_as_reference"] for r in json.loads(again.read_text())["results"])
    tampered = json.loads(out.read_text())
    tampered["results"][0]["tokens"][0][-1] += 1
    (tmp_path / "tampered.json").write_text(json.dumps(tampered))
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "2", "--context", "5",
                 "--batch", "1", "2", "--same-as", str(tmp_path / "tampered.json")]) == 1


@pytest.mark.gpu
def test_program_graphs_equal_static_decode_on_cuda(tmp_path):
    out = tmp_path / "check.json"
    # a published shape: the Triton kernels were validated at real head sizes, not the tiny test ones
    assert main(["--shape", "0.8b", "--device", "cuda", "--steps", "4", "--batch", "1", "2", "8",
                 "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["graphs"], summary["graph_error"]
