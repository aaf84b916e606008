"""Which generated token produced which visible text, so that logprob entries travel with their text.

Positions count characters of the decoded output stream (after UTF-8 assembly, before stop strings and
channel routing). Each token covers the characters it completed: a character split over several tokens
belongs to the token that completes it; the tokens before it cover nothing at its position. Routing and stop
strings emit pieces of that stream into the channels (or drop characters: think markers, trimmed whitespace,
tool-call markup, a stop string and what follows it).

``Tracker`` holds the tokens whose characters are not all decided yet and the emitted text after the last
released token. ``release`` hands out text only up to a token boundary, with one ``TokenSpan`` per token and
channel it reached: a token's ``text`` is exactly what it added to that channel, so the spans' texts joined
equal the channel's text, delta by delta. A token that reached no channel has no span; one whose bytes only
began a character goes with that character's channel, with empty text.
"""

from __future__ import annotations

import attrs

from ninfer.contract.events import TokenSpan


@attrs.frozen
class Tracker:
    """Immutable, so a preview's copy of the session state shares it until it changes."""

    tokens: tuple[tuple[int, int, int], ...] = ()  # undecided tokens: (index, start, end)
    pieces: tuple[tuple[str, int, str], ...] = ()  # emitted, unreleased text: (channel, start, text)

    def add_token(self, index: int, start: int, end: int) -> Tracker:
        return Tracker((*self.tokens, (index, start, end)), self.pieces)

    def stretch_last(self, start: int, end: int) -> Tracker:
        """Characters the end of the output completed (U+FFFD for bytes left over) belong to the last token
        if it is still waiting at ``start``."""
        if not self.tokens or self.tokens[-1][1:] != (start, start) or end == start:
            return self
        return Tracker((*self.tokens[:-1], (self.tokens[-1][0], start, end)), self.pieces)

    def add_piece(self, channel: str, start: int, text: str) -> Tracker:
        return Tracker(self.tokens, (*self.pieces, (channel, start, text)))

    def release(self, decided: int | None) -> tuple[Tracker, dict[str, str], tuple[TokenSpan, ...]]:
        """Release every token whose characters are all before ``decided`` (None: the output ended, all
        are), with the emitted text up to the last of them: (what is left, text per channel, the spans)."""
        n, frontier = 0, None
        for i, (_, start, end) in enumerate(self.tokens):
            if decided is not None and end > decided:
                break
            if end > start or decided is None:  # one that only began a character waits for its completion
                n, frontier = i + 1, end
        if decided is None:
            frontier = None
        elif n == 0:
            return self, {}, ()
        text: dict[str, list[str]] = {}
        spans: list[TokenSpan] = []
        out_pieces, rest = _cut(self.pieces, frontier)
        for channel, _, piece in out_pieces:
            text.setdefault(channel, []).append(piece)
        for index, start, end in self.tokens[:n]:
            spans.extend(_spans(index, start, end, out_pieces))
        left = Tracker(tokens=self.tokens[n:], pieces=rest)
        return left, {c: "".join(p) for c, p in text.items()}, tuple(spans)


def _cut(pieces, frontier: int | None):
    """The pieces' text before ``frontier`` (all with None) and the rest."""
    if frontier is None:
        return pieces, ()
    before, after = [], []
    for channel, start, text in pieces:
        if start + len(text) <= frontier:
            before.append((channel, start, text))
        elif start >= frontier:
            after.append((channel, start, text))
        else:
            k = frontier - start
            before.append((channel, start, text[:k]))
            after.append((channel, frontier, text[k:]))
    return before, tuple(after)


def _spans(index: int, start: int, end: int, pieces) -> list[TokenSpan]:
    out: list[TokenSpan] = []
    if start == end:  # its bytes only began a character: it goes where that character went
        for channel, p, text in pieces:
            if p <= start < p + len(text):
                return [TokenSpan(index=index, channel=channel, text="")]
        return out
    for channel, p, text in pieces:
        lo, hi = max(start, p), min(end, p + len(text))
        if lo >= hi:
            continue
        part = text[lo - p:hi - p]
        if out and out[-1].channel == channel:
            out[-1] = attrs.evolve(out[-1], text=out[-1].text + part)
        else:
            out.append(TokenSpan(index=index, channel=channel, text=part, part=bool(out)))
    return out


def join_segs(segs: tuple[tuple[int, int], ...], start: int, n: int) -> tuple[tuple[int, int], ...]:
    """Stream segments (start, length) with ``n`` characters from ``start`` appended."""
    if segs and segs[-1][0] + segs[-1][1] == start:
        return (*segs[:-1], (segs[-1][0], segs[-1][1] + n))
    return (*segs, (start, n))


def split_segs(segs: tuple[tuple[int, int], ...], n: int):
    """The segments of the first ``n`` characters, and of the rest."""
    head: list[tuple[int, int]] = []
    for i, (p, k) in enumerate(segs):
        if n <= 0:
            return tuple(head), segs[i:]
        if k <= n:
            head.append((p, k))
            n -= k
        else:
            head.append((p, n))
            return tuple(head), ((p + n, k - n), *segs[i + 1:])
    return tuple(head), ()
