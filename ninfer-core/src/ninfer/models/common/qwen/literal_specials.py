"""Special-token strings inside client text stay plain text through chat-template rendering.

The template renders the conversation to one text, and the tokenizer reads every special-token string in it
(``<|im_end|>``, ``<|im_start|>``, ...) as the control token: a user writing ``<|im_end|>`` would end its own
turn and could open a ``system`` one. So before rendering, each special-token string occurring in a client
string is replaced by a placeholder character that occurs in no client string; after rendering, the text is
split at the special tokens the template itself wrote (the only ones left), and the pieces between them are
tokenized with special-token strings read as plain text, the placeholders restored to their literal text.

Placeholders are single characters (a template's strip, split or ``tojson`` cannot cut one), Unicode
noncharacters first, then private-use characters. A conversation without special-token strings is not
touched at all, so its token ids are exactly those of rendering and encoding it directly. Only ``special``
added tokens are concerned: non-special ones such as Qwen's ``<think>`` and ``<tool_call>`` are read as
tokens wherever they occur, as the templates' own history format requires.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, ValuesView
from typing import Any

import attrs

from ninfer.models.common.qwen.errors import FrontendInputError
from ninfer.models.common.qwen.tokenizer import QwenTokenizer

# noncharacters U+FDD0..U+FDEF, then the private-use planes 15 and 16
_POOL_RANGES = ((0xFDD0, 0xFDEF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))
_POOL_CHAR = re.compile("[" + "".join(f"{chr(a)}-{chr(b)}" for a, b in _POOL_RANGES) + "]")


@attrs.frozen
class Protected:
    """Client values with special-token strings replaced; ``literals`` maps each placeholder to its text."""

    messages: list[Any]
    tools: list[Any]
    kwargs: dict[str, Any]
    literals: dict[str, str]


@attrs.frozen
class Rendered:
    """A rendered ``protect``-ed conversation: ``text`` as the user sees it (placeholders restored),
    ``pieces`` the plain text between the template's special tokens, ``specials`` those tokens' ids
    (one fewer than the pieces)."""

    text: str
    pieces: list[str]
    specials: list[int]


def client_strings(value: Any, *, keys: bool = True) -> Iterator[str]:
    """Every string inside ``value`` (mapping values and, with ``keys``, keys; items of lists, tuples and
    other views), in no particular order."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(item.values())
            if keys:
                stack.extend(item.keys())
        elif isinstance(item, list | tuple | ValuesView):
            stack.extend(item)


def _map_strings(value: Any, fn) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_strings(item, fn) for item in value)
    return value


def _placeholders(taken: set[str]) -> Iterator[str]:
    for first, last in _POOL_RANGES:
        for code in range(first, last + 1):
            if chr(code) not in taken:
                yield chr(code)


class LiteralSpecials:
    """Keeps a tokenizer's special-token strings literal inside client strings (see the module docstring)."""

    def __init__(self, tokenizer: QwenTokenizer) -> None:
        self._tok = tokenizer
        self._ids = dict(tokenizer.special_tokens)
        alternation = "|".join(re.escape(s) for s in sorted(self._ids, key=len, reverse=True))
        self._find = re.compile(alternation) if self._ids else None
        self._split = re.compile(f"({alternation})") if self._ids else None

    def protect(self, messages: list[Any], tools: list[Any], kwargs: Mapping[str, Any]) -> Protected | None:
        """Placeholders for the special-token strings in these client values; None when there are none."""
        if self._find is None:
            return None
        found = {m for s in self._all(messages, tools, kwargs) for m in self._find.findall(s)}
        if not found:
            return None
        taken = {c for s in self._all(messages, tools, kwargs) for c in _POOL_CHAR.findall(s)}
        free = _placeholders(taken)
        to_placeholder = {}
        for text in sorted(found):
            placeholder = next(free, None)
            if placeholder is None:
                raise FrontendInputError("the conversation uses every private-use character, so its special-token "
                                         "strings cannot be kept as plain text")
            to_placeholder[text] = placeholder

        def replace(s: str) -> str:
            return self._find.sub(lambda m: to_placeholder[m.group()], s)

        return Protected(messages=_map_strings(messages, replace), tools=_map_strings(tools, replace),
                         kwargs={k: _map_strings(v, replace) for k, v in kwargs.items()},
                         literals={p: t for t, p in to_placeholder.items()})

    def split(self, rendered: str, protected: Protected) -> Rendered:
        """Split the template's output at its special tokens and restore the placeholders in between."""
        if self._split is None:
            raise ValueError("this tokenizer has no special tokens")
        table = str.maketrans(protected.literals)
        parts = self._split.split(rendered)  # plain, special, plain, ..., plain
        pieces = [p.translate(table) for p in parts[::2]]
        text = "".join(p if i % 2 else pieces[i // 2] for i, p in enumerate(parts))
        return Rendered(text=text, pieces=pieces, specials=[self._ids[p] for p in parts[1::2]])

    def encode(self, rendered: Rendered) -> list[int]:
        """The template's special tokens as control tokens, every piece between them as plain text."""
        ids: list[int] = []
        for i, piece_ids in enumerate(self._tok.encode_specials_as_text(rendered.pieces)):
            if i:
                ids.append(rendered.specials[i - 1])
            ids.extend(piece_ids)
        return ids

    @staticmethod
    def _all(messages, tools, kwargs) -> Iterator[str]:
        yield from client_strings(messages)
        yield from client_strings(tools)
        yield from client_strings(list(kwargs.values()))
