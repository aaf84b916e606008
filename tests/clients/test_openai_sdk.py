"""The official ``openai`` SDK, used as its documentation shows: chat (whole and streamed), tool calls (auto,
required, named), ``chat.completions.parse`` with a pydantic model, and completions with echo + logprobs."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from .conftest import MODEL_ID, NO_THINK, WEATHER

ASK = [{"role": "user", "content": "What is the weather in Mantua?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": WEATHER, "strict": True}}]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def chat(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    kw.setdefault("extra_body", NO_THINK)
    return client.chat.completions.create(model=MODEL_ID, **kw)


def test_chat_whole_and_streamed(client):
    whole = chat(client)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.usage.completion_tokens <= 12
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_reply_appended_as_the_sdk_dumps_it(client):
    first = chat(client).choices[0].message
    messages = [*ASK, first.model_dump(), {"role": "user", "content": "And tomorrow?"}]
    assert chat(client, messages=messages).choices[0].message.content


def test_reasoning_effort_none_turns_thinking_off(client):
    message = chat(client, reasoning_effort="none", extra_body={}).choices[0].message
    assert message.content and not message.reasoning_content


def assert_valid_weather_calls(message):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_constrained_tool_call_keeps_its_schema(client, tool_choice):
    r = chat(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=96)
    assert r.choices[0].finish_reason == "tool_calls"
    assert_valid_weather_calls(r.choices[0].message)


def test_auto_tool_call_names_only_offered_tools(client):
    loose = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                               "parameters": WEATHER}}]
    r = chat(client, tools=loose, max_tokens=48)
    message = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather", call.function
    assert (r.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)


class Weather(BaseModel):
    city: str
    degrees: int


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL_ID, messages=ASK, response_format=Weather, max_tokens=96,
                                      temperature=0, extra_body=NO_THINK)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Weather)


def test_completions_echo_with_logprobs(client):
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                  logprobs=1)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
