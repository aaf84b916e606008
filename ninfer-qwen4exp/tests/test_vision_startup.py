"""Qwen4Exp startup with the vision feature, from a real tiny VL artifact (``make_tiny_checkpoint(vl=True)``: the
``full`` variant, QSA selecting from the 12th token, PLE, 4 streams): ``StartupFeatures.vision`` None binds
Qwen3.5's encoder when the artifact has it (its weights, its workspace and the paged rotary positions planned),
False leaves it unread and refuses media, with MTP the start stays text only (vision=True is refused); a media prompt through the built instance's Program gives the greedy
tokens of transformers' ``Qwen4ExpForConditionalGeneration.generate`` on the checkpoint (fp32), and the same tokens
when paused after the prompt (Snapshot: the pages, rotary positions included, go to the host and back; Replay:
the image is encoded again)."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer.contract.prompt import MediaSpan, PreparedPrompt, TextInput, VisionItem
from ninfer.contract.request import SamplingParams

pytest.importorskip("transformers")
from ninfer.artifact import open_artifact  # noqa: E402
from ninfer.models.common.qwen.mrope import MRopePlan  # noqa: E402
from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig, preprocess_image  # noqa: E402
from ninfer_qwen4exp.startup import Qwen4ExpStartup, StartupError, build  # noqa: E402
from ninfer_qwen4exp.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402
from ninfer_qwen35.testing.vision_prompts import decode_greedy, image, prefill_greedy, program_greedy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q4vl") / "ckpt", vl=True, variant="full")


@pytest.fixture(scope="module")
def artifact_path(checkpoint, tmp_path_factory):
    return convert_tiny(checkpoint, tmp_path_factory.mktemp("q4vl-art") / "tiny.ninfer")


def _options(**features) -> StartupOptions:
    return StartupOptions(device="cpu", max_concurrency=1, dtype="float32", num_pages=64, page_size=8,
                          features=StartupFeatures(**features))


def _media_prompt(inst, media: dict) -> tuple[PreparedPrompt, dict]:
    """'Describe <image> briefly.' as the Frontend lays it out (48 placeholder tokens: the QSA block keys' (t, h, w)
    positions change the greedy tokens of this checkpoint), and transformers' extra inputs."""
    c = inst.config.base
    prepared = preprocess_image(image(4, 256, 192), PreprocessConfig.from_preprocessor_config(media))
    item = VisionItem(kind="image", pixel_values=prepared.pixel_values, grid_thw=prepared.grid_thw, digest="a" * 64)
    before = list(inst.frontend.prepare(TextInput(text="Describe")).token_ids) + [c.vision_start_token_id]
    after = [c.vision_end_token_id, *inst.frontend.prepare(TextInput(text=" briefly.")).token_ids]
    ids = before + [c.image_token_id] * prepared.tokens + after
    span = MediaSpan(item_index=0, start=len(before), length=prepared.tokens, grid_thw=prepared.grid_thw)
    types = torch.tensor([[1 if t == c.image_token_id else 0 for t in ids]])
    return (PreparedPrompt(token_ids=ids, vision=[item], media_spans=[span]),
            dict(pixel_values=prepared.pixel_values, image_grid_thw=torch.tensor([prepared.grid_thw]),
                 mm_token_type_ids=types))


