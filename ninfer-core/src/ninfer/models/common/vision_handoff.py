"""The vision handoff: encoder outputs of the media a sequence's prefill has reached but not yet passed.

A prefill chunk that first touches an item's placeholder tokens runs the encoder on the whole item (every frame
of a video) and keeps its embedding rows; each chunk takes the rows of its own placeholder tokens
(``ForwardBatch.vision_rows`` / ``vision_embeds``), so an item split over several chunks is encoded once. The
rows are freed once a chunk past the item's last span has run, so a long prompt holds at most the items its
current chunk touches. They are not part of the StateImage: a released or paused sequence drops them, and a
Replay rebuild (or a Snapshot resumed before the prompt's end) encodes an item again when it reaches it: the
encoder is deterministic for the same pixels. docs/vision.md says why.

The same module gives a unit its rotary positions: ledger position plus the prompt's MRoPE shift for text and
generated tokens (every decode row), and the [3, n] table for a chunk that touches placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ninfer.core.forward_batch import ForwardBatch
from ninfer.models.common.context.sequence import SequenceRecord

# pixel_values [patches, C*T*P*P], grids [(t, h, w)] -> embedding rows [t*h*w / merge**2, hidden] on the device
Encoder = Callable[[torch.Tensor, Sequence[tuple[int, int, int]]], torch.Tensor]


class VisionHandoff:
    """Per sequence, the encoder rows of the items its prefill is inside; ``encode`` runs one item (None: the
    Program takes no media, and its SequenceTable refuses prompts that carry any)."""

    def __init__(self, encode: Encoder | None = None) -> None:
        self.encode = encode
        self._held: dict[int, dict[int, torch.Tensor]] = {}  # sequence id -> item index -> rows
        self.encoded = 0  # items encoded so far (a Replay encodes its items again)

    @property
    def items_held(self) -> int:
        return sum(len(items) for items in self._held.values())

    @property
    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for items in self._held.values() for t in items.values())

    def fill(self, batch: ForwardBatch, seq: SequenceRecord, start: int, n: int) -> None:
        """Give a one-sequence prefill ``batch`` of ledger positions start..start+n its rotary positions and, when
        it holds placeholder tokens, their MRoPE table and encoder rows (encoding the items it reaches first)."""
        media = seq.media
        if media is None:
            return
        end = start + n
        device = batch.positions.device
        spans = media.spans_in(start, end)
        if not spans:
            batch.positions = media.plan.text_positions(start, end).to(device)
            return
        table = media.plan.positions(start, end)
        batch.positions = table[0].to(device)
        batch.mrope_positions = table.to(device)
        rows, embeds = [], []
        for span in spans:
            item = self._item(seq, span.item_index)
            lo, hi = max(span.start, start), min(span.start + span.length, end)
            rows.append(torch.arange(lo - start, hi - start, dtype=torch.int64))
            first = span.offset + lo - span.start
            embeds.append(item[first:first + hi - lo])
        batch.vision_rows = torch.cat(rows).to(device)
        batch.vision_embeds = torch.cat(embeds)

    def passed(self, seq: SequenceRecord) -> None:
        """After a chunk ran: free the items whose last placeholder token is behind the frontier."""
        held = self._held.get(seq.id) if self._held else None
        if not held:
            return
        for index in [i for i in held if seq.media.last_span_end(i) <= seq.computed]:
            del held[index]
        if not held:
            del self._held[seq.id]

    def drop(self, sequence_id: int) -> None:
        """The sequence is released or paused: its rows go (a resume encodes again)."""
        self._held.pop(sequence_id, None)

    def _item(self, seq: SequenceRecord, index: int) -> torch.Tensor:
        held = self._held.setdefault(seq.id, {})
        rows = held.get(index)
        if rows is None:
            item = seq.media.items[index]
            rows = self.encode(item.pixel_values, [item.grid_thw])
            self.encoded += 1
            held[index] = rows
        return rows


def decode_positions(seqs: Sequence[SequenceRecord]) -> list[int] | None:
    """The rotary positions of decode rows at each sequence's frontier; None when no row has media (its
    positions are the frontiers themselves)."""
    if all(s.media is None for s in seqs):
        return None
    return [s.computed if s.media is None else s.computed + s.media.shift(s.computed) for s in seqs]
