"""Image and video preprocessing for the Qwen vision encoder: bytes to decoded image, then to patch rows.

The output reproduces the Hugging Face Qwen2-VL image processor (the one the Qwen3.5 processor uses for
images) and the Qwen3-VL video processor:

- a picture is converted to RGB (transparency composited on white), resized with PIL's bicubic filter to
  ``smart_resize``'s size (both sides multiples of patch_size * merge_size, the area within the pixel
  bounds), scaled by ``rescale`` in float64 and cast to float32, then normalised as (x - mean) / std in
  float32;
- the result is cut into patch_size x patch_size patches whose rows come in merge-block-major order (each
  merge_size x merge_size block of patches is contiguous, blocks row by row), each row laid out as
  [channel][frame][y][x] (3 * temporal_patch_size * patch_size**2 values), which is what the encoder's
  Conv3d patch embedding and its 2x2 merger expect;
- a still image is repeated to temporal_patch_size frames; a video's frame count is padded to a multiple
  of temporal_patch_size by repeating its last frame.

Reference implementations: transformers ships two image processors for Qwen2-VL. ``Qwen2VLImageProcessorPil``
(PIL/numpy, the "slow" one) resizes with PIL, as here, and its pixel values equal ours exactly (the tests
compare them with zero tolerance). ``Qwen2VLImageProcessor`` (the default "fast" one, torchvision) resizes
uint8 tensors with torchvision's antialiased bicubic and fuses rescale and normalisation into one float32
step; torchvision's and PIL's bicubic resampling are separate implementations, so their pixels can differ
slightly where the image is resized. The Qwen3-VL video processor always uses the torchvision path; our
video frames are resampled with PIL like images, so only the grid and layout follow it exactly. Encoded
media are planned from their headers and preprocessed by that plan in ``media_plan``: a JPEG at least twice
the size it is resized to is decoded at a reduced scale there, so its pixels differ slightly from a full
decode's; its grid does not (it comes from the header's size).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from PIL import Image

# Decoding (formats, the pixel bound before decoding) lives in image_decode; these names are read from here too.
from ninfer.models.common.qwen.image_decode import DEFAULT_MAX_DECODED_PIXELS as DEFAULT_MAX_DECODED_PIXELS
from ninfer.models.common.qwen.image_decode import MediaError as MediaError
from ninfer.models.common.qwen.image_decode import MediaOverLimit as MediaOverLimit
from ninfer.models.common.qwen.image_decode import decode_image as decode_image
from ninfer.models.common.qwen.image_decode import mapped_float32, to_rgb

# How far past the model's pixel bound a picture may be decoded, checked from its header: the model resizes a
# larger one down to ``max_pixels``, so pixels beyond it are decoded only to be thrown away. Twice leaves room
# for the sizes pictures come in (an 8K UHD frame, a 24 MP photo) without decoding far beyond what is used.
DECODE_SLACK = 2

# An aspect ratio above this is refused by the reference smart_resize.
MAX_ASPECT_RATIO = 200


def _positive_int(_instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _three_floats(value: Any) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        value = [value] * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"expected 3 per-channel values (R, G, B), got {len(values)}")
    return values  # type: ignore[return-value]


@attrs.frozen(kw_only=True)
class PreprocessConfig:
    """What the vision preprocessing needs from ``preprocessor_config.json`` and its video counterpart.

    Defaults are the published Qwen3.5 values. Pixel bounds are areas (height * width) of the resized
    picture; a video's bounds cover all its frames together (frames * height * width), as in the reference.
    """

    patch_size: int = attrs.field(default=16, validator=_positive_int)
    temporal_patch_size: int = attrs.field(default=2, validator=_positive_int)
    merge_size: int = attrs.field(default=2, validator=_positive_int)
    min_pixels: int = attrs.field(default=65536, validator=_positive_int)
    max_pixels: int = attrs.field(default=16777216, validator=_positive_int)
    video_min_pixels: int = attrs.field(default=4096, validator=_positive_int)
    video_max_pixels: int = attrs.field(default=25165824, validator=_positive_int)
    # The Qwen3-VL video processor's optional per-frame cap (qwen-vl-utils behaviour); off by default there.
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = attrs.field(default=768, validator=_positive_int)
    mean: tuple[float, float, float] = attrs.field(default=(0.5, 0.5, 0.5), converter=_three_floats)
    std: tuple[float, float, float] = attrs.field(default=(0.5, 0.5, 0.5), converter=_three_floats)
    rescale: float = attrs.field(default=1 / 255, converter=float)

    def __attrs_post_init__(self) -> None:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
        if self.video_min_pixels > self.video_max_pixels:
            raise ValueError(
                f"video min_pixels {self.video_min_pixels} exceeds video max_pixels {self.video_max_pixels}")
        if any(s == 0 for s in self.std):
            raise ValueError(f"std must not contain 0, got {self.std}")
        if not self.rescale > 0:
            raise ValueError(f"rescale must be positive, got {self.rescale}")

    @property
    def max_decoded_pixels(self) -> int:
        """The default bound on one decoded image or video frame: ``DECODE_SLACK`` times ``max_pixels``."""
        return DECODE_SLACK * self.max_pixels

    @property
    def pixel_bytes_per_token(self) -> int:
        """Bytes of float32 pixel rows behind one placeholder token: merge_size² patch rows of 3 x
        temporal_patch_size x patch_size² values (24 KiB for Qwen3.5)."""
        return self.merge_size ** 2 * 3 * self.temporal_patch_size * self.patch_size ** 2 * 4

    @property
    def factor(self) -> int:
        """The side length, in pixels, that resized images are multiples of (one merge block)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(
        cls, image: Mapping[str, Any], video: Mapping[str, Any] | None = None,
    ) -> PreprocessConfig:
        """Read ``preprocessor_config.json`` (and ``video_preprocessor_config.json`` when present).

        Pixel bounds come from ``size: {shortest_edge, longest_edge}`` (or an older ``size: {min_pixels,
        max_pixels}``); top-level ``min_pixels`` / ``max_pixels`` keys override them, as in transformers.
        Keys that are absent keep the published Qwen3.5 values. Steps ninfer does not implement
        (``do_resize`` / ``do_rescale`` / ``do_normalize`` / ``do_convert_rgb`` false, a resampling filter
        other than bicubic) and a video config that disagrees with the image config on the shared
        encoder settings are refused with a ValueError.
        """
        _refuse_unsupported(image, "preprocessor_config")
        image_min, image_max = _pixel_bounds(image, "preprocessor_config")
        fields: dict[str, Any] = {
            name: image[key] for name, key in _SHARED_KEYS.items() if key in image}
        if image_min is not None:
            fields["min_pixels"] = image_min
        if image_max is not None:
            fields["max_pixels"] = image_max
        if video is not None:
            _refuse_unsupported(video, "video_preprocessor_config")
            for name, key in _SHARED_KEYS.items():
                if key in video and name in fields and _normalised(video[key]) != _normalised(fields[name]):
                    raise ValueError(
                        f"video_preprocessor_config {key}={video[key]!r} differs from preprocessor_config's "
                        f"{fields[name]!r}; the encoder takes one value")
                if key in video:
                    fields[name] = video[key]
            video_min, video_max = _pixel_bounds(video, "video_preprocessor_config")
            if video_min is not None:
                fields["video_min_pixels"] = video_min
            if video_max is not None:
                fields["video_max_pixels"] = video_max
            if video.get("cap_pixels_per_frame") is not None:
                fields["cap_pixels_per_frame"] = bool(video["cap_pixels_per_frame"])
            if "max_video_tokens" in video:
                fields["max_video_tokens"] = video["max_video_tokens"]
        return cls(**fields)


