"""Where a chat's images and videos sit in its prompt: media parts, video timestamps, placeholder expansion.

The Qwen3.5 prompt format (the Qwen3-VL processor's):

- the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` for an image part; its pad becomes
  t·h·w/4 ``<|image_pad|>`` tokens (grid in encoder patches): one ``MediaSpan``;
- a video part's ``<|vision_start|><|video_pad|><|vision_end|>`` becomes, for each temporal patch group g,
  ``<{time:.1f} seconds><|vision_start|>`` + h·w/4 ``<|video_pad|>`` + ``<|vision_end|>``: one span per group,
  grid (1, h, w), ``offset`` g·h·w/4. Frame i of a video sampled at ``fps`` is at i / fps; the frame count is
  padded to a multiple of the temporal patch size with the last frame, and a group's time is the mean of its
  first and last frame's. The template's own start/end pair is replaced, as the original Qwen3-VL processor and
  vLLM do (transformers 5's processor replaces the pad alone and keeps an outer pair).

Expansion has two steps. The rendered text is rewritten first, with one pad per image and per frame group: a
timestamp must be tokenized together with the text before it, as the reference tokenizes the expanded text.
Once the items are preprocessed, each pad token widens to its run on the token ids (a run of one special token
needs no tokenizer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ninfer.contract.prompt import MediaItem, MediaSpan
from ninfer.models.common.qwen.errors import FrontendInputError

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# Frames per second of a video whose MediaItem gives none: the rate Qwen's video pipeline samples at.
DEFAULT_VIDEO_FPS = 2.0

MediaKind = Literal["image", "video"]


class MediaInputError(FrontendInputError):
    """A request's media cannot be used: undecodable, of unusable shape, or not matching its messages."""

    kind = "invalid_media"


class MediaTooLarge(MediaInputError):
    """A media item exceeds a limit (encoded bytes, decoded pixels, frames)."""

    kind = "media_too_large"


class VisionNotEnabled(FrontendInputError):
    """The request carries media, but this model runs without the vision feature."""

    kind = "vision_not_enabled"


def media_part_kind(part: Any) -> MediaKind | None:
    """Whether a content part is an image or a video, read as the Qwen templates read it (a ``type`` of
    image / image_url, or such a key; likewise video / video_url)."""
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind in ("image", "image_url") or "image" in part or "image_url" in part:
        return "image"
    if kind in ("video", "video_url") or "video" in part or "video_url" in part:
        return "video"
    return None


def canonical_media_parts(messages: Sequence[Any]) -> tuple[list[Any], list[MediaKind]]:
    """The messages with each media part replaced by ``{"type": "image"}`` / ``{"type": "video"}`` (what every
    Qwen template renders as a placeholder; the bytes travel in ``ChatInput.media``), and the parts' kinds in
    message order. Messages without media parts are passed on as they are."""
    out: list[Any] = []
    kinds: list[MediaKind] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list | tuple):
            out.append(message)
            continue
        parts = []
        changed = False
        for part in content:
            kind = media_part_kind(part)
            if kind is not None:
                kinds.append(kind)
                part, changed = {"type": kind}, True
            parts.append(part)
        out.append({**message, "content": parts} if changed else message)
    return out, kinds


def check_media_parts(kinds: Sequence[MediaKind], media: Sequence[MediaItem]) -> None:
    """The n-th media part of the messages must be ``media[n]``, of the same kind."""
    for index, (kind, item) in enumerate(zip(kinds, media, strict=False)):
        if kind != item.kind:
            raise MediaInputError(f"media part {index} of the messages is {_a(kind)}, but media item {index} is "
                                  f"{_a(item.kind)}")
    if len(kinds) > len(media):
        raise MediaInputError(f"the messages have {len(kinds)} image/video parts but the request carries "
                              f"{len(media)} media items: part {len(media)} ({_a(kinds[len(media)])}) has none")
    if len(kinds) < len(media):
        raise MediaInputError(f"the request carries {len(media)} media items but the messages have "
                              f"{len(kinds)} image/video parts: media item {len(kinds)} has no place in them")


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "image" else f"a {kind}"


def group_times(frames: int, fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch group of ``frames`` frames sampled at ``fps``: the mean of the times of
    the group's first and last frame, the frame count padded with the last frame."""
    indices = list(range(frames)) + [frames - 1] * (-frames % temporal_patch_size)
    return [(indices[i] / fps + indices[i + temporal_patch_size - 1] / fps) / 2
            for i in range(0, len(indices), temporal_patch_size)]


def video_prompt_text(item: MediaItem, temporal_patch_size: int) -> str:
    """The text a video's placeholder becomes before widening: per group its timestamp and one pad."""
    fps = DEFAULT_VIDEO_FPS if item.fps is None else item.fps
    return "".join(f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD}{VISION_END}"
                   for t in group_times(len(item.frames), fps, temporal_patch_size))


_PLACEHOLDER = re.compile("|".join(re.escape(s) for s in (VISION_START + VIDEO_PAD + VISION_END, VIDEO_PAD,
                                                           IMAGE_PAD)))


