"""What clients send back inside messages is accepted (the OpenAI message schema in full, vendor fields
ignored), ``reasoning_effort`` turns thinking off or keeps it, ``max_completion_tokens`` works wherever
``max_tokens`` does; unknown top-level fields and bad values stay a 400 naming the parameter."""

from __future__ import annotations

import logging

import openai
import pytest
from openai.types.chat import ChatCompletionMessage

from ninfer_serve import message_fields
from ninfer_serve.errors import APIError
from ninfer_serve.schemas import ChatCompletionRequest, CompletionRequest, structure
from ninfer_serve.translate import chat_request, completion_request

USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}


def chat(messages, **kw):
    gen, _ = chat_request(structure({"messages": messages, **kw}, ChatCompletionRequest))
    return gen.input


def err(body, cls=ChatCompletionRequest, translate=chat_request) -> APIError:
    with pytest.raises(APIError) as info:
        translate(structure(body, cls))
    assert info.value.status == 400
    return info.value


def sdk_reply(**fields) -> ChatCompletionMessage:
    return ChatCompletionMessage.model_validate({"role": "assistant", **fields})


@pytest.mark.parametrize("exclude_none", [False, True])
def test_the_sdks_own_message_dump_goes_back_in(exclude_none):
    reply = sdk_reply(content=None, tool_calls=[CALL], reasoning_content="thinking")
    dumped = reply.model_dump(exclude_none=exclude_none)
    assert exclude_none or {"refusal", "audio", "function_call", "annotations"} <= dumped.keys()
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    messages = chat([USER, dumped, tool, {"role": "user", "content": "and tomorrow?"}]).messages
    assert messages[1] == {"role": "assistant", "content": None, "reasoning_content": "thinking",
                           "tool_calls": [{"id": "call_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
    assert messages[2]["role"] == "tool" and messages[3]["content"] == "and tomorrow?"


def test_vendor_fields_inside_messages_are_ignored_and_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(message_fields, "_logged", set())  # as if no request had sent them yet
    litellm_reply = {"role": "assistant", "content": "it is sunny", "provider_specific_fields": {"x": 1},
                     "tool_calls": [{**CALL, "index": 0, "function": {**CALL["function"], "extra": True}}]}
    user = {**USER, "cache_control": {"type": "ephemeral"},
            "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
    with caplog.at_level(logging.DEBUG, logger="ninfer_serve"):
        for _ in range(2):
            messages = chat([user, litellm_reply, USER]).messages
    assert messages[0] == {"role": "user", "content": "hi"}
    assert messages[1]["content"] == "it is sunny" and "provider_specific_fields" not in messages[1]
    ignored = [r.getMessage() for r in caplog.records if "ignoring the unknown field" in r.getMessage()]
    assert sorted(ignored) == sorted(set(ignored))  # once per field name
    assert any("'provider_specific_fields'" in m for m in ignored) and any("'index'" in m for m in ignored)
    assert all(r.levelno == logging.DEBUG for r in caplog.records if "ignoring" in r.getMessage())


def test_unknown_top_level_fields_are_still_refused():
    e = err({"messages": [USER], "provider_specific_fields": {}})
    assert e.param == "provider_specific_fields" and "Unrecognized request argument" in e.message


def test_refusal_audio_annotations_and_name():
    refused = sdk_reply(content=None, refusal="I can't help with that.", annotations=[],
                        audio={"id": "audio_1", "data": "", "expires_at": 0, "transcript": ""}).model_dump()
    named = {"role": "user", "content": "hello", "name": "ada"}
    messages = chat([named, refused, USER]).messages
    assert messages[0] == {"role": "user", "content": "hello", "name": "ada"}
    assert messages[1] == {"role": "assistant", "content": "I can't help with that."}  # refusal stands for content
    both = chat([USER, {"role": "assistant", "content": "sure", "refusal": "no"}, USER]).messages
    assert both[1]["content"] == "sure"


def test_legacy_function_call_and_function_messages():
    messages = chat([USER, {"role": "assistant", "content": None,
                            "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                     {"role": "function", "name": "get_weather", "content": "rain"}]).messages
    assert messages[1]["tool_calls"] == [{"id": None, "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert messages[2] == {"role": "tool", "content": "rain", "name": "get_weather"}
    e = err({"messages": [{**USER, "function_call": {"name": "f", "arguments": "{}"}}]})
    assert e.param == "messages[0].function_call"
    e = err({"messages": [USER, {"role": "assistant", "function_call": {"name": "f", "arguments": "{x"}}]})
    assert e.param == "messages[1].function_call.arguments"
    e = err({"messages": [USER, {"role": "function", "name": "f"}]})
    assert e.param == "messages[1].content"


@pytest.mark.parametrize("effort,kwargs,thinking", [
    ("none", None, False), ("minimal", None, False), ("low", None, None), ("medium", None, None),
    ("high", None, None), ("xhigh", None, None), (None, None, None),
    ("none", {"enable_thinking": True}, True),  # an explicit template kwarg wins
    ("high", {"enable_thinking": False}, False),
])
def test_reasoning_effort(effort, kwargs, thinking):
    template = chat([USER], reasoning_effort=effort, chat_template_kwargs=kwargs).template_kwargs
    assert template.get("enable_thinking") is thinking


@pytest.mark.parametrize("effort", ["extreme", "", "NONE", 3])
def test_a_bad_reasoning_effort_is_400(effort):
    e = err({"messages": [USER], "reasoning_effort": effort})
    assert e.param == "reasoning_effort"


def test_max_completion_tokens_wherever_max_tokens_is():
    def budget(cls, translate, body):
        gen, options = translate(structure(body, cls))
        return gen.sampling.max_tokens, options.budget_param

    prompt = {"prompt": "hi"}
    assert budget(CompletionRequest, completion_request, prompt) == (16, "max_tokens")
    assert budget(CompletionRequest, completion_request, {**prompt, "max_completion_tokens": 5}) == \
        (5, "max_completion_tokens")
    assert budget(CompletionRequest, completion_request, {**prompt, "max_tokens": 7, "max_completion_tokens": 5})[0] == 5
    assert budget(ChatCompletionRequest, chat_request, {"messages": [USER], "max_completion_tokens": 3})[0] == 3
    e = err({**prompt, "max_completion_tokens": 0}, CompletionRequest, completion_request)
    assert e.param == "max_completion_tokens"


def test_the_openai_sdk_round_trip_over_http(engine, script, client):
    """The real SDK against the app: its reply, dumped and appended, goes back in; an over-long budget names
    the parameter it came in."""
    engine.next = lambda req: script.Handle("r", script.text("r", 3, ["Hello", " there"]))
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client(engine),
                        max_retries=0)
    first = sdk.chat.completions.create(model="tiny-test", messages=[USER], reasoning_effort="none",
                                        max_completion_tokens=4)
    assert engine.submitted[-1].input.template_kwargs == {"enable_thinking": False}
    for exclude_none in (False, True):
        again = [USER, first.choices[0].message.model_dump(exclude_none=exclude_none), USER]
        reply = sdk.chat.completions.create(model="tiny-test", messages=again, reasoning_effort="high")
        assert reply.choices[0].message.content == "Hello there"
        assert engine.submitted[-1].input.messages[1]["content"] == "Hello there"
        assert engine.submitted[-1].input.template_kwargs == {}
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="tiny-test", prompt="hi", extra_body={"max_completion_tokens": 10_000})
    assert info.value.body["param"] == "max_completion_tokens"
