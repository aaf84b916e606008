"""Which chat content parts carry media, and where each item's URLs are: ``MediaSource``s in request order.

The forms accepted (docs/serving.md, "Images and videos"):

- an image: ``{"type": "image_url", "image_url": {"url": U}}`` (OpenAI; ``"image_url": U`` too, and the same
  with ``"type": "input_image"``), or ``{"type": "image", "image": U}`` (Qwen's form);
- a video, as its sampled frames in time order: ``{"type": "video_url", "video_url": {"url": [U, ...],
  "fps": F}}``, or ``{"type": "video", "video": [U, ...], "fps": F}`` (Qwen's form). A single URL (a video
  file) is refused: choosing frames from a video file is the client's.

Messages and parts are walked in order, the same order ``translate`` puts the ``{"type": "image"}`` /
``{"type": "video"}`` parts in, so the n-th source is the n-th media part of the ChatInput.
"""

from __future__ import annotations

from typing import Literal

import attrs

from ninfer_serve.errors import APIError, bad_request
from ninfer_serve.schemas import ChatCompletionRequest, ContentPart, ImageURL

IMAGE_PARTS = ("image_url", "input_image", "image")
VIDEO_PARTS = ("video_url", "video")
# The fields each part type carries; any other field set on a part is refused rather than ignored.
_OWN_FIELDS = {"text": ("text",), "image_url": ("image_url",), "input_image": ("image_url",), "image": ("image",),
               "video_url": ("video_url",), "video": ("video", "fps"), "input_audio": ("input_audio",),
               "file": ("file",)}


@attrs.frozen(kw_only=True)
class MediaSource:
    """One image (one URL) or video (its frames' URLs) to acquire; ``param`` is where its URLs sit in the body."""

    kind: Literal["image", "video"]
    urls: tuple[str, ...]
    param: str
    fps: float | None = None


def media_kind(part: ContentPart) -> Literal["image", "video"] | None:
    if part.type in IMAGE_PARTS:
        return "image"
    if part.type in VIDEO_PARTS:
        return "video"
    return None


def check_part_fields(part: ContentPart, where: str) -> None:
    """A field that belongs to another type of part (``text`` on an image part) is a 400, not ignored."""
    for field in attrs.fields(ContentPart):
        if field.name != "type" and getattr(part, field.name) is not None and \
                field.name not in _OWN_FIELDS[part.type]:
            raise bad_request(f"{where}: '{field.name}' does not belong in a content part of type '{part.type}'",
                              param=f"{where}.{field.name}")


def first_media_part(req: ChatCompletionRequest) -> str | None:
    """The path of the request's first media part (None: the request carries no media)."""
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if media_kind(part) is not None:
                    return f"messages[{i}].content[{j}]"
    return None


def media_sources(req: ChatCompletionRequest, *, max_items: int, max_frames: int) -> tuple[MediaSource, ...]:
    """Every media part's source, in order; a malformed part, more than ``max_items`` items or a video of more
    than ``max_frames`` frames is a 400 naming the parameter."""
    sources: list[MediaSource] = []
    for i, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            kind = media_kind(part)
            if kind == "image":
                sources.append(_image(part, where))
            elif kind == "video":
                sources.append(_video(part, where, max_frames))
    if len(sources) > max_items:
        raise APIError(400, f"the request carries {len(sources)} images and videos; this server takes at most "
                            f"{max_items} per request (--media-max-items)", param="messages", code="too_many_media")
    return tuple(sources)


def _missing(part: ContentPart, where: str, field: str) -> APIError:
    return bad_request(f"{where}: a content part of type '{part.type}' needs '{field}'", param=f"{where}.{field}")


def _image(part: ContentPart, where: str) -> MediaSource:
    if part.type == "image":
        url, param = part.image, f"{where}.image"
        if url is None:
            raise _missing(part, where, "image")
    else:
        value = part.image_url
        if value is None:
            raise _missing(part, where, "image_url")
        if isinstance(value, ImageURL):
            if value.detail not in (None, "auto"):
                raise bad_request(f"'detail' is not supported by this server (only 'auto' is accepted), got "
                                  f"'{value.detail}'", param=f"{where}.image_url.detail")
            url, param = value.url, f"{where}.image_url.url"
        else:
            url, param = value, f"{where}.image_url"
    if not url:
        raise bad_request(f"{param}: the image URL is empty", param=param, code="invalid_media")
    return MediaSource(kind="image", urls=(url,), param=param)


def _video(part: ContentPart, where: str, max_frames: int) -> MediaSource:
    if part.type == "video_url":
        if part.video_url is None:
            raise _missing(part, where, "video_url")
        urls, fps = part.video_url.url, part.video_url.fps
        param, fps_param = f"{where}.video_url.url", f"{where}.video_url.fps"
    else:
        if part.video is None:
            raise _missing(part, where, "video")
        urls, fps, param, fps_param = part.video, part.fps, f"{where}.video", f"{where}.fps"
    if isinstance(urls, str):
        raise bad_request(f"{param}: a video is sent as its sampled frames, a list of image URLs in time order "
                          "(this server does not decode video files)", param=param, code="invalid_media")
    if not urls:
        raise bad_request(f"{param}: a video needs at least one frame", param=param, code="invalid_media")
    if len(urls) > max_frames:
        raise bad_request(f"{param}: the video has {len(urls)} frames; this server takes at most {max_frames} "
                          "(--media-max-frames)", param=param, code="media_too_large")
    empty = next((k for k, u in enumerate(urls) if not u), None)
    if empty is not None:
        raise bad_request(f"{param}[{empty}]: the frame URL is empty", param=f"{param}[{empty}]",
                          code="invalid_media")
    if fps is not None and not fps > 0:
        raise bad_request(f"'fps' must be > 0, got {fps}", param=fps_param)
    return MediaSource(kind="video", urls=tuple(urls), param=param, fps=fps)
