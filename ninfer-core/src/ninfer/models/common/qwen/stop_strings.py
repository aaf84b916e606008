"""Streaming stop-string matching in time and memory linear in the stop strings and the text.

One Aho-Corasick automaton over a request's stop strings: its state after the text so far is the longest
suffix of that text which is a prefix of some stop string, which is exactly the text that must be held back
(at most the longest stop's length - 1 characters); everything before it can never become part of a match
and is released at once. New text is scanned once, character by character, without rescanning held text.

The output stops at the first position where any stop string ends (when several end there, the longest,
i.e. the earliest starting one, counts): that is the first moment a stop string is complete, so it does not
depend on how the text was split into tokens. The output is the text before that match.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import attrs

_CHAR_BITS = 21  # code points are below 2**21: an edge key is node << 21 | ord(char)


@attrs.frozen
class StopStep:
    """The effect of one piece of text: ``released`` may be emitted; ``held`` (with automaton state ``state``)
    may still become a stop string; ``matched``: a stop string ended inside the piece (``released`` is then
    the text before it, and what follows is dropped)."""

    released: str
    held: str
    state: int
    matched: bool


class StopMatcher:
    """The automaton for one request's stop strings; immutable, so previews can share it."""

    __slots__ = ("_edges", "_fail", "_depth", "_out")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        # Trie: one flat dict of edges (one entry per node) and per-node arrays, linear in the total length.
        edges: dict[int, int] = {}
        depth = array("l", [0])
        out = array("l", [0])   # length of the longest stop string that ends at this node (0: none)
        children: list[list[int]] = [[]]
        for s in stops:
            node = 0
            for ch in s:
                key = node << _CHAR_BITS | ord(ch)
                nxt = edges.get(key)
                if nxt is None:
                    nxt = len(depth)
                    edges[key] = nxt
                    depth.append(depth[node] + 1)
                    out.append(0)
                    children[node].append(key)
                    children.append([])
                node = nxt
            out[node] = len(s)
        fail = array("l", [0]) * len(depth)
        frontier = list(children[0])
        while frontier:  # breadth first: a node's failure link is shallower, so already known
            nxt_frontier = []
            for key in frontier:
                child, parent, code = edges[key], key >> _CHAR_BITS, key & ((1 << _CHAR_BITS) - 1)
                if parent:
                    f = fail[parent]
                    while True:
                        target = edges.get(f << _CHAR_BITS | code)
                        if target is not None or f == 0:
                            break
                        f = fail[f]
                    fail[child] = target if target is not None else 0
                if not out[child]:
                    out[child] = out[fail[child]]
                nxt_frontier.extend(children[child])
            frontier = nxt_frontier
        self._edges, self._fail, self._depth, self._out = edges, fail, depth, out

    def __len__(self) -> int:
        """States in the automaton: one per distinct stop-string prefix, plus the start."""
        return len(self._depth)

    def advance(self, held: str, state: int, text: str) -> StopStep:
        """Scan ``text`` after ``held`` (the text held back so far, in automaton state ``state``)."""
        edges, fail, out = self._edges, self._fail, self._out
        node = state
        for i, ch in enumerate(text):
            code = ord(ch)
            while True:
                nxt = edges.get(node << _CHAR_BITS | code)
                if nxt is not None:
                    node = nxt
                    break
                if node == 0:
                    break
                node = fail[node]
            if out[node]:
                start = len(held) + i + 1 - out[node]  # where the match begins in held + text
                released = held[:start] if start <= len(held) else held + text[:start - len(held)]
                return StopStep(released=released, held="", state=0, matched=True)
        keep = self._depth[node]
        cut = len(held) + len(text) - keep  # held + text = released + the kept suffix
        if cut >= len(held):
            return StopStep(released=held + text[:cut - len(held)], held=text[cut - len(held):], state=node,
                            matched=False)
        return StopStep(released=held[:cut], held=held[cut:] + text, state=node, matched=False)