# PreprocessConfig field -> preprocessor_config.json key, for settings images and videos share.
_SHARED_KEYS = {
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "merge_size",
    "mean": "image_mean",
    "std": "image_std",
    "rescale": "rescale_factor",
}

_BICUBIC = int(Image.Resampling.BICUBIC)


def _normalised(value: Any) -> Any:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else value


def _refuse_unsupported(config: Mapping[str, Any], name: str) -> None:
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if config.get(flag) is False:
            raise ValueError(f"{name} sets {flag}=false, which ninfer's vision preprocessing does not support")
    resample = config.get("resample")
    if resample is not None and resample != _BICUBIC:
        raise ValueError(f"{name} asks for resample={resample!r}; ninfer resizes with bicubic ({_BICUBIC}) only")


def _pixel_bounds(config: Mapping[str, Any], name: str) -> tuple[int | None, int | None]:
    size = config.get("size") or {}
    if not isinstance(size, Mapping):
        raise ValueError(f"{name} size must be an object, got {size!r}")
    if size and not {"shortest_edge", "longest_edge", "min_pixels", "max_pixels"} & size.keys():
        raise ValueError(f"{name} size {dict(size)!r} gives no pixel bounds (shortest_edge / longest_edge)")
    low = size.get("shortest_edge", size.get("min_pixels"))
    high = size.get("longest_edge", size.get("max_pixels"))
    if config.get("min_pixels") is not None:
        low = config["min_pixels"]
    if config.get("max_pixels") is not None:
        high = config["max_pixels"]
    return low, high


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) a picture is resized to: multiples of ``factor``, area within the bounds.

    Each side is rounded to the nearest multiple of ``factor`` (Python's round: halves go to even); if the
    area then exceeds ``max_pixels`` both sides are scaled down by the same ratio and floored (never below
    ``factor``), and if it is under ``min_pixels`` they are scaled up and ceiled. Aspect ratios above 200
    are refused, as in the reference.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"an image needs a positive size, got {width}x{height} (width x height)")
    _check_aspect(height, width, "image")
    return _fit(height, width, factor, min_pixels, max_pixels)


