"""benchmarks/vision.py end to end on the CPU with a tiny tower (depth 2, 4 heads) and the tiny text shape: the
attention variants and the whole encoder (ours, the torch reference, transformers on the same weights) with their
errors against fp32, the random VL checkpoint through the real converter, the TTFT of ours (or the reason it was
skipped) and of transformers, the JSON and the table. Timings are reported, never compared with a threshold."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")
pytest.importorskip("transformers")

from benchmarks import vision  # noqa: E402
from benchmarks import vision_weights as vw  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
IMAGES = ["64x1", "64x2", "128x1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    out, work = root / "vision.json", root / "work"
    argv = ["--device", "cpu", "--vision", "tiny", "--text-shape", "tiny", "--out-hidden", "64", "--images", *IMAGES,
            "--warmup", "1", "--repeats", "2", "--ttft-side", "64", "--ttft-repeats", "2", "--workdir", str(work),
            "--json", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = vision.main(argv)
    return {"code": code, "json": json.loads(out.read_text()), "table": stdout.getvalue(), "work": work}


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_the_run_succeeds_and_leaves_only_the_json(run):
    assert run["code"] == 0, run["table"]
    assert not any(run["work"].iterdir())  # checkpoint and artifact removed
    res = run["json"]
    assert res["parts"] == list(vision.PARTS) and res["images"] == IMAGES and _positive(res["wall_s"])
    assert res["vision"]["depth"] == 2 and res["vision"]["out_hidden_size"] == 64
    for title in ("## attention", "## encoder", "## TTFT"):
        assert title in run["table"]


def test_attention_variants_agree_with_fp32(run):
    rows = run["json"]["attention"]
    assert {(r["images"], r["variant"]) for r in rows} == {(i, v) for i in IMAGES
                                                           for v in ("sdpa per length", "sdpa per image")}
    for r in rows:
        assert r["rel_error"] < 1e-5 and _positive(r["ms"]) and r["tokens"] == {"64": 16, "128": 64}[
            r["images"].split("x")[0]] * int(r["images"].split("x")[1])


def test_encoder_variants_agree_with_fp32(run):
    rows = run["json"]["encoder"]
    variants = {r["variant"] for r in rows}
    assert variants == {"ours", "torch reference float32", "transformers (sdpa)"}, variants
    for r in rows:
        assert "error" not in r, r
        assert r["rel_error"] < 1e-5 and _positive(r["images_per_s"]) and _positive(r["tflop_s"])
        assert r["patches"] == r["batch"] * (r["side"] // 16) ** 2
    assert set(run["json"]["upload_ms"]) == set(IMAGES)


def test_ttft_reports_ours_or_why_not_and_transformers(run):
    t = run["json"]["ttft"]
    assert t["checkpoint_bytes"] == vw.checkpoint_bytes(vw.vl_config("tiny", vw.TINY_VISION, _token_ids()))
    assert _positive(t["convert_s"]) and _positive(t["image_bytes"])
    ours = t["ours"]
    if "skipped" in ours:  # this tree's Engine does not run the encoder yet
        assert "vision" in ours["skipped"] and "ninfer | skipped: " in run["table"]
    else:
        assert _positive(ours["ttft_ms"]) and ours["prompt_tokens"] > 4 and len(ours["runs"]) == 3
    hf = t["hf"]
    assert _positive(hf["ttft_ms"]) and _positive(hf["prepare_ms"]) and len(hf["runs"]) == 3
    assert hf["prompt_tokens"] > 4  # the 64 x 64 image's 2 x 2 merged tokens, the question and the turn markers


def _token_ids() -> dict[str, int]:
    from ninfer_qwen35.testing.checkpoints import make_tokenizer_json

    return make_tokenizer_json()[1]


def test_the_checkpoint_config_reads_in_ninfer_and_transformers():
    import transformers

    from ninfer_qwen35.config import parse_config

    cfg = vw.vl_config("9b", vw.PUBLISHED_VISION, _token_ids())
    config = parse_config(cfg)
    assert config.hidden_size == 4096 and config.vision["out_hidden_size"] == 4096 and config.vision["depth"] == 27
    assert config.image_token_id == _token_ids()["<|image_pad|>"]
    hf = transformers.Qwen3_5Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    assert hf.vision_config.out_hidden_size == 4096 and hf.text_config.num_hidden_layers == 32


@pytest.mark.parametrize("argv, message", [
    (["--images", "100x1"], "SIDE a multiple of 32"),
    (["--images", "64x0"], "B >= 1"),
    (["--repeats", "0"], "must be >= 1"),
    (["--ttft-side", "90"], "SIDE a multiple of 32"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    assert vision.main(["--device", "cpu", "--parts", "attention", *argv]) == 2
    assert message in capsys.readouterr().err
