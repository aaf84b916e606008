"""The embedded default model (ninfer_qwen35/data/default.ninfer, trained by tools/train_tiny;
docs/embedded-model.md).

It must be a valid, small artifact of the Qwen3.5 architecture with an MTP head, carry the Qwen3.5 special
tokens and chat template, and generate English verse through the real engine on CPU. The training tool's
export names must be exactly what the Qwen3.5 source mapping expects.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from ninfer.artifact.reader import open_artifact
from ninfer.contract import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "ninfer-qwen35/src/ninfer_qwen35/data/default.ninfer"
TOOL = ROOT / "tools/train_tiny"


@pytest.fixture(scope="module")
def artifact():
    if not DEFAULT.exists():
        pytest.fail(f"the embedded model is missing: {DEFAULT}")
    with open_artifact(DEFAULT) as a:
        yield a


def test_artifact_is_small_valid_qwen35_with_mtp(artifact):
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.source_mapping import expected_parameters

    assert DEFAULT.stat().st_size <= 30_000_000
    artifact.verify()
    config = parse_config(artifact.config)
    assert config.num_hidden_layers == 8 and config.mtp_num_hidden_layers == 1
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + \
        ("linear_attention",) * 3 + ("full_attention",)
    assert set(artifact.features) == {"text", "mtp"}
    expected = expected_parameters(config, ("text", "mtp"))
    assert set(expected) <= set(artifact.bindings)
    front = artifact.frontend
    assert front.special_tokens["<|endoftext|>"] == 4063 and front.special_tokens["<|im_end|>"] == 4065
    assert set(front.eos_token_ids) == {4063, 4065}
    assert front.chat_template and "<think>" in front.chat_template


def test_the_qwen35_plugin_ships_it_and_core_finds_it_through_the_hook():
    import ninfer
    from ninfer.plugins import make_plugin_host

    assert Path(ninfer.default_model_path()) == DEFAULT
    assert not list((ROOT / "ninfer-core/src").rglob("*.ninfer"))  # pip install ninfer-core carries no model
    bare = make_plugin_host(autoload=False)
    assert ninfer.default_model_path(host=bare) is None
    with pytest.raises(ValueError, match="no embedded default model .*ninfer-qwen35"):
        ninfer.resolve_model_path(None, host=bare)


def test_engine_generates_english_verse_on_cpu():
    from ninfer.contract.events import GenerationResult, OutputDelta
    from ninfer.contract.prompt import TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams
    from ninfer.engine.engine import Engine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Engine(str(DEFAULT), EngineConfig(device="cpu", max_concurrency=1)) as engine:
            handle = engine.submit(GenerationRequest(input=TextInput(text="ROMEO.\n"),
                                                     sampling=SamplingParams(max_tokens=40, temperature=0.0)))
            text, result = "", None
            for event in handle:
                if isinstance(event, OutputDelta):
                    text += event.content
                elif isinstance(event, GenerationResult):
                    result = event
    finally:
        torch.set_num_threads(before)
    assert result is not None and result.error is None
    words = re.findall(r"[a-z']+", text.lower())
    common = {"i", "the", "and", "my", "lord", "you", "a", "of", "to", "is", "me", "sir", "thou", "not", "am"}
    assert len(words) >= 10 and len(common.intersection(words)) >= 3, text


def _tool_modules(*names: str):
    """Import the training tool's modules (generic names: kept out of everyone else's imports afterwards)."""
    sys.path.insert(0, str(TOOL))
    try:
        return [__import__(name) for name in names]
    finally:
        sys.path.remove(str(TOOL))
        for name in ("model", "tokenizer", "loops", "chat_render", "engine_loops"):
            sys.modules.pop(name, None)


def test_greedy_decoding_does_not_loop():
    """docs/embedded-model.md's greedy table: every plain prompt gets 60+ tokens with at least 60 % distinct
    3-grams; the chat message is answered and the tool request gets a well-formed call."""
    (engine_loops,) = _tool_modules("engine_loops")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = {r["prompt"]: r for r in engine_loops.engine_report(str(DEFAULT))}
    finally:
        torch.set_num_threads(before)
    chats = [label for label in rows if label.startswith("chat:")]
    for label, row in rows.items():
        if label not in chats:
            assert row["tokens"] >= 60 and row["distinct_3grams"] >= 0.6, row
    speak, tool = (rows[label] for label in chats)
    assert speak["finish"] == "stop" and speak["text"].split("</think>")[-1].strip(), speak
    assert re.search(r"<tool_call>\n<function=[a-z_]+>\n<parameter=[a-z_]+>\n.+\n</parameter>", tool["text"]), tool


def test_training_tool_exports_the_names_the_source_mapping_expects():
    pytest.importorskip("transformers")
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.source_mapping import expected_parameters

    sys.path.insert(0, str(TOOL))
    try:
        from model import TinyQwen35, check_mtp_causal, tiny_config
    finally:  # the tool's modules have generic names: keep them out of everyone else's imports
        sys.path.remove(str(TOOL))
        for name in ("model", "tokenizer"):
            sys.modules.pop(name, None)
    torch.manual_seed(0)
    hf_config = tiny_config(eos_ids=[4065, 4063], pad_id=4063)
    hf_config._attn_implementation = "sdpa"
    model = TinyQwen35(hf_config)
    raw = hf_config.to_dict() | {"mtp_num_hidden_layers": 1}
    expected = expected_parameters(parse_config(raw), ("text", "mtp"))
    exported = model.export_state_dict()
    assert set(exported) == set(expected)
    assert all(tuple(exported[name].shape) == shape for name, (_, shape) in expected.items())
    check_mtp_causal(model, torch.randint(0, 4063, (1, 24)))
