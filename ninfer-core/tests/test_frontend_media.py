"""QwenFrontend.prepare with images and videos: token ids, MediaSpans, VisionItems, errors and the media pool.

Reference for the token ids: the chat template's text with each placeholder expanded by transformers'
``Qwen3VLProcessor.replace_image_token`` / ``replace_video_token`` (called on a bare instance: the processor's
image and video processors need torchvision, which CPU CI lacks, and expansion needs only their merge and
temporal patch sizes), tokenized whole by ``tokenizers``. A video's expansion replaces the template's
``<|vision_start|><|video_pad|><|vision_end|>``, as the original Qwen3-VL processor and vLLM do (transformers 5
replaces the pad alone and keeps an outer start/end pair; docs/frontend.md). Pixel values are compared with
``vision_preprocess`` on the decoded bytes, exactly.
"""

from __future__ import annotations

import hashlib
import io
import re
import threading
from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from ninfer.contract import ChatInput, PreparedPrompt, PromptTooLong
from ninfer.contract.prompt import MediaItem, MediaSpan
from ninfer.engine.errors import EngineClosed
from ninfer.models.common.qwen import FrontendInputError, QwenFrontend, QwenTokenizer, TemplateError
from ninfer.models.common.qwen.chat_template import builtin_template
from ninfer.models.common.qwen.media_plan import preprocess_encoded_video
from ninfer.models.common.qwen.media_preparation import MediaLimits, MediaPreparer, default_media_threads
from ninfer.models.common.qwen.media_prompt import (
    DEFAULT_VIDEO_FPS,
    MediaInputError,
    MediaTooLarge,
    VisionNotEnabled,
    group_times,
)
from ninfer.models.common.qwen.vision_preprocess import (
    PreprocessConfig,
    decode_image,
    preprocess_image,
    preprocess_video,
)
from ninfer_qwen35.testing.qwen_vocab import qwen35_frontend_resources

# The published Qwen3.5 preprocessor_config.json (Qwen3.5-2B-Base), as the artifact stores it.
QWEN35_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 0.00392156862745098, "resample": 3,
}
CFG = PreprocessConfig.from_preprocessor_config(QWEN35_PREPROCESSOR)
VIDEO_TRIPLE = "<|vision_start|><|video_pad|><|vision_end|>"


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def image(width: int = 300, height: int = 200, seed: int = 0) -> MediaItem:
    return MediaItem(kind="image", data=png(width, height, seed))


def video(frames: int = 5, fps: float | None = 1.0, width: int = 64, height: int = 48, seed: int = 0) -> MediaItem:
    return MediaItem(kind="video", frames=[png(width, height, seed + i) for i in range(frames)], fps=fps)


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


IMAGE, VIDEO = {"type": "image"}, {"type": "video"}


@pytest.fixture(scope="module")
def resources():
    return attrs.evolve(qwen35_frontend_resources(), media=dict(QWEN35_PREPROCESSOR))


@pytest.fixture(scope="module")
def frontend(resources):
    fe = QwenFrontend.from_resources(resources, chat_template_override="builtin:qwen3_5", vision=True)
    yield fe
    fe.close()


@pytest.fixture(scope="module")
def plain_tokenizer(resources):
    return Tokenizer.from_str(resources.tokenizer_json)


def hf_processor() -> Qwen3VLProcessor:
    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    proc.image_processor = SimpleNamespace(merge_size=CFG.merge_size)
    proc.video_processor = SimpleNamespace(merge_size=CFG.merge_size, temporal_patch_size=CFG.temporal_patch_size)
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    return proc


