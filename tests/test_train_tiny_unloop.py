"""tools/train_tiny/unloop.py: the pseudo-repetitive windows of the unlooping phase.

A window is real text followed by one of its lines repeated; none may touch a chat, whose tool calls repeat
their parameter lines by design (teaching those repeats away cost the model its tool calls).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOOL = Path(__file__).resolve().parents[1] / "tools/train_tiny"
NL, START, END, EOT = 10, 90, 91, 92  # a newline token, <|im_start|>, <|im_end|>, <|endoftext|>


@pytest.fixture(scope="module")
def unloop():
    sys.path.insert(0, str(TOOL))
    try:
        return importlib.import_module("unloop")
    finally:  # the tool's modules have generic names (train, model, ...): keep them out of everyone else's imports
        sys.path.remove(str(TOOL))
        for path in TOOL.glob("*.py"):
            sys.modules.pop(path.stem, None)


def lines(first: int, count: int, width: int) -> list[int]:
    """`count` lines of `width` - 1 word tokens and a newline, the words numbered from `first`."""
    out = []
    for i in range(count):
        out += list(range(first + i * width, first + (i + 1) * width - 1)) + [NL]
    return out


PLAY = lines(100, 40, 6) + [EOT]
CHAT = [START] + lines(400, 30, 6) + [END, NL, START] + lines(700, 30, 6) + [END, NL, EOT]


def stream() -> torch.Tensor:
    return torch.tensor(PLAY + CHAT + PLAY)


def test_in_chats_marks_each_conversation_to_its_end_of_text(unloop):
    chats = unloop.in_chats(stream(), START, EOT)
    expected = torch.zeros(len(PLAY) + len(CHAT) + len(PLAY), dtype=torch.bool)
    expected[len(PLAY):len(PLAY) + len(CHAT) - 1] = True  # from its first <|im_start|> to before its <|endoftext|>
    assert torch.equal(chats, expected)


def test_repeated_windows_never_touch_a_chat(unloop):
    s = stream()
    chats = unloop.in_chats(s, START, EOT)
    gen = torch.Generator().manual_seed(0)
    rows, periods = unloop.repeated_batch(s, torch.tensor([NL]), 64, 12, 60, gen, chats)
    assert rows.shape == (64, 60)
    assert not bool(((rows >= 400) & (rows < 1000)).any())  # no chat token, context or line
    for row, period in zip(rows, periods, strict=True):
        line = row[12:12 + period]
        assert line[-1] == NL and torch.equal(row[12 + period:12 + 2 * period], line)
    unfiltered, _ = unloop.repeated_batch(s, torch.tensor([NL]), 64, 12, 60, torch.Generator().manual_seed(0))
    assert bool(((unfiltered >= 400) & (unfiltered < 1000)).any())  # without the mask, chats are drawn
