"""What a sequence keeps of its prompt's media: the preprocessed items, their spans, the MRoPE plan, the identity.

A Program that runs a vision encoder says which prompts it takes (``VisionSpec``); opening a sequence checks the
prompt's ``vision`` / ``media_spans`` against it once and keeps a ``PromptMedia`` on the record (and on a
ResumeState, so a Replay rebuild positions and encodes the same media). Text-only sequences keep None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ninfer.contract.context import MediaRun, media_runs
from ninfer.contract.prompt import MediaSpan, PreparedPrompt, VisionItem

if TYPE_CHECKING:
    from ninfer.models.common.qwen.mrope import MRopePlan


@attrs.frozen(kw_only=True)
class VisionSpec:
    """The prompts a Program's encoder takes: the 2-D merge of its patch grid (tokens = t * h * w / merge**2) and
    the placeholder token ids the Frontend expands (image and video pads)."""

    merge_size: int
    placeholder_ids: frozenset[int] = attrs.field(converter=frozenset)


@attrs.frozen(kw_only=True, eq=False)
class PromptMedia:
    """A prompt's media as the Program uses it: ``items`` (pixels for the encoder), ``spans`` in token order,
    ``plan`` (rotary positions) and ``runs`` (the context cache's identity of the placeholder tokens)."""

    items: tuple[VisionItem, ...]
    spans: tuple[MediaSpan, ...]
    plan: MRopePlan
    runs: tuple[MediaRun, ...]
    merge_size: int

    @classmethod
    def of(cls, prompt: PreparedPrompt, spec: VisionSpec) -> PromptMedia:
        """The prompt's media checked against ``spec``; ValueError naming what does not fit."""
        from ninfer.models.common.qwen.mrope import MRopePlan  # the Qwen frontend package: only with media

        items, spans = prompt.vision, tuple(sorted(prompt.media_spans, key=lambda s: s.start))
        merge = spec.merge_size
        if not items or not spans:
            raise ValueError(f"a prompt with media needs both vision items and media spans (got {len(items)} "
                             f"items, {len(spans)} spans)")
        for i, span in enumerate(spans):
            if not 0 <= span.item_index < len(items):
                raise ValueError(f"media span {i} names item {span.item_index}; the prompt has {len(items)}")
            rows = _rows(items[span.item_index], merge)
            if span.offset < 0 or span.offset + span.length > rows:
                raise ValueError(f"media span {i} takes rows {span.offset}..{span.offset + span.length} of item "
                                 f"{span.item_index}, which has {rows}")
            pads = prompt.token_ids[span.start:span.start + span.length]
            if any(t not in spec.placeholder_ids for t in pads):
                raise ValueError(f"media span {i} at {span.start} covers tokens that are not media placeholders")
        plan = MRopePlan(len(prompt), spans, merge)  # checks grids, order and bounds
        placeholders = sum(1 for t in prompt.token_ids if t in spec.placeholder_ids)
        if placeholders != sum(s.length for s in spans):
            raise ValueError(f"the prompt has {placeholders} media placeholder tokens but its spans cover "
                             f"{sum(s.length for s in spans)}")
        if spans[-1].start + spans[-1].length == len(prompt):
            raise ValueError("a prompt must not end with a media placeholder (its last token is the first input of "
                             "generation)")
        return cls(items=items, spans=spans, plan=plan, runs=media_runs(prompt), merge_size=merge)

    def shift(self, p: int) -> int:
        """Rotary position minus ledger position of the text token (or generated token) at ``p``."""
        return self.plan.shift(p)

    def last_span_end(self, item_index: int) -> int:
        """The ledger position after the item's last placeholder token."""
        return max(s.start + s.length for s in self.spans if s.item_index == item_index)

    def spans_in(self, a: int, b: int) -> list[MediaSpan]:
        return [s for s in self.spans if s.start < b and a < s.start + s.length]


def _rows(item: VisionItem, merge: int) -> int:
    t, h, w = item.grid_thw
    return t * h * w // (merge * merge)


def prompt_media(prompt: PreparedPrompt, spec: VisionSpec | None, refusal: str) -> PromptMedia | None:
    """The sequence's media (None for a text prompt); ValueError when the prompt carries media this Program
    cannot run (``spec`` None: ``refusal`` says why) or media the Frontend did not prepare."""
    if not prompt.vision and not prompt.media_spans:
        if prompt.media:
            raise ValueError("the prompt carries media the Frontend did not prepare (no vision items)")
        return None
    if spec is None:
        raise ValueError(refusal)
    return PromptMedia.of(prompt, spec)
