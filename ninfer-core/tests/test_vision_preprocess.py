"""Vision preprocessing against transformers' Qwen2-VL PIL image processor, plus hand-checked video cases.

Reference: ``Qwen2VLImageProcessorPil`` (transformers' PIL/numpy "slow" processor; the default fast one needs
torchvision, which CPU CI lacks). Tolerance: none, pixel values must be bit-identical. The Qwen3-VL video
processor cannot be imported without torchvision, so video is checked against hand-computed grids and a
patch layout written out index by index from its patchify.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_transforms import normalize as hf_normalize
from transformers.image_transforms import rescale as hf_rescale
from transformers.image_transforms import resize as hf_resize
from transformers.image_utils import ChannelDimension, PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from ninfer.models.common.qwen.vision_preprocess import (
    MediaError,
    PreprocessConfig,
    decode_image,
    preprocess_image,
    preprocess_video,
    smart_resize,
    smart_resize_video,
)

# The published Qwen3.5 preprocessor_config.json (Qwen3.5-2B-Base) and video_preprocessor_config.json.
QWEN35_IMAGE_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 0.00392156862745098, "resample": 3,
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
}
QWEN35_VIDEO_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def reference_processor(cfg: PreprocessConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
        patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size, merge_size=cfg.merge_size,
        image_mean=list(cfg.mean), image_std=list(cfg.std), rescale_factor=cfg.rescale)


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = "RGBA" if "A" in mode else "RGB"
    pixels = rng.integers(0, 256, (height, width, len(base)), dtype=np.uint8)
    return Image.fromarray(pixels, base).convert(mode)


def assert_matches_reference(image: Image.Image, cfg: PreprocessConfig) -> None:
    expected = reference_processor(cfg)(images=[image], return_tensors="np")
    ours = preprocess_image(image, cfg)
    t, h, w = (int(x) for x in expected["image_grid_thw"][0])
    assert ours.grid_thw == (t, h, w)
    assert ours.tokens == t * h * w // cfg.merge_size ** 2
    assert ours.pixel_values.dtype == torch.float32
    np.testing.assert_array_equal(ours.pixel_values.numpy(), expected["pixel_values"])


QWEN35 = PreprocessConfig.from_preprocessor_config(QWEN35_IMAGE_CONFIG, QWEN35_VIDEO_CONFIG)
# Small pixel bounds, so that the downscaling branch runs on images of modest size.
SMALL_BOUNDS = PreprocessConfig(min_pixels=32 * 32, max_pixels=128 * 128)


@pytest.mark.parametrize(("width", "height"), [
    (1, 1), (5, 3), (37, 300), (256, 256), (640, 480), (480, 641), (1000, 17), (333, 777),
])
def test_pixel_values_and_grid_equal_transformers(width, height):
    assert_matches_reference(random_image(width, height, seed=width * 1000 + height), QWEN35)


@pytest.mark.parametrize(("width", "height"), [(700, 500), (1024, 96), (129, 1500)])
def test_downscaled_images_equal_transformers(width, height):
    assert_matches_reference(random_image(width, height, seed=width + height), SMALL_BOUNDS)


@pytest.mark.parametrize("mode", ["L", "RGBA", "LA", "CMYK", "1"])
def test_non_rgb_modes_equal_transformers(mode):
    # RGBA/LA carry random alpha: the reference composites transparency on white, and so must we.
    assert_matches_reference(random_image(45, 70, mode, seed=7), QWEN35)


def test_palette_image_with_transparency_equals_transformers():
    image = random_image(40, 52, "RGB", seed=3).quantize(16)
    image.info["transparency"] = 0
    assert_matches_reference(image, QWEN35)


def test_still_image_repeats_each_patch_over_the_temporal_frames():
    prepared = preprocess_image(random_image(64, 96), QWEN35)
    rows = prepared.pixel_values.view(-1, 3, 2, 16 * 16)
    assert torch.equal(rows[:, :, 0], rows[:, :, 1])
    assert prepared.pixel_values.shape == (prepared.grid_thw[1] * prepared.grid_thw[2], 3 * 2 * 16 * 16)


def test_smart_resize_equals_transformers_over_many_sizes():
    sizes = [1, 2, 3, 15, 16, 31, 32, 33, 47, 48, 63, 100, 255, 256, 257, 1000, 4095, 4096, 4097, 6000, 12000]
    for height in sizes:
        for width in sizes:
            if max(height, width) / min(height, width) > 200:
                continue
            for low, high in [(65536, 16777216), (3136, 12845056), (32 * 32, 128 * 128)]:
                assert smart_resize(height, width, 32, low, high) == hf_smart_resize(
                    height, width, factor=32, min_pixels=low, max_pixels=high), (height, width, low, high)


def test_smart_resize_rounds_halves_to_even_like_the_reference():
    # 48 / 32 = 1.5 rounds to 2 and 80 / 32 = 2.5 rounds to 2 (Python's round), then the area is in bounds.
    assert smart_resize(48, 80, 32, 1, 10**9) == (64, 64)


@pytest.mark.parametrize(("height", "width"), [(1, 201), (5000, 20), (0, 10), (10, 0)])
def test_smart_resize_refuses_extreme_or_empty_shapes(height, width):
    with pytest.raises(ValueError, match="aspect ratio|positive size"):
        smart_resize(height, width, 32, 65536, 16777216)


def test_extreme_aspect_ratio_is_a_media_error():
    with pytest.raises(MediaError, match="aspect ratio 250.0"):
        preprocess_image(Image.new("RGB", (1000, 4)), QWEN35)


def test_zero_size_image_is_a_media_error():
    with pytest.raises(MediaError, match="no pixels"):
        preprocess_image(Image.new("RGB", (0, 10)), QWEN35)


# --- configuration -------------------------------------------------------------------------------------

def test_config_reads_the_published_qwen35_files():
    assert QWEN35 == PreprocessConfig(
        patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=65536, max_pixels=16777216,
        video_min_pixels=4096, video_max_pixels=25165824, mean=(0.5,) * 3, std=(0.5,) * 3, rescale=1 / 255)
    assert QWEN35.factor == 32


def test_config_reads_the_older_min_max_pixels_keys():
    old = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    cfg = PreprocessConfig.from_preprocessor_config(old)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.factor) == (3136, 12845056, 14, 28)
    nested = PreprocessConfig.from_preprocessor_config({"size": {"min_pixels": 100, "max_pixels": 200}})
    assert (nested.min_pixels, nested.max_pixels) == (100, 200)
    # Top-level keys win over size, as in transformers.
    both = PreprocessConfig.from_preprocessor_config(
        {"size": {"shortest_edge": 1, "longest_edge": 2}, "min_pixels": 10, "max_pixels": 20})
    assert (both.min_pixels, both.max_pixels) == (10, 20)


def test_clip_normalisation_from_config_equals_transformers():
    cfg = PreprocessConfig.from_preprocessor_config({
        "min_pixels": 28 * 28, "max_pixels": 200 * 200, "patch_size": 14,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]})
    assert_matches_reference(random_image(321, 123, seed=11), cfg)


@pytest.mark.parametrize(("change", "message"), [
    ({"do_normalize": False}, "do_normalize=false"),
    ({"resample": 2}, "resample=2"),
    ({"patch_size": 0}, "patch_size must be a positive integer"),
    ({"size": {"shortest_edge": 500, "longest_edge": 100}}, "min_pixels 500 exceeds max_pixels 100"),
    ({"image_std": [0.5, 0.0, 0.5]}, "std must not contain 0"),
    ({"image_mean": [0.5, 0.5]}, "3 per-channel values"),
    ({"size": {"height": 224, "width": 224}}, "gives no pixel bounds"),
])
def test_config_refuses_what_it_cannot_honour(change, message):
    with pytest.raises(ValueError, match=message):
        PreprocessConfig.from_preprocessor_config({**QWEN35_IMAGE_CONFIG, **change})


def test_config_refuses_a_video_config_that_disagrees_on_the_encoder():
    with pytest.raises(ValueError, match="patch_size=14 differs"):
        PreprocessConfig.from_preprocessor_config(QWEN35_IMAGE_CONFIG, {**QWEN35_VIDEO_CONFIG, "patch_size": 14})


# --- decoding ----------------------------------------------------------------------------------------

def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def png_claiming_size(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims another size (its CRC fixed), as a decompression bomb would."""
    data = bytearray(encoded(Image.new("RGB", (1, 1))))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_decode_reads_common_formats_to_rgb(fmt):
    original = random_image(31, 17, seed=5)
    decoded = decode_image(encoded(original, fmt))
    assert decoded.mode == "RGB" and decoded.size == (31, 17)
    if fmt in ("PNG", "BMP"):
        assert np.array_equal(np.asarray(decoded), np.asarray(original))


