"""Render training conversations with the chat template the engine will use, cut where the model's output is.

The template is the project's `qwen3_5.jinja` when the tool runs inside the repository (the export embeds the
same file), else the tool's own `chat_template.jinja`; both render plain conversations identically. The
environment is the one ninfer and transformers render templates in: trim and lstrip blocks, loop controls,
`raise_exception`, and a `tojson` that keeps key order and non-ASCII text (jinja's own sorts keys and escapes
HTML, which would render tool definitions differently from the engine).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = Path(__file__).resolve().parent
PROJECT_TEMPLATE = HERE.parents[1] / "ninfer-core/src/ninfer/models/common/qwen/templates/qwen3_5.jinja"


def template_source() -> tuple[str, str]:
    """(template text, where it came from, relative to the repository)."""
    if PROJECT_TEMPLATE.exists():
        return PROJECT_TEMPLATE.read_text(), str(PROJECT_TEMPLATE.relative_to(HERE.parents[1]))
    return (HERE / "chat_template.jinja").read_text(), "tools/train_tiny/chat_template.jinja"


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatRenderer:
    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self.template = env.from_string(source)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
               add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=list(messages), tools=list(tools) or None,
                                    add_generation_prompt=add_generation_prompt)

    def segments(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> list[str]:
        """The rendered conversation as [prompt, completion, prompt, completion, ..., rest].

        Completions are the assistant turns after the last user turn: what one request makes the model write (a
        reply, or a tool call and, after the tool's answer, the reply). Each piece is tokenized on its own, as at
        inference: a prompt ends in "<think>\\n", which would otherwise merge with the reply's first newline
        into a token the engine never sends."""
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise ValueError("the conversation has no user turn")
        full = self.render(messages, tools)
        pieces, done = [], 0
        for k in range(last_user + 1, len(messages)):
            if messages[k]["role"] != "assistant":
                continue
            prompt = self.render(messages[:k], tools, add_generation_prompt=True)
            turn = self.render(messages[:k + 1], tools)
            if not (turn.startswith(prompt) and full.startswith(turn) and len(prompt) >= done):
                raise ValueError(f"chat template: turn {k} does not extend the conversation rendered before it")
            pieces += [full[done:len(prompt)], full[len(prompt):len(turn)]]
            done = len(turn)
        if not pieces:
            raise ValueError("the conversation has no assistant turn after its last user turn")
        return [*pieces, full[done:]]
