"""Public owning input and the PreparedPrompt a Frontend builds from it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

from ninfer.contract._validate import token_ids
from ninfer.contract.values import JSONObject

if TYPE_CHECKING:
    import torch


@attrs.frozen(kw_only=True)
class MediaItem:
    """One image or video a request carries, as acquired bytes (decoding belongs to the Frontend).

    An image is its encoded file in ``data``. A video is its sampled frames in ``frames`` (each an encoded image,
    in time order; choosing frames from a video file is the caller's), taken at ``fps`` frames per second: the
    Qwen3.5 prompt puts each frame group's timestamp before it (None: the Frontend's default rate).
    """

    kind: Literal["image", "video"]
    data: bytes = attrs.field(default=b"", repr=lambda b: f"<{len(b)} bytes>")
    mime_type: str | None = None
    frames: tuple[bytes, ...] = attrs.field(default=(), converter=tuple, repr=lambda f: f"<{len(f)} frames>")
    fps: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind == "image" and (not self.data or self.frames):
            raise ValueError("an image MediaItem needs its bytes in data and no frames")
        if self.kind == "video" and (not self.frames or self.data or not all(self.frames)):
            raise ValueError("a video MediaItem needs its sampled frames (non-empty encoded images) and no data")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be positive, got {self.fps}")


@attrs.frozen(kw_only=True)
class TextInput:
    """A raw completion prompt: text to tokenize, or token ids given directly."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple))
    add_special_tokens: bool = False

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("TextInput needs exactly one of text or token_ids")


@attrs.frozen(kw_only=True)
class ChatInput:
    """A chat conversation in OpenAI message form, rendered by the Frontend's chat template."""

    messages: tuple[JSONObject, ...] = attrs.field(converter=tuple)
    tools: tuple[JSONObject, ...] = attrs.field(default=(), converter=tuple)
    template_kwargs: JSONObject = attrs.field(factory=dict)
    add_generation_prompt: bool = True
    media: tuple[MediaItem, ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen(kw_only=True)
class MediaSpan:
    """Where one run of placeholder tokens sits in the prompt: tokens ``start .. start + length`` take rows
    ``offset .. offset + length`` of the encoder output of ``PreparedPrompt.vision[item_index]``. ``grid_thw`` is
    the run's own patch grid (t, h, w) in encoder patches (before the 2x2 merge), which MRoPE positions follow:
    an image is one span with its whole grid; a video is one span per temporal patch group (grid (1, h, w),
    ``offset`` = group x h·w/4), since the Qwen3.5 processor puts a timestamp before each group."""

    item_index: int
    start: int
    length: int
    grid_thw: tuple[int, int, int]
    offset: int = 0


@attrs.frozen(kw_only=True, eq=False)
class VisionItem:
    """One preprocessed image or video, what the Program's vision encoder consumes (built by the Frontend).

    ``pixel_values`` [patches, C·T·P·P] float32: a CPU torch.Tensor, rows in the processor's patch order.
    ``grid_thw`` (t, h, w) in patches (patches = t·h·w); the encoder yields t·h·w/4 embedding rows.
    ``digest``: the item's identity (hex SHA-256 of what determines its pixels: the encoded bytes, the
    preprocessing settings and the grid): the context cache mixes it into the prefix digest of the placeholder
    tokens, so the same media reuses a prefix and different media never does.
    """

    kind: Literal["image", "video"]
    pixel_values: torch.Tensor = attrs.field(repr=lambda t: f"<pixels {tuple(t.shape)}>")
    grid_thw: tuple[int, int, int] = attrs.field(converter=tuple)
    digest: str

    @property
    def embedding_rows(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // 4


@attrs.frozen(kw_only=True)
class PreparedPrompt:
    """Owning token ids plus what the model needs beyond them.

    Shared by every Qwen architecture; it names no concrete Text architecture.
    ``reasoning_open`` tells the OutputSession that the prompt already opened a
    thinking block, so generation starts in the reasoning channel. ``history_boundary``: how many
    leading tokens a chat's next turn reproduces once this turn's answer joins the history (the
    conversation through the assistant turn's opening, when the template drops a thinking preamble
    after it from history); None when that is the whole prompt or not known. The context cache saves
    a checkpoint there.
    """

    token_ids: tuple[int, ...] = attrs.field(converter=tuple, validator=token_ids)
    media: tuple[MediaItem, ...] = attrs.field(default=(), converter=tuple)
    media_spans: tuple[MediaSpan, ...] = attrs.field(default=(), converter=tuple)
    vision: tuple[VisionItem, ...] = attrs.field(default=(), converter=tuple)
    reasoning_open: bool = False
    tools: tuple[JSONObject, ...] = attrs.field(default=(), converter=tuple)
    text: str | None = None
    history_boundary: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a prompt needs at least one token")

    def __len__(self) -> int:
        return len(self.token_ids)
