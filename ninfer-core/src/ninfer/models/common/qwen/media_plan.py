"""MediaPlan: what an encoded image or video becomes, read from its headers alone, then preprocessing by the plan.

A plan is made before any pixel is decoded: each picture's header (every frame of a video) is opened, its format
checked, its size as decoded checked against the pixel bound (a JPEG at the reduced scale it will decode at), and
the size it is resized to computed with the preprocessor's own ``smart_resize`` arithmetic on the header's size.
The plan's grid is the grid the decoded item gets, so the Frontend knows the prompt's exact length, and refuses
a prompt longer than the context, without decoding anything.

The header's size is the picture as displayed where the header says so (a JPEG's EXIF orientation, in its
header). A PNG may carry its EXIF block after the pixel data; its orientation is then found only while decoding,
and a quarter turn gives the transposed size. ``smart_resize`` treats both sides alike, so the transposed
picture is resized to the plan's size transposed: the same token count, the same grid the decoded picture
would give on its own. A JPEG decoded at reduced scale is resized to the plan's size, computed from the full
size in its header, as the reference computes it from the full picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
from PIL import Image, JpegImagePlugin

from ninfer.models.common.qwen.image_decode import (
    DEFAULT_MAX_DECODED_PIXELS,
    MediaError,
    check_pixels,
    decode_image,
    open_image,
    oriented_size,
    reduce_jpeg_scale,
)
from ninfer.models.common.qwen.vision_preprocess import (
    PreparedVision,
    PreprocessConfig,
    frames_to_vision,
    image_size,
    preprocess_image,
    video_size,
    vision_grid,
)


@attrs.frozen(kw_only=True)
class MediaPlan:
    """An image's or video's shape before decoding: ``source`` (height, width) of its pictures as the header
    gives them (frame 0 of a video), ``size`` (height, width) they are resized to, ``frames`` (1 for an image),
    and the patch grid and placeholder-token count that follow."""

    kind: Literal["image", "video"]
    source: tuple[int, int]
    size: tuple[int, int]
    frames: int
    grid_thw: tuple[int, int, int]
    tokens: int

    def size_for(self, height: int, width: int) -> tuple[int, int]:
        """The size to resize a decoded picture of ``height`` x ``width`` to: the plan's, transposed for a
        picture whose orientation turned out a quarter turn from its header's (see the module docstring)."""
        if (width, height) == self.source != (height, width):
            return self.size[1], self.size[0]
        return self.size


def _plan(kind: Literal["image", "video"], source: tuple[int, int], size: tuple[int, int], frames: int,
          cfg: PreprocessConfig) -> MediaPlan:
    grid = vision_grid(frames, size, cfg)
    return MediaPlan(kind=kind, source=source, size=size, frames=frames, grid_thw=grid,
                     tokens=grid[0] * grid[1] * grid[2] // cfg.merge_size ** 2)


def _header(data: bytes, cfg: PreprocessConfig | None, max_pixels: int
            ) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(height, width) of the picture in ``data`` as displayed, from its header, and with a ``cfg`` the size it
    is resized to (an image's). MediaOverLimit when its size as decoded exceeds ``max_pixels``: a JPEG's at the
    reduced scale it will decode at, known once the resized size is."""
    header = open_image(data)
    try:
        jpeg = isinstance(header, JpegImagePlugin.JpegImageFile)
        if not jpeg:
            check_pixels(*header.size, max_pixels)
        width, height = oriented_size(header)
        size = None if cfg is None else image_size(height, width, cfg)
        if jpeg:
            if size is not None:
                reduce_jpeg_scale(header, (size[1], size[0]))  # header.size becomes the size it decodes at
            check_pixels(*header.size, max_pixels)
    finally:
        header.close()
    return (height, width), size


def plan_image(data: bytes, cfg: PreprocessConfig, *, max_pixels: int = DEFAULT_MAX_DECODED_PIXELS) -> MediaPlan:
    """The plan of image bytes: MediaError for bytes of another format or an unusable shape, MediaOverLimit over
    ``max_pixels`` as decoded. Nothing is decoded."""
    source, size = _header(data, cfg, max_pixels)
    return _plan("image", source, size, 1, cfg)


def plan_video(frames: Sequence[bytes], cfg: PreprocessConfig, *, max_pixels: int = DEFAULT_MAX_DECODED_PIXELS
               ) -> MediaPlan:
    """The plan of a video's encoded frames: every frame's header is read (format, pixel bound, one size for
    all); MediaError naming the frame otherwise. Nothing is decoded."""
    if not frames:
        raise MediaError("a video needs at least one frame")
    source = None
    for index, data in enumerate(frames):
        try:
            shape, _ = _header(data, None, max_pixels)
        except MediaError as exc:
            raise type(exc)(f"video frame {index}: {exc}") from exc
        if source is None:
            source = shape
        elif shape != source:
            raise MediaError(f"video frame {index} is {shape[1]}x{shape[0]}, frame 0 is {source[1]}x{source[0]}; "
                             "all frames of a video must have one size")
    return _plan("video", source, video_size(len(frames), *source, cfg), len(frames), cfg)


def preprocess_encoded_image(data: bytes, cfg: PreprocessConfig, *, max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
                             plan: MediaPlan | None = None) -> PreparedVision:
    """``preprocess_image`` of image bytes, by their ``plan`` (made here when not given): a JPEG is decoded no
    larger than needed for the plan's size (``decode_image``'s reduced scale); the decoded picture is dropped
    as soon as its rows are made. The result's token count is the plan's."""
    plan = plan_image(data, cfg, max_pixels=max_pixels) if plan is None else plan
    image = decode_image(data, max_pixels=max_pixels, at_least=(plan.size[1], plan.size[0]))
    try:
        return preprocess_image(image, cfg, size=plan.size_for(image.height, image.width))
    finally:
        image.close()


def preprocess_encoded_video(frames: Sequence[bytes], cfg: PreprocessConfig, *,
                             max_pixels: int = DEFAULT_MAX_DECODED_PIXELS, plan: MediaPlan | None = None
                             ) -> PreparedVision:
    """``preprocess_video`` of encoded frames by their ``plan`` (made here when not given), decoding one frame at
    a time: besides the output only one decoded frame is held, however many frames there are."""
    plan = plan_video(frames, cfg, max_pixels=max_pixels) if plan is None else plan

    def frame(index: int) -> Image.Image:
        try:
            return decode_image(frames[index], max_pixels=max_pixels)
        except MediaError as exc:
            raise type(exc)(f"video frame {index}: {exc}") from exc

    return frames_to_vision(len(frames), frame, cfg, resize=plan.size_for)
