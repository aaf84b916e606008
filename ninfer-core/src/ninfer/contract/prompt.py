"""Public owning input and the PreparedPrompt a Frontend builds from it."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ninfer.contract._validate import token_ids


@attrs.frozen(kw_only=True)
class MediaItem:
    """One image or video a request carries, as acquired bytes (decoding belongs to the Frontend)."""

    kind: Literal["image", "video"]
    data: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    mime_type: str | None = None


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

    messages: tuple[dict[str, Any], ...] = attrs.field(converter=tuple)
    tools: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=tuple)
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    add_generation_prompt: bool = True
    media: tuple[MediaItem, ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen(kw_only=True)
class MediaSpan:
    """Where one media item's placeholder tokens sit in the prompt, with its patch grid (t, h, w)."""

    item_index: int
    start: int
    length: int
    grid_thw: tuple[int, int, int]


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
    reasoning_open: bool = False
    tools: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=tuple)
    text: str | None = None
    history_boundary: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a prompt needs at least one token")

    def __len__(self) -> int:
        return len(self.token_ids)
