"""Startup with the vision feature from a real tiny VL artifact: ``StartupFeatures.vision`` None binds the encoder
when the artifact has it (its weights counted in the plan), False leaves it unread, True requires it; with MTP the
start stays text-only (or is refused with vision=True). A media prompt runs through the built instance's Program
and gives transformers' greedy tokens (the checkpoint loaded by transformers, fp32)."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer.contract.prompt import MediaSpan, PreparedPrompt, TextInput, VisionItem
from ninfer.contract.request import SamplingParams

pytest.importorskip("transformers")
from ninfer.artifact import open_artifact  # noqa: E402
from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig, preprocess_image  # noqa: E402
from ninfer_qwen35.startup import Qwen35Startup, StartupError, build  # noqa: E402
from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402
from ninfer_qwen35.testing.vision_prompts import image, program_greedy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
PIXELS = PreprocessConfig(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
                          max_pixels=128 * 128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt", layout="vl")


@pytest.fixture(scope="module")
def artifact_path(checkpoint, tmp_path_factory):
    return convert_tiny(checkpoint, tmp_path_factory.mktemp("vl-art") / "tiny.ninfer")


def _options(**features) -> StartupOptions:
    return StartupOptions(device="cpu", max_concurrency=1, dtype="float32", num_pages=64, page_size=8,
                          features=StartupFeatures(**features))


def _media_prompt(inst) -> tuple[PreparedPrompt, dict]:
    """'Describe <image> briefly.' as the Frontend lays it out, and transformers' extra inputs."""
    c = inst.config
    prepared = preprocess_image(image(4, 64, 48), PIXELS)
    item = VisionItem(kind="image", pixel_values=prepared.pixel_values, grid_thw=prepared.grid_thw, digest="a" * 64)
    before = list(inst.frontend.prepare(TextInput(text="Describe")).token_ids) + [c.vision_start_token_id]
    after = [c.vision_end_token_id, *inst.frontend.prepare(TextInput(text=" briefly.")).token_ids]
    ids = before + [c.image_token_id] * prepared.tokens + after
    span = MediaSpan(item_index=0, start=len(before), length=prepared.tokens, grid_thw=prepared.grid_thw)
    types = torch.tensor([[1 if t == c.image_token_id else 0 for t in ids]])
    return (PreparedPrompt(token_ids=ids, vision=[item], media_spans=[span]),
            dict(pixel_values=prepared.pixel_values, image_grid_thw=torch.tensor([prepared.grid_thw]),
                 mm_token_type_ids=types))


def test_default_binds_the_encoder_and_runs_media_like_transformers(artifact_path, checkpoint):
    import transformers

    with open_artifact(artifact_path) as art:
        inst = build(art, _options())
    assert inst.features == ("text", "vision") and inst.model.vision is not None
    assert "vision" in inst.model.load_report.features
    prompt, extra = _media_prompt(inst)
    ours = program_greedy(inst.program, prompt, 6, chunk=6)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    want: list[int] = []
    for _ in range(6):
        types = torch.cat([extra["mm_token_type_ids"], torch.zeros(1, len(want), dtype=torch.long)], dim=1)
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([[*prompt.token_ids, *want]]), pixel_values=extra["pixel_values"],
                        image_grid_thw=extra["image_grid_thw"], mm_token_type_ids=types).logits
        want.append(int(logits[0, -1].argmax()))
    assert ours == want
    assert inst.program.usage().all_free and inst.program.vision.items_held == 0


def test_the_plan_counts_the_encoder_weights(artifact_path):
    with open_artifact(artifact_path) as art:
        startup = Qwen35Startup()
        with_vision, without = (startup.profile(art, _options(vision=v)) for v in (None, False))
    assert with_vision.features == ("text", "vision") and without.features == ("text",)
    assert with_vision.placements[0].device_bytes > without.placements[0].device_bytes


def test_the_plan_reserves_the_encoders_peak_for_the_largest_image(artifact_path):
    """The workspace covers the encoder over the largest image a request can carry (max_pixels of the artifact's
    preprocessor config, and no more placeholder tokens than the context), so such an image cannot run the
    device out of memory mid-request."""
    from ninfer.core.device_plan import sized
    from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.execution.vision import VisionConfig

    with open_artifact(artifact_path) as art:
        startup = Qwen35Startup()
        with_vision, without = (sized(startup.profile(art, _options(vision=v)), _options(vision=v))
                                for v in (None, False))
        vc = VisionConfig.from_config(parse_config(art.config))
        pre = PreprocessConfig.from_preprocessor_config(art.frontend.media)
    patches = min(pre.max_pixels // vc.patch_size ** 2, with_vision.model_limit * 4)
    encoder = vc.workspace_bytes(patches, 4)  # the test starts in float32
    assert with_vision.workspace_bytes >= max(encoder, without.workspace_bytes + vc.output_bytes(patches, 4))
    assert with_vision.workspace_bytes > without.workspace_bytes


def test_vision_false_and_mtp_start_text_only(artifact_path):
    with open_artifact(artifact_path) as art:
        off = build(art, _options(vision=False))
        mtp = build(art, _options(speculative="mtp", num_draft_tokens=1))
    prompt, _ = _media_prompt(off)
    assert off.features == ("text",) and off.model.vision is None
    with pytest.raises(ValueError, match="without the vision feature"):
        off.program.open_sequence(prompt, GREEDY)
    assert mtp.features == ("text", "mtp")
    with pytest.raises(ValueError, match="MTP"):
        mtp.program.open_sequence(prompt, GREEDY)


def test_vision_true_needs_the_feature(tmp_path):
    art_path = convert_tiny(make_tiny_checkpoint(tmp_path / "ckpt", layout="text"), tmp_path / "text.ninfer")
    with open_artifact(art_path) as art:
        with pytest.raises(StartupError, match="no vision feature"):
            Qwen35Startup().profile(art, _options(vision=True))
        assert build(art, _options()).features == ("text",)  # None: bound only when present


def test_the_planned_encoder_workspace_is_what_the_plugin_heuristics_gave(artifact_path):
    """The planner sizes the workspace from the encoder's declared needs: the figures the plugin's own estimate
    gave before it moved into core (float32, one sequence; the context bounds the largest item)."""
    from ninfer.core.device_plan import sized

    with open_artifact(artifact_path) as art:
        for context, workspace in ((None, 124780544), (64, 5783552), (4096, 124780544)):
            options = StartupOptions(device="cpu", max_concurrency=1, dtype="float32", max_model_len=context)
            planned = sized(Qwen35Startup().profile(art, options), options)
            assert (planned.workspace_bytes, planned.graph_bytes) == (workspace, 4199168), context
