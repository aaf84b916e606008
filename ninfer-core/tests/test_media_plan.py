"""Media planned from headers (``media_plan``): the grid and token count known before any pixel is decoded.

- a request whose images would not fit the context is refused with its exact length, and no pixel is decoded
  (Pillow's pixel loader is never reached);
- a request's media together take at most ``max_request_tokens`` placeholder tokens, also checked undecoded;
- property: over odd, tiny and large sizes, every format (JPEG decoded at reduced scale, JPEG and WebP turned by
  their EXIF orientation, a PNG whose EXIF orientation follows its pixel data), and videos, the plan's grid and
  token count equal those of the decoded picture preprocessed on its own; a prompt's counted length equals the
  prepared prompt's.
"""

from __future__ import annotations

import io
import re
import struct
import zlib

import attrs
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from ninfer.contract import ChatInput, PromptTooLong
from ninfer.contract.prompt import MediaItem
from ninfer.models.common.qwen import QwenFrontend
from ninfer.models.common.qwen.image_decode import MediaError, decode_image
from ninfer.models.common.qwen.media_plan import (
    plan_image,
    plan_video,
    preprocess_encoded_image,
    preprocess_encoded_video,
)
from ninfer.models.common.qwen.media_preparation import MediaLimits
from ninfer.models.common.qwen.media_prompt import MediaTooLarge
from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig, preprocess_image, preprocess_video
from ninfer_qwen35.testing.qwen_vocab import qwen35_frontend_resources

QWEN35_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 0.00392156862745098, "resample": 3,
}
# Resizes to at most 25 merge blocks, so pictures of a few hundred pixels are "huge" and cost little.
SMALL = PreprocessConfig(min_pixels=4 * 32 * 32, max_pixels=160 * 160, video_min_pixels=2 * 32 * 32,
                         video_max_pixels=8 * 160 * 160)
ANY_SIZE = 10 ** 7  # a decoding bound no picture here reaches
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "JPEG-turned", "WEBP-turned", "PNG-turned-late")


def gradient(width: int, height: int) -> Image.Image:
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    return Image.fromarray(np.stack([x + 0 * y, 0 * x + y, (x + y) / 2], axis=-1).astype(np.uint8), "RGB")


def _turned() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed turned a quarter
    return exif.tobytes()


def encoded(width: int, height: int, fmt: str) -> bytes:
    """``width`` x ``height`` stored in ``fmt``; a "-turned" format carries EXIF orientation 6 (displayed
    height x width); "PNG-turned-late" puts that EXIF block after the pixel data, where only decoding finds it."""
    picture, out = gradient(width, height), io.BytesIO()
    base = fmt.split("-")[0]
    if fmt in ("JPEG-turned", "WEBP-turned"):
        picture.save(out, base, exif=_turned())
    else:
        picture.save(out, base)
    data = out.getvalue()
    if fmt == "PNG-turned-late":
        body = _turned()[len(b"Exif\x00\x00"):]
        chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
        data = data[:-12] + chunk + data[-12:]  # before IEND
    return data


@pytest.fixture
def no_pixel_decoding(monkeypatch):
    """Every pixel decode of every format goes through ``ImageFile.load``: here it fails the test."""
    def refuse(self):
        raise AssertionError(f"a {self.format} picture was decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


# ---------------------------------------------------------------- refused before decoding


@pytest.fixture(scope="module")
def resources():
    return attrs.evolve(qwen35_frontend_resources(), media=dict(QWEN35_PREPROCESSOR))


@pytest.fixture(scope="module")
def frontend(resources):
    fe = QwenFrontend.from_resources(resources, chat_template_override="builtin:qwen3_5", vision=True)
    yield fe
    fe.close()


@pytest.fixture(scope="module")
def roomy_frontend(resources):
    """No bound on a request's media tokens but the context."""
    fe = QwenFrontend.from_resources(resources, chat_template_override="builtin:qwen3_5", vision=True,
                                     media_limits=MediaLimits(max_request_tokens=10 ** 9))
    yield fe
    fe.close()


def chat(*media: MediaItem) -> ChatInput:
    parts = [{"type": item.kind} for item in media]
    return ChatInput(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "Compare."}]}],
                     media=list(media))


def large_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (40, 90, 200)).save(out, "PNG")
    return out.getvalue()


def test_images_past_the_context_are_refused_exactly_without_decoding(roomy_frontend, no_pixel_decoding):
    """The issue's request: 16 legal 4096 x 4096 pictures (16,384 tokens each at the model's max_pixels) in a
    context of 100,000 tokens. Refused with the prompt's exact length; not one pixel decoded (the old Frontend
    decoded all 16, ~384 MB of pixel rows each, before counting)."""
    request = chat(*[MediaItem(kind="image", data=large_png(4096, 4096))] * 16)
    with pytest.raises(PromptTooLong) as err:
        roomy_frontend.prepare(request, max_tokens=100_000)
    assert err.value.exact and err.value.tokens > 16 * 16_384


def test_a_request_s_media_tokens_are_bounded_before_decoding(frontend, no_pixel_decoding):
    """Within the context, a request's media may still not take more than max_request_tokens placeholder tokens
    (32,768 by default: 768 MiB of float32 pixel rows): the third 4096 x 4096 picture passes it."""
    request = chat(*[MediaItem(kind="image", data=large_png(4096, 4096))] * 3)
    with pytest.raises(MediaTooLarge, match=r"media items 0..2 take 49152 placeholder tokens \(1152 MiB of pixel "
                                            r"rows\), more than the limit of 32768 .*--media-max-tokens") as err:
        frontend.prepare(request, max_tokens=262_143)
    assert err.value.kind == "media_too_large"
    two = chat(*[MediaItem(kind="image", data=large_png(4096, 4096))] * 2)
    with pytest.raises(PromptTooLong):  # two fit the bound: counted against the context, still undecoded
        frontend.prepare(two, max_tokens=30_000)


