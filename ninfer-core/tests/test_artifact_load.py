"""Tiny real Qwen3.5 checkpoints (transformers save_pretrained + MTP) convert, inspect and load bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")
pytest.importorskip("ninfer_qwen35")

from safetensors.torch import load_file  # noqa: E402

from ninfer.artifact import ArtifactError, load_weights, open_artifact, plan_load  # noqa: E402
from ninfer.cli import main as ninfer_main  # noqa: E402
from ninfer_qwen35.source_mapping import canonical_name  # noqa: E402
from ninfer_qwen35.testing.checkpoints import SPECIAL_TOKENS, convert_tiny, make_tiny_checkpoint  # noqa: E402


def _source_tensors(ckpt: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """logical name -> (feature, tensor) straight from the checkpoint's safetensors files."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            mapped = canonical_name(name)
            if mapped is not None:
                out[mapped[1]] = (mapped[0], t)
    return out


@pytest.fixture(scope="module", params=["text", "vl"])
def converted(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"ckpt_{request.param}")
    ckpt = make_tiny_checkpoint(d / "src", layout=request.param, tie_word_embeddings=request.param == "vl")
    art = convert_tiny(ckpt, d / "tiny.ninfer")
    return request.param, ckpt, art


def test_layouts_are_what_transformers_writes(converted):
    layout, ckpt, _ = converted
    cfg = json.loads((ckpt / "config.json").read_text())
    names = set()
    for f in ckpt.glob("*.safetensors"):
        names |= set(load_file(str(f)))
    if layout == "vl":
        assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
        assert (ckpt / "model.safetensors.index.json").exists() and len(list(ckpt.glob("*.safetensors"))) >= 2
        assert any(n.startswith("model.language_model.layers.") for n in names)
        assert any(n.startswith("model.visual.") for n in names)
        assert "lm_head.weight" not in names  # tied
    else:
        assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]
        assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names and "lm_head.weight" in names
    assert "mtp.fc.weight" in names


