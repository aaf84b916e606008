"""MRoPE positions of one Qwen prompt with media, planned once (transformers' Qwen3.5 ``get_rope_index``).

Each token has three rotary positions (t, h, w). A text token has the same value on all three: text runs count
on from where the previous run left off. The placeholder tokens of a media span with patch grid (t, h, w) cover
the merged grid (t, h/m, w/m) in raster order and take T = frame + base, H = row + base, W = col + base, where
``base`` is the position the span starts at; the text after it continues at base + max(h, w)/m. A video is one
span per temporal patch group (the Frontend puts each group's timestamp between them), so every group restarts
its frame index at 0. Positions after the prompt (generated tokens) are the ledger position plus ``delta`` =
max position + 1 - prompt length, the same on all three axes.

A text token's position is its ledger position plus the ``shift`` of its run, so a chunk or decode row without
placeholder tokens needs only 1-D positions; only chunks that touch a span need the [3, n] table.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs
import torch

from ninfer.contract.prompt import MediaSpan


@attrs.frozen(kw_only=True)
class _Placed:
    """A span in position space: tokens start..end cover the merged grid (t, rows, cols) from ``base``."""

    start: int
    end: int
    t: int
    rows: int
    cols: int
    base: int


class MRopePlan:
    """The rotary positions of a prompt of ``length`` tokens whose media placeholders are ``spans``."""

    def __init__(self, length: int, spans: Sequence[MediaSpan], merge_size: int) -> None:
        if length < 1 or merge_size < 1:
            raise ValueError(f"an MRoPE plan needs a prompt length >= 1 and a merge size >= 1, got {length}, "
                             f"{merge_size}")
        self.length = length
        placed: list[_Placed] = []
        cuts = [0]  # segment k covers ledger positions cuts[k] .. cuts[k+1]: text runs and spans alternating
        shifts: list[int | None] = []  # a text segment's shift; None for a span
        current = end = 0
        for i, span in enumerate(sorted(spans, key=lambda s: s.start)):
            t, h, w = span.grid_thw
            if min(t, h, w) < 1 or h % merge_size or w % merge_size:
                raise ValueError(f"media span {i} has grid {span.grid_thw}: h and w must be positive multiples of "
                                 f"the merge size {merge_size}")
            rows, cols = h // merge_size, w // merge_size
            if span.length != t * rows * cols:
                raise ValueError(f"media span {i} at {span.start} has {span.length} tokens; its grid {span.grid_thw} "
                                 f"merges to {t * rows * cols}")
            if span.start < end or span.start + span.length > length:
                raise ValueError(f"media span {i} ({span.start}..{span.start + span.length}) overlaps another or "
                                 f"lies outside the prompt of {length} tokens")
            if span.start > end:
                cuts.append(span.start)
                shifts.append(current - end)
                current += span.start - end
            placed.append(_Placed(start=span.start, end=span.start + span.length, t=t, rows=rows, cols=cols,
                                  base=current))
            cuts.append(span.start + span.length)
            shifts.append(None)
            current += max(rows, cols)
            end = span.start + span.length
        top = max([p.base + max(p.t, p.rows, p.cols) - 1 for p in placed], default=-1)
        if end < length:
            cuts.append(length)
            shifts.append(current - end)
            top = max(top, current + length - end - 1)
        self.delta = top + 1 - length  # every position at or after the prompt's end is ledger position + delta
        self._cuts = cuts[:-1]
        self._shifts = shifts
        self._spans = {p.start: p for p in placed}

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of every span, in order."""
        return tuple((p.start, p.end) for p in self._spans.values())

    def touches_media(self, a: int, b: int) -> bool:
        """Whether ledger positions a..b hold a placeholder token."""
        return any(isinstance(seg, _Placed) for _, _, seg in self._segments_in(a, b))

    def shift(self, p: int) -> int:
        """Rotary position minus ledger position of a text token (or any position past the prompt)."""
        if p >= self.length:
            return self.delta
        k = bisect.bisect_right(self._cuts, p) - 1
        shift = self._shifts[k]
        if shift is None:
            raise ValueError(f"ledger position {p} is a media placeholder: it has no 1-D position")
        return shift

    def text_positions(self, a: int, b: int) -> torch.Tensor:
        """int64 [b - a]: the rotary positions of ledger positions a..b, none a placeholder."""
        out = torch.arange(a, b, dtype=torch.int64)
        for lo, hi, seg in self._segments_in(a, b):
            if isinstance(seg, _Placed):
                raise ValueError(f"ledger positions {a}..{b} hold media placeholders: they need 3-D positions")
            out[lo - a:hi - a] += seg
        return out

    def positions(self, a: int, b: int) -> torch.Tensor:
        """int64 [3, b - a]: the (t, h, w) rotary positions of ledger positions a..b."""
        out = torch.arange(a, b, dtype=torch.int64).expand(3, -1).clone()
        for lo, hi, seg in self._segments_in(a, b):
            if isinstance(seg, _Placed):
                idx = torch.arange(lo - seg.start, hi - seg.start, dtype=torch.int64)
                per_frame = seg.rows * seg.cols
                out[0, lo - a:hi - a] = idx // per_frame + seg.base
                out[1, lo - a:hi - a] = idx // seg.cols % seg.rows + seg.base
                out[2, lo - a:hi - a] = idx % seg.cols + seg.base
            else:
                out[:, lo - a:hi - a] += seg
        return out

    def _segments_in(self, a: int, b: int) -> list[tuple[int, int, _Placed | int]]:
        """(lo, hi, span or text shift) of each segment part inside a..b, positions past the prompt included."""
        if not 0 <= a <= b:
            raise ValueError(f"bad ledger range {a}..{b}")
        out: list[tuple[int, int, _Placed | int]] = []
        k = max(bisect.bisect_right(self._cuts, a) - 1, 0)
        while k < len(self._cuts) and self._cuts[k] < min(b, self.length):
            lo = max(a, self._cuts[k])
            hi = min(b, self._cuts[k + 1] if k + 1 < len(self._cuts) else self.length)
            shift = self._shifts[k]
            if lo < hi:
                out.append((lo, hi, self._spans[self._cuts[k]] if shift is None else shift))
            k += 1
        if b > max(a, self.length):
            out.append((max(a, self.length), b, self.delta))
        return out
