"""tools/train_tiny's synthetic reasoning / tool-call chats (training data of the embedded model).

They are rendered with the project's chat template by the tool's own renderer; these tests check that the
generator is deterministic, that the renderer writes what the engine's template renders, that the pieces the
model learns to write are cut where generation starts, and that ninfer's tool-call parser reads the calls back
as the intended arguments.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from ninfer.models.common.qwen import tool_calls as tc
from ninfer.models.common.qwen.chat_template import ChatTemplate, builtin_template

TOOL = Path(__file__).resolve().parents[1] / "tools/train_tiny"

# A few scenes in the layout of the sdist's texts: speaker tag, spoken lines, blank line between speeches.
PLAY_TEXT = """ACT I. SCENE I. A street.

ROMEO.
Is the day so young?
But new struck nine, good Romeo.
Ay me! sad hours seem long.

BENVOLIO.
What sadness lengthens Romeo's hours?
Not having that which, having, makes them short.

KING.
We will go see the garden walls tonight.
The moon is fair and the watch is set.

ROMEO.
Farewell, my coz, and bid Benvolio come.
I will tell thee where the garden lies.

BENVOLIO.
Tut, man, one fire burns out another's burning.
Take thou some new infection to thy eye.
"""


@pytest.fixture(scope="module")
def tool():
    """The tool's modules (generic names like `data`), imported and then kept out of everyone else's imports."""
    sys.path.insert(0, str(TOOL))
    try:
        modules = {name: importlib.import_module(name) for name in ("data", "synthetic", "chat_render")}
    finally:
        sys.path.remove(str(TOOL))
        for name in ("data", "synthetic", "chat_render"):
            sys.modules.pop(name, None)
    return modules


@pytest.fixture(scope="module")
def plays(tool):
    return [tool["data"].Play("romeo_and_juliet", PLAY_TEXT)]


@pytest.fixture(scope="module")
def chats(tool, plays):
    return tool["synthetic"].synthetic_chats(plays, 60, seed=7)


def test_same_seed_same_chats_and_another_seed_differs(tool, plays, chats):
    again = tool["synthetic"].synthetic_chats(plays, 60, seed=7)
    assert [(c.kind, c.messages, c.tools) for c in again] == [(c.kind, c.messages, c.tools) for c in chats]
    other = tool["synthetic"].synthetic_chats(plays, 60, seed=8)
    assert [c.messages for c in other] != [c.messages for c in chats]
    assert {c.kind for c in chats} == {"plain", "tool", "declined"}


def test_names_and_lines_come_from_the_plays(tool, plays):
    pool = tool["synthetic"].play_lines(plays)
    assert pool.names == ("Benvolio", "Romeo")   # KING is a role, not a name
    assert "Is the day so young?" in pool.lines
    assert all(3 <= len(line.split()) <= 12 for line in pool.lines)


def test_renderer_writes_what_the_engine_template_renders(tool, chats):
    source, where = tool["chat_render"].template_source()
    assert where.endswith("templates/qwen3_5.jinja")
    ours, engine = tool["chat_render"].ChatRenderer(source), ChatTemplate(builtin_template())
    for chat in chats:
        assert ours.render(chat.messages, chat.tools) == engine.render(
            chat.messages, tools=chat.tools, add_generation_prompt=False)
        prompt = chat.messages[:next(i for i, m in enumerate(chat.messages) if m["role"] == "assistant")]
        assert ours.render(prompt, chat.tools, add_generation_prompt=True) == engine.render(
            prompt, tools=chat.tools, add_generation_prompt=True)


def test_completions_start_where_generation_starts(tool, chats):
    renderer = tool["chat_render"].ChatRenderer(tool["chat_render"].template_source()[0])
    for chat in chats:
        pieces = renderer.segments(chat.messages, chat.tools)
        assert "".join(pieces) == renderer.render(chat.messages, chat.tools)
        prompts, completions = pieces[0:-1:2], pieces[1::2]
        assert len(completions) == (2 if chat.kind == "tool" else 1)
        assert all(p.endswith("<|im_start|>assistant\n<think>\n") for p in prompts)
        for completion, turn in zip(completions, [m for m in chat.messages if m["role"] == "assistant"], strict=True):
            assert completion.startswith(turn["reasoning_content"] + "\n</think>\n\n")
            assert completion.endswith("<|im_end|>\n")


def _parse_call(text: str, tools) -> tuple[str, dict]:
    """The first tool call in `text`, through ninfer's streaming parser fed the whole text at once."""
    after = text.split(tc.TOOL_CALL_OPEN, 1)[1]
    result = tc.feed(tc.ToolCallState(index=0, call_id="call_0"), after, tools, final=True)
    assert result.state is None and result.fallback is None
    name = "".join(f.name for f in result.fragments)
    return name, json.loads("".join(f.arguments for f in result.fragments))


def test_rendered_tool_calls_parse_back_to_their_arguments(tool, chats):
    renderer = tool["chat_render"].ChatRenderer(tool["chat_render"].template_source()[0])
    calls = 0
    for chat in chats:
        completions = renderer.segments(chat.messages, chat.tools)[1::2]
        if chat.kind != "tool":
            assert all(tc.TOOL_CALL_OPEN not in c for c in completions)
            continue
        call = chat.messages[next(i for i, m in enumerate(chat.messages) if m.get("tool_calls"))]["tool_calls"][0]
        assert call["function"]["name"] in [t["function"]["name"] for t in chat.tools]
        assert _parse_call(completions[0], chat.tools) == (call["function"]["name"], call["function"]["arguments"])
        assert tc.TOOL_CALL_OPEN not in completions[1]
        calls += 1
    assert calls >= 10


def test_held_out_prompt_stops_before_the_first_answer(tool, chats):
    synthetic = tool["synthetic"]
    for chat in chats:
        prompt = synthetic.held_out_prompt(chat)
        assert prompt["messages"][-1]["role"] == "user"
        assert (prompt["expected_call"] is not None) == (chat.kind == "tool")
        json.dumps(prompt)   # prepare.py writes it as JSON
