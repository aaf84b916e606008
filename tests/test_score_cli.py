"""``ninfer score`` end to end on a real tiny artifact."""

from __future__ import annotations

import json

import pytest

from ninfer.cli import main

pytest.importorskip("transformers")
from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?"


@pytest.fixture(scope="module")
def artifact_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    return str(convert_tiny(make_tiny_checkpoint(root / "ckpt"), root / "tiny.ninfer"))


def run(capsys, *argv):
    rc = main(["score", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_score_json_and_windows(artifact_path, capsys, tmp_path):
    rc, out, _ = run(capsys, artifact_path, TEXT, "--json", "--dtype", "float32")
    assert rc == 0
    full = json.loads(out)
    assert full["windows"] == 1 and full["scored"] == full["tokens"] - 1
    assert full["token_logprobs"][0] is None and len(full["token_logprobs"]) == full["tokens"]
    assert full["total_nll"] == pytest.approx(-sum(full["token_logprobs"][1:]))
    # the same text from a file, with short strided windows: more windows, every token still scored once
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    rc, out, _ = run(capsys, artifact_path, "--file", str(path), "--json", "--dtype", "float32", "--window", "8",
                     "--stride", "4")
    strided = json.loads(out)
    assert rc == 0 and strided["windows"] > 1 and strided["scored"] == full["scored"]
    assert strided["token_ids"] == full["token_ids"]
    # the first window is identical to the full forward's prefix
    assert strided["token_logprobs"][1:8] == pytest.approx(full["token_logprobs"][1:8], abs=1e-4)


def test_score_human_output_and_errors(artifact_path, capsys, tmp_path):
    rc, out, _ = run(capsys, artifact_path, TEXT, "--tokens")
    assert rc == 0 and "perplexity" in out and "total NLL" in out
    rc, _, err = run(capsys, str(tmp_path / "missing.ninfer"), TEXT)
    assert rc == 2 and "model file not found" in err
    rc, _, err = run(capsys, artifact_path, "x", "--window", "8", "--stride", "8")
    assert rc == 2 and "stride must be" in err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa")
    rc, _, err = run(capsys, artifact_path, "--file", str(bad))
    assert rc == 2 and "not UTF-8" in err
