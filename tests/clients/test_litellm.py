"""LiteLLM's ``completion`` against the server as an OpenAI-compatible provider (``openai/<model id>``): a
two-turn tool loop that appends the assistant message as LiteLLM returns it, then the tool's result."""

from __future__ import annotations

import json
import os

# LiteLLM fetches its model price map from the network at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import litellm  # noqa: E402

from .conftest import MODEL_ID, NO_THINK  # noqa: E402

litellm.telemetry = False
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_two_turn_tool_loop(base_url):
    common = dict(model=f"openai/{MODEL_ID}", api_base=base_url, api_key="unused", max_tokens=48,
                  temperature=0, extra_body=NO_THINK, num_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Mantua?"}]
    first = litellm.completion(messages=messages, tools=TOOLS, tool_choice="required", **common)
    message = first.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    messages.append(message)
    for call in message.tool_calls:
        assert isinstance(json.loads(call.function.arguments), dict)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"})
    second = litellm.completion(messages=messages, tools=TOOLS, **common)
    assert second.choices[0].message.role == "assistant"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