def test_default_binds_the_encoder_and_gives_transformers_greedy_tokens(artifact_path, checkpoint):
    import transformers

    with open_artifact(artifact_path) as art:
        inst = build(art, _options())
        media = art.frontend.media
    assert inst.features == ("text", "vision") and inst.model.vision is not None
    assert inst.program.views.rope_positions is not None
    prompt, extra = _media_prompt(inst, media)
    qsa = inst.config.qsa
    assert len(prompt.token_ids) // qsa.compress_ratio > qsa.block_topk  # selection is active in the prompt
    n = 10
    ours = program_greedy(inst.program, prompt, n, chunk=24)  # chunks split the image
    hf = transformers.Qwen4ExpForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the full length; a generated EOS only resets the n-grams
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt.token_ids]), **extra, max_new_tokens=n, do_sample=False)
    assert ours == out[0, len(prompt.token_ids):].tolist()
    assert inst.program.usage().all_free and inst.program.vision.items_held == 0


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_pause_after_the_prompt_resumes_exactly(artifact_path, mode):
    with open_artifact(artifact_path) as art:
        inst = build(art, _options())
        media = art.frontend.media
    prog, (prompt, _) = inst.program, _media_prompt(inst, media)
    want = program_greedy(prog, prompt, 10, chunk=24)
    sid = prog.open_sequence(prompt, GREEDY)
    got = prefill_greedy(prog, sid, 24) + decode_greedy(prog, sid, 1)
    written = _rope_positions(prog, sid)  # every computed token's (t, h, w), as the prompt's MRoPE plan has them
    plan = MRopePlan(len(prompt.token_ids), prompt.media_spans, 2)
    assert torch.equal(written, plan.positions(0, written.shape[0]).T.int())
    state = prog.pause(sid, mode)
    assert prog.usage().kv_pages_used == 0
    prog.views.rope_positions.fill_(-1)  # a Snapshot's come back from the host, a Replay's are written again
    sid = prog.resume(state)
    got += prefill_greedy(prog, sid, 24)
    assert torch.equal(_rope_positions(prog, sid)[:written.shape[0]], written)
    got += decode_greedy(prog, sid, len(want) - len(got))
    assert got == want
    prog.release(sid)
    assert prog.usage().all_free and prog.vision.items_held == 0


def _rope_positions(prog, sid: int) -> torch.Tensor:
    seq = prog.sequences.get(sid)
    pages = torch.tensor(seq.pages, dtype=torch.long)
    return prog.views.rope_positions[pages].reshape(-1, 3)[:seq.computed]


def test_the_plan_counts_the_encoder_and_the_rotary_positions(artifact_path):
    with open_artifact(artifact_path) as art:
        startup = Qwen4ExpStartup()
        with_vision, without = (startup.profile(art, _options(vision=v)) for v in (None, False))
    assert with_vision.features == ("text", "vision") and without.features == ("text",)
    assert with_vision.placements[0].device_bytes > without.placements[0].device_bytes
    assert with_vision.encoder is not None and without.encoder is None
    assert with_vision.kv_page_bytes == without.kv_page_bytes + 8 * 3 * 4  # (t, h, w) int32 per token of a page


def test_vision_false_starts_text_only_and_refuses_media(artifact_path):
    with open_artifact(artifact_path) as art:
        off = build(art, _options(vision=False))
        media = art.frontend.media
    assert off.features == ("text",) and off.model.vision is None and off.program.views.rope_positions is None
    prompt, _ = _media_prompt(off, media)
    with pytest.raises(ValueError, match="without the vision feature"):
        off.program.open_sequence(prompt, GREEDY)


def test_mtp_starts_text_only(artifact_path):
    with open_artifact(artifact_path) as art:
        startup = Qwen4ExpStartup()
        assert startup.profile(art, _options(speculative="mtp", num_draft_tokens=1)).features == ("text", "mtp")
        with pytest.raises(StartupError, match="MRoPE"):
            startup.profile(art, _options(vision=True, speculative="mtp", num_draft_tokens=1))


def test_vision_true_needs_the_feature(tmp_path):
    art_path = convert_tiny(make_tiny_checkpoint(tmp_path / "ckpt", variant="qsa", mtp=False),
                            tmp_path / "text.ninfer")
    with open_artifact(art_path) as art:
        with pytest.raises(StartupError, match="no vision feature"):
            Qwen4ExpStartup().profile(art, _options(vision=True))
        assert Qwen4ExpStartup().profile(art, _options()).features == ("text",)  # None: bound only when present