def test_a_video_past_the_context_is_refused_without_decoding(frontend, no_pixel_decoding):
    request = chat(MediaItem(kind="image", data=large_png(1024, 1024)),
                   MediaItem(kind="video", frames=[large_png(1280, 720)] * 8, fps=2.0))
    with pytest.raises(PromptTooLong) as err:
        frontend.prepare(request, max_tokens=2_000)
    assert err.value.exact and err.value.tokens > 1024 + 4 * 44 * 80 // 4  # 1280 x 704 per frame, 4 groups


MIXED = [
    [("image", 300, 200, "PNG")],
    [("image", 1, 1, "PNG"), ("image", 3, 500, "GIF")],  # tiny, and an odd sliver
    [("image", 1601, 1203, "JPEG"), ("image", 999, 777, "WEBP")],  # JPEG at reduced scale, odd sides
    [("image", 4000, 3000, "JPEG-turned"), ("image", 517, 263, "PNG-turned-late"), ("image", 64, 48, "BMP")],
    [("video", 333, 190, "PNG"), ("image", 640, 480, "WEBP-turned"), ("video", 97, 1283, "JPEG")],
]


@pytest.mark.parametrize("media", MIXED, ids=lambda media: "+".join(f"{w}x{h}{f}" for _, w, h, f in media))
def test_the_counted_length_is_the_prepared_length(frontend, media, monkeypatch):
    items = [MediaItem(kind="image", data=encoded(w, h, fmt)) if kind == "image"
             else MediaItem(kind="video", frames=[encoded(w, h, fmt)] * 5, fps=2.0) for kind, w, h, fmt in media]
    prepared = frontend.prepare(chat(*items))
    length = len(prepared.token_ids)
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded while counting"))
    with pytest.raises(PromptTooLong) as err:
        frontend.prepare(chat(*items), max_tokens=length - 1)
    assert (err.value.tokens, err.value.exact) == (length, True)


# ---------------------------------------------------------------- the plan is the decoded grid

sides = st.one_of(st.integers(1, 40), st.integers(41, 700))


@settings(max_examples=120, deadline=None, derandomize=True)
@given(width=sides, height=sides, fmt=st.sampled_from(FORMATS))
@example(width=1, height=1, fmt="PNG")
@example(width=700, height=523, fmt="JPEG")  # decoded at 1/2 scale
@example(width=640, height=700, fmt="JPEG-turned")
@example(width=3, height=600, fmt="PNG")  # aspect 200: the limit itself
@example(width=700, height=3, fmt="GIF")  # past it
@example(width=517, height=263, fmt="PNG-turned-late")
def test_an_image_s_plan_is_its_decoded_grid(width, height, fmt):
    data = encoded(width, height, fmt)
    decoded = decode_image(data, max_pixels=ANY_SIZE)  # the whole picture, as displayed
    try:
        reference = preprocess_image(decoded, SMALL)
    except MediaError as refused:  # an aspect ratio over 200: refused from the header as well
        with pytest.raises(MediaError, match=re.escape(str(refused))):
            plan_image(data, SMALL, max_pixels=ANY_SIZE)
        return
    plan = plan_image(data, SMALL, max_pixels=ANY_SIZE)
    assert plan.tokens == reference.tokens
    prepared = preprocess_encoded_image(data, SMALL, max_pixels=ANY_SIZE, plan=plan)
    assert prepared.grid_thw == reference.grid_thw and prepared.tokens == plan.tokens
    if fmt != "PNG-turned-late":  # only decoding finds that orientation: the plan's grid is the transpose
        assert plan.grid_thw == reference.grid_thw
    else:
        assert plan.grid_thw == (1, reference.grid_thw[2], reference.grid_thw[1])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(width=sides, height=sides, frames=st.integers(2, 7), fmt=st.sampled_from(("PNG", "JPEG", "WEBP", "GIF")))
def test_a_video_s_plan_is_its_decoded_grid(width, height, frames, fmt):
    data = [encoded(width, height, fmt)] * frames
    try:
        reference = preprocess_video([decode_image(frame, max_pixels=ANY_SIZE) for frame in data], SMALL)
    except MediaError as refused:
        with pytest.raises(MediaError, match=re.escape(str(refused))):
            plan_video(data, SMALL, max_pixels=ANY_SIZE)
        return
    plan = plan_video(data, SMALL, max_pixels=ANY_SIZE)
    assert (plan.grid_thw, plan.tokens) == (reference.grid_thw, reference.tokens)
    assert preprocess_encoded_video(data, SMALL, max_pixels=ANY_SIZE, plan=plan).grid_thw == reference.grid_thw


def test_planning_reads_headers_only(no_pixel_decoding):
    for fmt in FORMATS:
        assert plan_image(encoded(900, 700, fmt), SMALL, max_pixels=ANY_SIZE).tokens > 0
    assert plan_video([encoded(90, 70, "PNG")] * 4, SMALL, max_pixels=ANY_SIZE).frames == 4


def test_a_video_s_frames_are_checked_from_their_headers(no_pixel_decoding):
    with pytest.raises(MediaError, match="video frame 2 is 70x90, frame 0 is 90x70; all frames of a video"):
        plan_video([encoded(90, 70, "PNG")] * 2 + [encoded(70, 90, "PNG")], SMALL)
    with pytest.raises(MediaError, match="video frame 1: image data .* not in an image format"):
        plan_video([encoded(90, 70, "PNG"), b"GIF87a"[:3] + b"not"], SMALL)