def test_decode_composites_transparency_on_white():
    image = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert np.asarray(decode_image(encoded(image))).tolist() == [[[255, 255, 255]] * 4] * 4


def test_decode_applies_the_exif_orientation():
    image = random_image(30, 10, seed=9)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif.tobytes())
    assert decode_image(buffer.getvalue()).size == (10, 30)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "image data is empty"),
    (b"hello, world", "not in an image format"),
    (png_claiming_size(0, 5), "not a readable PNG image"),
    (b"%!PS-Adobe-3.0 EPSF-3.0\n", r"not in an image format ninfer reads \(PNG, JPEG, WebP, GIF or BMP\)"),
])
def test_undecodable_data_is_a_media_error(data, message):
    with pytest.raises(MediaError, match=message):
        decode_image(data)


def test_truncated_image_is_a_media_error():
    data = encoded(random_image(64, 64))
    with pytest.raises(MediaError, match="could not be decoded.*truncated"):
        decode_image(data[: len(data) // 2])


def test_too_many_pixels_is_refused_before_decoding():
    # The header claims 9000x9000 but the file holds one pixel: refusing from the header never decodes it.
    with pytest.raises(MediaError, match="9000x9000 = 81000000 pixels, more than the limit of 1000000"):
        decode_image(png_claiming_size(9000, 9000), max_pixels=1_000_000)
    with pytest.raises(MediaError, match="more than the limit of 100"):
        decode_image(encoded(random_image(20, 20)), max_pixels=100)


def test_decompression_bomb_is_a_media_error():
    with pytest.raises(MediaError, match="100000x100000 = 10000000000 pixels, more than the limit of 33554432"):
        decode_image(png_claiming_size(100_000, 100_000))


def test_decoded_image_preprocesses_like_the_reference():
    decoded = decode_image(encoded(random_image(123, 77, "RGBA", seed=2)))
    assert_matches_reference(decoded, QWEN35)


# --- video -------------------------------------------------------------------------------------------

def reference_frame(image: Image.Image, height: int, width: int, cfg: PreprocessConfig) -> np.ndarray:
    """One frame resized, rescaled and normalised by transformers' numpy transforms, [3, height, width]."""
    chw = np.moveaxis(np.asarray(image.convert("RGB")), -1, 0)
    frame = hf_resize(chw, (height, width), resample=PILImageResampling.BICUBIC,
                      input_data_format=ChannelDimension.FIRST)
    frame = hf_rescale(frame, cfg.rescale, input_data_format=ChannelDimension.FIRST)
    return hf_normalize(frame, list(cfg.mean), list(cfg.std), input_data_format=ChannelDimension.FIRST)


def test_video_smart_resize_hand_computed():
    # 3 frames of 64x96 at factor 32: sides stay 64 and 96; t rounds to 4 (round(1.5) = 2), and
    # 4 * 64 * 96 = 24576 lies in [4096, 25165824].
    assert smart_resize_video(3, 64, 96, temporal_factor=2, factor=32, min_pixels=4096,
                              max_pixels=25165824) == (64, 96)
    # Frames under the factor are first scaled up: 10x40 -> x3.2 -> 32x128.
    assert smart_resize_video(4, 10, 40, temporal_factor=2, factor=32, min_pixels=4096,
                              max_pixels=25165824) == (32, 128)
    # Over the bound: beta = sqrt(8 * 1000 * 1000 / 2_000_000) = 2, so 500 -> floor(15.625) * 32 = 480.
    assert smart_resize_video(8, 1000, 1000, temporal_factor=2, factor=32, min_pixels=4096,
                              max_pixels=2_000_000) == (480, 480)
    # Under the bound: beta = sqrt(65536 / (2 * 32 * 32)) = sqrt(32), 32 * 5.657 -> ceil(5.657) * 32 = 192.
    assert smart_resize_video(2, 32, 32, temporal_factor=2, factor=32, min_pixels=65536,
                              max_pixels=10**9) == (192, 192)


def test_video_patches_follow_the_reference_layout_with_the_last_frame_repeated():
    frames = [random_image(96, 64, seed=20 + i) for i in range(3)]
    prepared = preprocess_video(frames, QWEN35)
    assert prepared.grid_thw == (2, 4, 6)  # 3 frames padded to 4, 64/16 rows, 96/16 columns
    assert prepared.tokens == 12
    normalised = [reference_frame(frame, 64, 96, QWEN35) for frame in frames]
    normalised.append(normalised[-1])
    rows = prepared.pixel_values.numpy().reshape(-1, 3, 2, 16, 16)
    index = 0
    for t in range(2):
        for block_row in range(2):
            for block_col in range(3):
                for dy in range(2):
                    for dx in range(2):
                        y = (block_row * 2 + dy) * 16
                        x = (block_col * 2 + dx) * 16
                        for f in range(2):
                            np.testing.assert_array_equal(
                                rows[index, :, f], normalised[2 * t + f][:, y:y + 16, x:x + 16])
                        index += 1
    assert index == rows.shape[0]


def test_video_frame_cap_limits_each_frame():
    cfg = PreprocessConfig(cap_pixels_per_frame=True, max_video_tokens=4)
    # Per frame: max(min(4 * 32 * 32, 25165824 // 4), int(4096 * 1.05)) = 4300 pixels; 4 frames -> 17200.
    # 256x256 frames: beta = sqrt(4 * 65536 / 17200) = 3.904, 256 / 3.904 = 65.6 -> 64.
    prepared = preprocess_video([random_image(256, 256, seed=i) for i in range(4)], cfg)
    assert prepared.grid_thw == (2, 4, 4)


@pytest.mark.parametrize(("frames", "message"), [
    ([], "at least one frame"),
    ([Image.new("RGB", (64, 64))], "at least 2 frames"),
    ([Image.new("RGB", (64, 64)), Image.new("RGB", (64, 32))], "frame 1 is 64x32, frame 0 is 64x64"),
    ([Image.new("RGB", (64, 64)), Image.new("RGB", (0, 64))], "frame 1 has no pixels"),
])
def test_bad_videos_are_media_errors(frames, message):
    with pytest.raises(MediaError, match=message):
        preprocess_video(frames, QWEN35)