def smart_resize_video(
    num_frames: int, height: int, width: int, *, temporal_factor: int, factor: int,
    min_pixels: int, max_pixels: int,
) -> tuple[int, int]:
    """The Qwen3-VL video processor's frame size: like ``smart_resize`` with the bounds over all frames.

    Frames smaller than ``factor`` on a side are first scaled up (truncating) until both sides reach it;
    a video needs at least ``temporal_factor`` frames.
    """
    if num_frames < temporal_factor:
        raise ValueError(f"a video needs at least {temporal_factor} frames, got {num_frames}")
    if height <= 0 or width <= 0:
        raise ValueError(f"video frames need a positive size, got {width}x{height} (width x height)")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width, "video")
    return _fit(height, width, factor, min_pixels, max_pixels, frames=num_frames,
                rounded_frames=round(num_frames / temporal_factor) * temporal_factor)


def _check_aspect(height: int, width: int, what: str) -> None:
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"{what} aspect ratio {ratio:.1f} ({width}x{height}) exceeds the limit of {MAX_ASPECT_RATIO}")


def _fit(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, *, frames: int = 1,
         rounded_frames: int = 1) -> tuple[int, int]:
    """Both sides rounded to multiples of ``factor``, then scaled (floored / ceiled) into the bounds on the area
    over ``rounded_frames`` frames, the scale taken from the ``frames`` frames' unrounded area."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if rounded_frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif rounded_frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@attrs.frozen(kw_only=True, eq=False)
class PreparedVision:
    """One image's or video's encoder input: patch rows, the patch grid and its LM token count."""

    pixel_values: torch.Tensor  # float32 [t*h*w, 3 * temporal_patch_size * patch_size**2]
    grid_thw: tuple[int, int, int]  # in patches: frames / temporal_patch_size, rows, columns
    tokens: int  # placeholder tokens in the prompt: t*h*w / merge_size**2


def image_size(height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int]:
    """The (height, width) a picture of this size is resized to (``smart_resize``); MediaError for an unusable
    shape (an aspect ratio over 200)."""
    try:
        return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ValueError as exc:
        raise MediaError(str(exc)) from exc


def video_size(count: int, height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int]:
    """The (height, width) the ``count`` frames of a video of this frame size are resized to; MediaError for
    an unusable video (no frames, fewer than temporal_patch_size, an aspect ratio over 200)."""
    if not count:
        raise MediaError("a video needs at least one frame")
    max_pixels = cfg.video_max_pixels
    if cfg.cap_pixels_per_frame:
        # The reference's optional cap: a frame costs at most max_video_tokens merge blocks or an even share.
        per_frame = max(min(cfg.max_video_tokens * cfg.factor ** 2, cfg.video_max_pixels // count),
                        int(cfg.video_min_pixels * 1.05))
        max_pixels = per_frame * count
    try:
        return smart_resize_video(count, height, width, temporal_factor=cfg.temporal_patch_size, factor=cfg.factor,
                                  min_pixels=cfg.video_min_pixels, max_pixels=max_pixels)
    except ValueError as exc:
        raise MediaError(str(exc)) from exc


def vision_grid(frames: int, size: tuple[int, int], cfg: PreprocessConfig) -> tuple[int, int, int]:
    """The patch grid (t, h, w) of ``frames`` frames (1 for an image) resized to ``size`` (height, width): the
    frames padded to a multiple of temporal_patch_size, the sides cut into patch_size patches."""
    temporal = -(-frames // cfg.temporal_patch_size)
    return temporal, size[0] // cfg.patch_size, size[1] // cfg.patch_size


def preprocess_image(image: Image.Image, cfg: PreprocessConfig, *, size: tuple[int, int] | None = None
                     ) -> PreparedVision:
    """Resize, normalise and patchify one picture (repeated to ``temporal_patch_size`` frames). ``size``: the
    (height, width) to resize to (default: ``image_size`` of the picture's own size)."""
    new_height, new_width = image_size(*_checked_size(image, "image"), cfg) if size is None else size
    frame = _normalised_frame(image, new_height, new_width, cfg)
    frames = np.broadcast_to(frame, (cfg.temporal_patch_size, *frame.shape))
    return _patchify(frames, cfg)


def preprocess_video(frames: Sequence[Image.Image], cfg: PreprocessConfig) -> PreparedVision:
    """Resize, normalise and patchify a video's sampled frames, all of one size, in order."""
    return frames_to_vision(len(frames), frames.__getitem__, cfg)


def frames_to_vision(count: int, frame_at: Callable[[int], Image.Image], cfg: PreprocessConfig, *,
                     resize: Callable[[int, int], tuple[int, int]] | None = None) -> PreparedVision:
    """The frames ``frame_at(0 .. count - 1)``, taken one at a time, resized to one size: ``resize(height,
    width)`` of frame 0 (default: ``video_size`` of it and the count). Every frame must have frame 0's size."""
    if not count:
        raise MediaError("a video needs at least one frame")
    first = frame_at(0)
    height, width = _checked_size(first, "video frame 0")
    new_height, new_width = video_size(count, height, width, cfg) if resize is None else resize(height, width)
    padded = count + (-count % cfg.temporal_patch_size)  # the last frame repeats to fill the temporal patch
    stacked = mapped_float32((padded, 3, new_height, new_width))
    stacked[0] = _normalised_frame(first, new_height, new_width, cfg)
    del first
    for index in range(1, count):
        frame = frame_at(index)
        if _checked_size(frame, f"video frame {index}") != (height, width):
            raise MediaError(
                f"video frame {index} is {frame.width}x{frame.height}, frame 0 is {width}x{height}; "
                "all frames of a video must have one size")
        stacked[index] = _normalised_frame(frame, new_height, new_width, cfg)
    stacked[count:] = stacked[count - 1]
    return _patchify(stacked, cfg)


def _checked_size(image: Image.Image, what: str) -> tuple[int, int]:
    if image.width <= 0 or image.height <= 0:
        raise MediaError(f"{what} has no pixels ({image.width}x{image.height})")
    return image.height, image.width


def _normalised_frame(image: Image.Image, height: int, width: int, cfg: PreprocessConfig) -> np.ndarray:
    """[3, height, width] float32: RGB, bicubic-resized, then each byte mapped through ``_value_table``."""
    resized = np.asarray(to_rgb(image).resize((width, height), resample=Image.Resampling.BICUBIC))
    table = _value_table(cfg)
    out = mapped_float32((3, height, width))
    for channel in range(3):
        np.take(table[channel], resized[:, :, channel], out=out[channel])
    return out


def _value_table(cfg: PreprocessConfig) -> np.ndarray:
    """[3, 256] float32: the normalised value of each byte per channel, computed as the reference does
    (x * rescale in float64, cast to float32, then (x - mean) / std in float32). A lookup gives the same
    bits without a float64 copy of the whole picture."""
    scaled = (np.arange(256, dtype=np.float64) * cfg.rescale).astype(np.float32)
    mean = np.asarray(cfg.mean, dtype=np.float32)[:, None]
    std = np.asarray(cfg.std, dtype=np.float32)[:, None]
    return (scaled[None, :] - mean) / std


def _patchify(frames: np.ndarray, cfg: PreprocessConfig) -> PreparedVision:
    """[F, C, H, W] (F a multiple of temporal_patch_size) -> merge-block-major patch rows [C][T][y][x]."""
    num_frames, channels, height, width = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_t, grid_h, grid_w = num_frames // tp, height // p, width // p
    blocks = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    # -> (t, block row, block col, row in block, col in block, channel, frame, y, x)
    out = mapped_float32((grid_t, grid_h // m, grid_w // m, m, m, channels, tp, p, p))
    np.copyto(out, blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8))
    return PreparedVision(
        pixel_values=torch.from_numpy(out.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)),
        grid_thw=(grid_t, grid_h, grid_w),
        tokens=grid_t * grid_h * grid_w // (m * m),
    )