def test_every_logical_parameter_is_bit_exact(converted):
    layout, ckpt, path = converted
    source = _source_tensors(ckpt)
    features = ("text", "vision", "mtp") if layout == "vl" else ("text", "mtp")
    with open_artifact(path) as art:
        assert set(art.features) == set(features)
        weights, report = load_weights(art, features=features, verify=True)
    assert set(weights) == set(source)
    for name, (_, t) in source.items():
        w = weights[name]
        assert w.dtype == t.dtype and w.shape == t.shape, name
        assert torch.equal(w.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name
    assert weights["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert report.verified and report.bindings_bound == len(source)


def test_fused_parents_are_one_object_read_once(converted):
    _, _, path = converted
    with open_artifact(path) as art:
        weights, report = load_weights(art, features=("text",))
    a = "model.layers.0.linear_attn."
    names = [a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight", a + "in_proj_a.weight"]
    fused = weights.fused(names)
    assert fused is not None and fused.shape[0] == sum(weights[n].shape[0] for n in names)
    assert weights.params[names[1]].parent == a + "in_proj_qkvzba"
    q = "model.layers.3.self_attn."
    assert weights.fused([q + "q_proj.weight", q + "k_proj.weight", q + "v_proj.weight"]) is not None
    assert weights.fused(["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]) is not None
    assert report.objects_loaded == len(weights.parents)
    assert weights.resident_bytes() == report.total_bytes_uploaded


def test_text_only_reads_no_vision_or_mtp_bytes(converted):
    layout, _, path = converted
    with open_artifact(path) as art:
        text_bytes = sum(o.nbytes for o in art.header.objects if o.feature == "text")
        weights, report = load_weights(art, features=("text",))
        assert dict(art.bytes_read) == {"text": text_bytes}
        assert report.bytes_read == {"text": text_bytes}
        assert not any(n.startswith(("mtp.", "visual.")) for n in weights)
    with open_artifact(path) as art:
        weights, report = load_weights(art, features=("text", "mtp"))
        mtp_bytes = sum(o.nbytes for o in art.header.objects if o.feature == "mtp")
        assert dict(art.bytes_read) == {"text": text_bytes, "mtp": mtp_bytes}  # embedding/head shared, read once
        plan = plan_load(art, ("text", "mtp"))
        sites = {u.site: u.binding for u in plan.uses}
        assert sites["mtp.embed_tokens"] == "model.embed_tokens.weight"
        head = "model.embed_tokens.weight" if layout == "vl" else "lm_head.weight"
        assert sites["mtp.lm_head"] == head
        if layout == "vl":  # tied: the head is a second Use of the embedding, not a second copy
            assert sites["lm_head"] == "model.embed_tokens.weight" and "lm_head.weight" not in weights
        assert len(plan.objects) == len({o.id for o in plan.objects})


def test_frontend_resources(converted):
    layout, ckpt, path = converted
    with open_artifact(path) as art:
        fe = art.frontend
        assert fe.tokenizer_json == (ckpt / "tokenizer.json").read_text()
        assert set(fe.special_tokens) == set(SPECIAL_TOKENS)
        assert fe.eos_token_ids == (fe.special_tokens["<|im_end|>"], fe.special_tokens["<|endoftext|>"])
        assert fe.chat_template and "<|im_start|>" in fe.chat_template
        assert fe.generation_config["top_k"] == 20 and fe.embedding_vocab == 512
        assert (fe.media is not None) == (layout == "vl")
        assert art.metadata.name == ckpt.name  # the checkpoint folder's name when convert is given none
        assert art.metadata.source_digest.startswith("blake2b:")


def test_frontend_has_the_real_qwen35_format(converted):
    """Same added tokens, order and special / non-special split as the real Qwen3.5 tokenizer, and the project's
    Qwen3.5 chat template, so thinking and tool-call markers reach the output as they do with a real model."""
    from ninfer.models.common.qwen import QwenFrontend, builtin_template
    from ninfer_qwen35.testing.qwen_vocab import qwen35_tokenizer_json

    def added(tokenizer_json: str) -> list[dict]:
        tokens = json.loads(tokenizer_json)["added_tokens"]
        first = tokens[0]["id"]
        assert [t["id"] for t in tokens] == list(range(first, first + len(tokens)))  # contiguous, in order
        return [{k: v for k, v in t.items() if k != "id"} for t in tokens]

    _, _, path = converted
    with open_artifact(path) as art:
        fe = art.frontend
    assert added(fe.tokenizer_json) == added(qwen35_tokenizer_json())
    assert "<think>" not in fe.special_tokens and "<tool_call>" not in fe.special_tokens
    assert fe.chat_template == builtin_template("qwen3_5")
    frontend = QwenFrontend.from_resources(fe)
    hi = [{"role": "user", "content": "Hi"}]
    assert frontend.render(hi).endswith("<|im_start|>assistant\n<think>\n")
    assert frontend.render(hi, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    assert '"name": "get_weather"' in frontend.render(hi, tools=[tool])
    markers = "<think>x</think><tool_call><tool_response></tool_response></tool_call><|im_end|>"
    assert frontend.tokenizer.decode(frontend.tokenizer.encode(markers), skip_special=True) == markers[:-len("<|im_end|>")]


def test_inspect_cli(converted, capsys):
    layout, _, path = converted
    assert ninfer_main(["inspect", str(path), "--verify", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verified"] and d["config"]["hidden_size"] == 64
    assert d["per_feature"]["text"]["bytes"] > 0 and ("vision" in d["per_feature"]) == (layout == "vl")
    assert ninfer_main(["inspect", str(path), "--objects"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.gate_up_proj" in out and "features" in out


def test_inspect_reports_corruption(converted, tmp_path, capsys):
    _, _, path = converted
    bad = tmp_path / "bad.ninfer"
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    bad.write_bytes(bytes(raw))
    assert ninfer_main(["inspect", str(bad)]) == 0  # framing is fine
    assert ninfer_main(["inspect", str(bad), "--verify"]) == 2
    assert "checksum" in capsys.readouterr().err


def test_loader_checks_bindings_against_the_architecture(converted, tmp_path):
    """An artifact whose config implies a parameter it does not bind is refused when loading."""
    _, _, path = converted
    with open_artifact(path) as art:
        cfg = dict(art.config)
    from ninfer_qwen35.source_mapping import source_mapping

    text = dict(cfg.get("text_config", cfg))
    text["intermediate_size"] = 256
    mapping = source_mapping(dict(cfg, text_config=text) if "text_config" in cfg else text)
    expected = {n: s for n, (_, s) in mapping.expected_parameters(("text",)).items()}
    from ninfer.artifact import bind

    with open_artifact(path) as art, pytest.raises(ArtifactError, match="mlp.gate_proj.weight' has shape"):
        bind(art.header, ("text",), expected=expected)


@pytest.mark.gpu
def test_cuda_load_is_bit_exact(converted):
    layout, ckpt, path = converted
    source = _source_tensors(ckpt)
    with open_artifact(path) as art:
        weights, report = load_weights(art, features=("text", "mtp"), device="cuda")
    assert report.device.startswith("cuda")
    for name, w in weights.items():
        assert w.is_cuda and torch.equal(w.cpu(), source[name][1]), name
    assert weights.fused(["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]).is_cuda