def reference_ids(frontend, plain_tokenizer, chat: ChatInput, prompt: PreparedPrompt, **template_kwargs) -> list[int]:
    """transformers' expansion of the template's text, tokenized whole (see the module docstring)."""
    proc = hf_processor()
    text = frontend.render(chat.messages, **template_kwargs)
    items = iter(zip(chat.media, prompt.vision, strict=True))

    def expand(match: re.Match) -> str:
        item, prepared = next(items)
        grid = np.array([prepared.grid_thw])
        if match.group() == "<|image_pad|>":
            return proc.replace_image_token({"image_grid_thw": grid}, 0)
        fps = DEFAULT_VIDEO_FPS if item.fps is None else item.fps
        metadata = SimpleNamespace(fps=fps, frames_indices=list(range(len(item.frames))))
        return proc.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, 0)

    expanded = re.sub(re.escape(VIDEO_TRIPLE) + "|" + re.escape("<|image_pad|>"), expand, text)
    return plain_tokenizer.encode(expanded, add_special_tokens=False).ids


def runs(ids, token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token``."""
    out, start = [], None
    for i, t in enumerate([*ids, None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            out.append((start, i - start))
            start = None
    return out


def digest(item: MediaItem, cfg, grid) -> str:
    head = f"{item.kind};{cfg!r};{','.join(map(str, grid))};{item.fps}".encode()
    frames = (item.data,) if item.kind == "image" else item.frames
    return hashlib.sha256(head + b"".join(len(d).to_bytes(8, "little") + d for d in frames)).hexdigest()


# -- prompts ----------------------------------------------------------------------------------------------------

def test_one_image(frontend, plain_tokenizer):
    item = image(300, 200)
    chat = ChatInput(messages=[user("What is this?", IMAGE)], media=[item])
    prompt = frontend.prepare(chat, max_tokens=4096)
    assert list(prompt.token_ids) == reference_ids(frontend, plain_tokenizer, chat, prompt)
    (vision,) = prompt.vision
    expected = preprocess_image(decode_image(item.data), CFG)
    assert vision.kind == "image" and vision.grid_thw == expected.grid_thw == (1, 14, 20)  # 224 x 320 pixels
    assert torch.equal(vision.pixel_values, expected.pixel_values)
    assert vision.digest == digest(item, CFG, vision.grid_thw)
    pad = frontend.tokenizer.token_id("<|image_pad|>")
    ((start, length),) = runs(prompt.token_ids, pad)
    assert prompt.media_spans == (MediaSpan(item_index=0, start=start, length=70, grid_thw=(1, 14, 20), offset=0),)
    assert length == 70 == vision.embedding_rows
    assert prompt.token_ids[start - 1] == frontend.tokenizer.token_id("<|vision_start|>")
    assert prompt.media == ()
    assert prompt.reasoning_open  # the generation prompt's <think> is still found after the expansion


def test_two_images_in_two_turns(frontend, plain_tokenizer):
    first, second = image(300, 200, seed=1), image(640, 480, seed=2)
    chat = ChatInput(messages=[
        user(IMAGE, "Describe it."), {"role": "assistant", "content": "A picture."},
        user("And this one?", IMAGE, "Compare them.")], media=[first, second])
    prompt = frontend.prepare(chat, max_tokens=4096)
    assert list(prompt.token_ids) == reference_ids(frontend, plain_tokenizer, chat, prompt)
    assert [v.grid_thw for v in prompt.vision] == [(1, 14, 20), (1, 30, 40)]
    found = runs(prompt.token_ids, frontend.tokenizer.token_id("<|image_pad|>"))
    assert [(s.item_index, s.start, s.length, s.grid_thw, s.offset) for s in prompt.media_spans] == [
        (0, found[0][0], 70, (1, 14, 20), 0), (1, found[1][0], 300, (1, 30, 40), 0)]
    # the history boundary is counted in expanded tokens
    assert prompt.token_ids[prompt.history_boundary] == frontend.tokenizer.token_id("<think>")


def test_video_groups_carry_their_timestamps(frontend, plain_tokenizer):
    item = video(frames=5, fps=1.0)  # groups (0, 1), (2, 3), (4, 4 repeated): 0.5 s, 2.5 s, 4.0 s
    chat = ChatInput(messages=[user("Watch:", VIDEO, "What moves?")], media=[item])
    prompt = frontend.prepare(chat, max_tokens=4096)
    assert list(prompt.token_ids) == reference_ids(frontend, plain_tokenizer, chat, prompt)
    group = "<|vision_start|><|video_pad|><|vision_end|>"
    assert f"Watch:<0.5 seconds>{group}<2.5 seconds>{group}<4.0 seconds>{group}What moves?" in prompt.text
    (vision,) = prompt.vision
    expected = preprocess_video([decode_image(f) for f in item.frames], CFG)
    assert vision.kind == "video" and vision.grid_thw == expected.grid_thw == (3, 4, 4)  # 64 x 64 per frame
    assert torch.equal(vision.pixel_values, expected.pixel_values)
    found = runs(prompt.token_ids, frontend.tokenizer.token_id("<|video_pad|>"))
    assert [(s.item_index, s.start, s.length, s.grid_thw, s.offset) for s in prompt.media_spans] == [
        (0, found[g][0], 4, (1, 4, 4), 4 * g) for g in range(3)]
    assert sum(s.length for s in prompt.media_spans) == vision.embedding_rows


def test_video_without_fps_is_taken_at_two_frames_a_second(frontend, plain_tokenizer):
    item = video(frames=4, fps=None)
    chat = ChatInput(messages=[user(VIDEO)], media=[item])
    prompt = frontend.prepare(chat)
    assert list(prompt.token_ids) == reference_ids(frontend, plain_tokenizer, chat, prompt)
    assert "<0.2 seconds>" in prompt.text and "<1.2 seconds>" in prompt.text  # (0 + 0.5) / 2, (1 + 1.5) / 2
    assert group_times(4, DEFAULT_VIDEO_FPS, 2) == [0.25, 1.25]


def test_timestamps_equal_transformers():
    proc = hf_processor()
    for frames, fps in [(2, 2.0), (7, 3.0), (16, 0.5), (9, 29.97)]:
        assert group_times(frames, fps, 2) == proc._calculate_timestamps(list(range(frames)), fps, 2)


def test_images_videos_and_text_mixed_with_vision_ids(frontend, plain_tokenizer):
    media = [video(frames=2, fps=4.0, seed=5), image(100, 900, seed=3), image(300, 200, seed=4)]
    chat = ChatInput(messages=[
        {"role": "system", "content": "Be exact."},
        user(VIDEO, "then", IMAGE), {"role": "assistant", "content": "Seen."}, user(IMAGE, "last")],
        media=media, template_kwargs={"add_vision_id": True})
    prompt = frontend.prepare(chat, max_tokens=4096)
    assert list(prompt.token_ids) == reference_ids(frontend, plain_tokenizer, chat, prompt, add_vision_id=True)
    assert "Video 1: <0.1 seconds>" in prompt.text and "Picture 2: <|vision_start|>" in prompt.text
    assert [s.item_index for s in prompt.media_spans] == [0, 1, 2]
    assert [v.kind for v in prompt.vision] == ["video", "image", "image"]


def test_openai_part_type_names_are_media_parts(frontend):
    canonical = ChatInput(messages=[user("a", IMAGE, VIDEO)], media=[image(), video(frames=2)])
    openai = ChatInput(messages=[user("a", {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                                      {"type": "video_url", "video_url": {"url": "file:///clip.mp4"}})],
                       media=canonical.media)
    assert frontend.prepare(openai).token_ids == frontend.prepare(canonical).token_ids


def test_same_media_same_digest_different_media_different_digest(frontend):
    chat = ChatInput(messages=[user(IMAGE, IMAGE, IMAGE)], media=[image(seed=7), image(seed=7), image(seed=8)])
    a, b, c = frontend.prepare(chat).vision
    assert a.digest == b.digest != c.digest and a.grid_thw == c.grid_thw


def test_special_token_text_in_messages_does_not_become_a_placeholder(frontend, resources, plain_tokenizer):
    chat = ChatInput(messages=[user("literal <|image_pad|> and <|vision_start|><|video_pad|><|vision_end|>", IMAGE)],
                     media=[image()])
    prompt = frontend.prepare(chat)
    assert [s.length for s in prompt.media_spans] == [70]
    assert "literal <|image_pad|>" in frontend.tokenizer.decode(prompt.token_ids)
    # with special_tokens_in_content they are placeholders, as in transformers: two more than the media
    control = QwenFrontend.from_resources(resources, chat_template_override="builtin:qwen3_5", vision=True,
                                          special_tokens_in_content=True)
    try:
        with pytest.raises(MediaInputError, match="holds 3 image/video placeholders for 1 media items"):
            control.prepare(chat)
        swapped = ChatInput(messages=[user("<|vision_start|><|video_pad|><|vision_end|>", IMAGE)], media=[image()])
        with pytest.raises(MediaInputError, match="holds a video placeholder where media item 0 \\(an image\\)"):
            control.prepare(swapped)
        plain = ChatInput(messages=[user("no specials here", IMAGE)], media=[image()])
        assert control.prepare(plain).token_ids == frontend.prepare(plain).token_ids
    finally:
        control.close()


def test_embedded_model_template_and_tokenizer_place_media():
    from ninfer import default_model_path
    from ninfer.artifact import open_artifact

    with open_artifact(default_model_path()) as art:
        shipped = art.frontend
    chat = ChatInput(messages=[user("Hark:", IMAGE, VIDEO)], media=[image(), video(frames=3)])
    with pytest.raises(VisionNotEnabled, match="no vision encoder"):
        QwenFrontend.from_resources(shipped).prepare(chat)
    fe = QwenFrontend.from_resources(attrs.evolve(shipped, media=dict(QWEN35_PREPROCESSOR)), vision=True)
    try:
        prompt = fe.prepare(chat)
        pad = fe.tokenizer.token_id("<|image_pad|>")
        assert runs(prompt.token_ids, pad) == [(prompt.media_spans[0].start, 70)]
        assert [s.grid_thw for s in prompt.media_spans[1:]] == [(1, 4, 4)] * 2
        assert "Hark:<|vision_start|><|image_pad|><|vision_end|><0.5 seconds>" in prompt.text
    finally:
        fe.close()


# -- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("parts, media, message", [
    ((IMAGE, IMAGE), [image()], "2 image/video parts but the request carries 1 media items: part 1"),
    ((IMAGE,), [image(), image()], "carries 2 media items but the messages have 1 image/video parts"),
    ((), [image()], "media item 0 has no place"),
    ((IMAGE,), [], "part 0 \\(an image\\) has none"),
    ((IMAGE, VIDEO), [image(), image()], "media part 1 of the messages is a video, but media item 1 is an image"),
])
def test_parts_and_media_must_match(frontend, parts, media, message):
    with pytest.raises(MediaInputError, match=message) as err:
        frontend.prepare(ChatInput(messages=[user("x", *parts)], media=media))
    assert err.value.kind == "invalid_media" and isinstance(err.value, FrontendInputError)


@pytest.mark.parametrize("item, message", [
    (MediaItem(kind="image", data=b"not an image at all"), "media item 1 \\(image\\): image data .* not in an image"),
    (MediaItem(kind="video", frames=[png(64, 48), b"garbage"]), "media item 1 \\(video\\): video frame 1: image data"),
    (MediaItem(kind="video", frames=[png(64, 48), png(48, 64)]), "media item 1 \\(video\\): video frame 1 is 48x64"),
    (MediaItem(kind="video", frames=[png(64, 48)]), "media item 1 \\(video\\): a video needs at least 2 frames"),
    (MediaItem(kind="image", data=png(2000, 8)), "media item 1 \\(image\\): image aspect ratio 250.0"),
])
def test_unusable_media_names_the_item(frontend, item, message):
    chat = ChatInput(messages=[user(IMAGE, {"type": item.kind})], media=[image(), item])
    with pytest.raises(MediaInputError, match=message) as err:
        frontend.prepare(chat)
    assert err.value.kind == "invalid_media"


def test_media_over_limits_is_too_large(resources):
    limits = MediaLimits(max_item_bytes=100_000, max_video_frames=3, max_decoded_pixels=100 * 100)
    fe = QwenFrontend.from_resources(resources, chat_template_override="builtin:qwen3_5", vision=True,
                                     media_limits=limits, media_threads=1)
    try:
        cases = [(image(200, 200), "media item 0 \\(image\\) is \\d+ bytes, more than the limit of 100000"),
                 (video(frames=4, width=16, height=16), "media item 0 \\(video\\) has 4 frames, more than .* of 3"),
                 (image(120, 90), "media item 0 \\(image\\): image is 120x90 = 10800 pixels, more than .* 10000"),
                 (video(frames=2, width=101, height=100), "media item 0 \\(video\\): video frame 0: image is 101x100")]
        for item, message in cases:
            with pytest.raises(MediaTooLarge, match=message) as err:
                fe.prepare(ChatInput(messages=[user({"type": item.kind})], media=[item]))
            assert err.value.kind == "media_too_large"
    finally:
        fe.close()


def test_too_many_tokens_is_prompt_too_long(frontend):
    chat = ChatInput(messages=[user("Look", IMAGE)], media=[image(640, 480)])  # 300 image tokens
    length = len(frontend.prepare(chat).token_ids)
    assert frontend.prepare(chat, max_tokens=length).token_ids  # exactly fits
    with pytest.raises(PromptTooLong) as err:
        frontend.prepare(chat, max_tokens=length - 1)
    assert (err.value.tokens, err.value.exact) == (length, True)
    # fewer tokens than the smallest image takes: refused before decoding (the bytes here could not be)
    tiny = ChatInput(messages=[user("Look", IMAGE)], media=[MediaItem(kind="image", data=b"undecodable")])
    with pytest.raises(PromptTooLong) as err:
        frontend.prepare(tiny, max_tokens=40)
    assert not err.value.exact and err.value.tokens > 40 and "smallest size" in str(err.value)


def test_media_on_a_model_without_vision_is_refused(resources):
    chat = ChatInput(messages=[user("hi", IMAGE)], media=[image()])
    off = QwenFrontend.from_resources(resources, chat_template_override="builtin:qwen3_5")  # vision off by default
    with pytest.raises(VisionNotEnabled, match="started without vision") as err:
        off.prepare(chat)
    assert err.value.kind == "vision_not_enabled" and not off.vision
    text_only = QwenFrontend.from_resources(attrs.evolve(resources, media=None), chat_template_override="builtin:qwen3_5")
    for c in (chat, ChatInput(messages=[user("hi", IMAGE)])):  # a part without media too
        with pytest.raises(VisionNotEnabled, match="no vision encoder"):
            text_only.prepare(c)
    with pytest.raises(ValueError, match="no preprocessor config"):
        QwenFrontend.from_resources(attrs.evolve(resources, media=None), vision=True)
    prepared = PreparedPrompt(token_ids=[1, 2], media_spans=[MediaSpan(item_index=0, start=0, length=1,
                                                                       grid_thw=(1, 2, 2))])
    with pytest.raises(VisionNotEnabled):
        off.prepare(prepared)
    off.close()  # nothing to stop: no media threads were made
    assert off.prepare(ChatInput(messages=[user("hi")])).token_ids


def test_media_in_a_system_message_is_a_template_error(frontend):
    chat = ChatInput(messages=[{"role": "system", "content": [IMAGE]}, user("hi")], media=[image()])
    with pytest.raises(TemplateError, match="system message cannot contain images"):
        frontend.prepare(chat)


def test_a_prepared_prompt_with_raw_media_is_refused(frontend):
    with pytest.raises(FrontendInputError, match="send raw media in a ChatInput"):
        frontend.prepare(PreparedPrompt(token_ids=[1], media=[image()]))


# -- preparation pool -------------------------------------------------------------------------------------------

def small_frontend(resources, preparer: MediaPreparer) -> QwenFrontend:
    return QwenFrontend(QwenTokenizer(resources.tokenizer_json), chat_template=builtin_template(),
                        eos_token_ids=resources.eos_token_ids, generation_config={}, media=preparer)


def test_a_saturated_pool_serves_every_request(resources):
    """One thread and one queue place for 6 concurrent requests of 3 items each (one request failing): every
    request gets its own items, in order; none hangs (the joins' timeout is only a hang guard)."""
    fe = small_frontend(resources, MediaPreparer(CFG, threads=1, max_queued=1))
    results: dict[int, object] = {}

    def run(n: int) -> None:
        media = [image(64 + 32 * n, 64, seed=n), video(frames=2, seed=n), image(64, 64 + 32 * n, seed=n)]
        if n == 3:
            media[1] = MediaItem(kind="video", frames=[b"bad", b"bad"])
        try:
            results[n] = fe.prepare(ChatInput(messages=[user(IMAGE, VIDEO, IMAGE)], media=media))
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            results[n] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert not any(t.is_alive() for t in threads)
        assert isinstance(results[3], MediaInputError) and "media item 1 (video)" in str(results[3])
        for n in (0, 1, 2, 4, 5):
            expected = preprocess_image(decode_image(png(64 + 32 * n, 64, seed=n)), CFG)
            assert torch.equal(results[n].vision[0].pixel_values, expected.pixel_values)
            assert [v.kind for v in results[n].vision] == ["image", "video", "image"]
    finally:
        fe.close()


def test_close_stops_media_but_not_text(resources):
    fe = small_frontend(resources, MediaPreparer(CFG, threads=2))
    chat = ChatInput(messages=[user(IMAGE)], media=[image()])
    assert fe.prepare(chat).vision
    fe.close()
    fe.close()
    with pytest.raises(EngineClosed, match="frontend is closed"):
        fe.prepare(chat)
    assert fe.prepare(ChatInput(messages=[user("still here")])).token_ids


def test_pool_size():
    assert 1 <= default_media_threads() <= 4
    for bad in (0, 17, True):
        with pytest.raises(ValueError, match="1..16 threads"):
            MediaPreparer(CFG, threads=bad)


def test_encoded_video_equals_decoded_frames():
    frames = [png(90, 50, seed=i) for i in range(3)]
    a = preprocess_encoded_video(frames, CFG)
    b = preprocess_video([decode_image(f) for f in frames], CFG)
    assert a.grid_thw == b.grid_thw and torch.equal(a.pixel_values, b.pixel_values)


def test_a_prepared_prompt_with_media_passes_through_when_its_spans_hold(frontend):
    prompt = frontend.prepare(ChatInput(messages=[user("a", IMAGE, VIDEO)], media=[image(), video(frames=4)]))
    assert frontend.prepare(prompt) is prompt
    span = prompt.media_spans[1]
    broken = {
        "names media item 5": attrs.evolve(span, item_index=5),
        "has 3 tokens for grid": attrs.evolve(span, length=3),
        "takes rows past the 8 of media item 1": attrs.evolve(span, offset=6),
        "covers tokens other than its video's placeholder": attrs.evolve(span, start=span.start - 1),
        "lies outside the prompt": attrs.evolve(span, start=len(prompt.token_ids) - 2),
    }
    for message, bad in broken.items():
        spans = list(prompt.media_spans)
        spans[1] = bad
        with pytest.raises(MediaInputError, match=message):
            frontend.prepare(attrs.evolve(prompt, media_spans=spans))