def rewrite_placeholders(text: str, media: Sequence[MediaItem], temporal_patch_size: int) -> str:
    """The rendered text with each video placeholder replaced by its timestamped groups (see the module
    docstring). The placeholders must be exactly the media items, in order and kind."""
    found = 0
    pieces: list[str] = []
    last = 0
    for match in _PLACEHOLDER.finditer(text):
        kind = "image" if match.group() == IMAGE_PAD else "video"
        if found < len(media) and media[found].kind != kind:
            raise MediaInputError(f"the rendered conversation holds {_a(kind)} placeholder where media item "
                                  f"{found} ({_a(media[found].kind)}) belongs")
        if kind == "video" and found < len(media):
            pieces.append(text[last:match.start()])
            pieces.append(video_prompt_text(media[found], temporal_patch_size))
            last = match.end()
        found += 1
    if found != len(media):
        raise MediaInputError(f"the rendered conversation holds {found} image/video placeholders for {len(media)} "
                              "media items (the template must render each media part as one)")
    pieces.append(text[last:])
    return "".join(pieces)


def placeholder_runs(ids: Sequence[int], *, image_pad: int, video_pad: int,
                     grids: Sequence[tuple[MediaKind, tuple[int, int, int]]], merge_size: int
                     ) -> tuple[list[int], list[MediaSpan]]:
    """Widen each pad token of ``ids`` (one per image and per video frame group, in media order) to its run of
    t·h·w / merge² (image) or h·w / merge² (video group) tokens; the MediaSpans say where each run lies."""
    out: list[int] = []
    spans: list[MediaSpan] = []
    item = group = last = 0
    for position, token in enumerate(ids):
        if token != image_pad and token != video_pad:
            continue
        kind = "image" if token == image_pad else "video"
        if item >= len(grids) or grids[item][0] != kind:
            raise MediaInputError(f"the prompt holds {_a(kind)} placeholder where media item {item} does not "
                                  "belong")
        t, h, w = grids[item][1]
        out.extend(ids[last:position])
        last = position + 1
        if kind == "image":
            length = t * h * w // merge_size ** 2
            spans.append(MediaSpan(item_index=item, start=len(out), length=length, grid_thw=(t, h, w)))
            item += 1
        else:
            length = h * w // merge_size ** 2
            spans.append(MediaSpan(item_index=item, start=len(out), length=length, grid_thw=(1, h, w),
                                   offset=group * length))
            group += 1
            if group == t:
                item, group = item + 1, 0
        out.extend([token] * length)
    out.extend(ids[last:])
    if item != len(grids):
        raise MediaInputError(f"the prompt holds placeholders for {item} of {len(grids)} media items")
    return out, spans


def expanded_length(ids_length: int, pads: int, grids: Sequence[tuple[MediaKind, tuple[int, int, int]]],
                    merge_size: int) -> int:
    """The prompt's length once its ``pads`` pad tokens are widened (``placeholder_runs``)."""
    return ids_length - pads + sum(t * h * w for _, (t, h, w) in grids) // merge_size ** 2


def fewest_media_tokens(media: Sequence[MediaItem], *, min_image_pixels: int, factor: int) -> int:
    """Placeholder tokens the media take at the least, beyond the one pad per image or group the rewritten text
    holds: an image is resized to at least ``min_image_pixels``, a token per ``factor``² pixels."""
    images = sum(1 for item in media if item.kind == "image")
    return images * (math.ceil(min_image_pixels / factor ** 2) - 1)


def check_prepared_media(ids: Sequence[int], spans: Sequence[MediaSpan], vision: Sequence[Any], *, image_pad: int,
                         video_pad: int, merge_size: int) -> None:
    """MediaInputError unless each span of a given PreparedPrompt lies on its item's pad tokens, within the
    prompt, and within its item's encoder rows (what the Program relies on)."""
    for index, span in enumerate(spans):
        where = f"media_spans[{index}]"
        if not 0 <= span.item_index < len(vision):
            raise MediaInputError(f"{where} names media item {span.item_index}, the prompt has {len(vision)}")
        item = vision[span.item_index]
        t, h, w = span.grid_thw
        if min(span.grid_thw) <= 0 or span.length != t * h * w // merge_size ** 2 or span.length <= 0:
            raise MediaInputError(f"{where} has {span.length} tokens for grid {span.grid_thw}")
        if span.start < 0 or span.start + span.length > len(ids):
            raise MediaInputError(f"{where} lies outside the prompt's {len(ids)} tokens")
        if span.offset < 0 or span.offset + span.length > item.embedding_rows:
            raise MediaInputError(f"{where} takes rows past the {item.embedding_rows} of media item {span.item_index}")
        pad = image_pad if item.kind == "image" else video_pad
        if any(token != pad for token in ids[span.start:span.start + span.length]):
            raise MediaInputError(f"{where} covers tokens other than its {item.kind}'s placeholder")
