"""Held-out synthetic chats run through the trained model: does it think, and call the expected tool?

The prompts come from prepare.py (`synthetic_eval.json`, a seed the training stream does not use): the
conversation up to its first assistant turn and the call that turn should make, or none. The output is read
with a plain pattern of the Qwen3.5 XML call format, so this runs where ninfer is not installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from chat_render import ChatRenderer

_CALL = re.compile(r"<tool_call>\n<function=([^>\n]+)>\n(.*?)</function>\n</tool_call>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.S)


def parse_calls(text: str) -> list[tuple[str, dict[str, str]]]:
    """(function name, raw parameter values) of every well-formed call in `text`."""
    return [(name, dict(_PARAMETER.findall(body))) for name, body in _CALL.findall(text)]


def raw_arguments(arguments: dict[str, Any]) -> dict[str, str]:
    """Arguments as the template writes them: strings as they are, anything else as JSON."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()}


def tool_prompt_results(prompts: Sequence[dict[str, Any]], generate: Callable[[str], str],
                        renderer: ChatRenderer, examples: int = 3) -> dict[str, Any]:
    """Per kind of chat: how many outputs thought (non-empty text before </think>), made a well-formed call,
    called the expected function with the expected arguments, or (when no call was expected) made none."""
    kinds: dict[str, dict[str, Any]] = {}
    for prompt in prompts:
        text = renderer.render(prompt["messages"], prompt["tools"], add_generation_prompt=True)
        output = generate(text)
        calls = parse_calls(output)
        expected = prompt["expected_call"]
        k = kinds.setdefault(prompt["kind"], {"prompts": 0, "thought": 0, "well_formed_call": 0,
                                              "expected_function": 0, "expected_arguments": 0, "no_call": 0,
                                              "examples": []})
        k["prompts"] += 1
        k["thought"] += bool(output.split("</think>")[0].strip()) if "</think>" in output else 0
        k["well_formed_call"] += bool(calls)
        k["no_call"] += not calls and "<tool_call>" not in output
        if expected and calls:
            k["expected_function"] += calls[0][0] == expected["name"]
            k["expected_arguments"] += calls[0] == (expected["name"], raw_arguments(expected["arguments"]))
        if len(k["examples"]) < examples:
            k["examples"].append({"user": prompt["messages"][-1]["content"],
                                  "tools": [t["function"]["name"] for t in prompt["tools"]], "output": output})
    return kinds
