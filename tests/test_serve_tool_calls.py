"""Qwen3.5 tool calls to OpenAI ``tool_calls``: the real Qwen frontend's OutputSession interprets the tokens of a
tool-call turn (as the engine feeds them, one committed token at a time) and the gateway's response builders
turn its deltas into the chunks and message a client receives. A random tiny model never writes a tool call,
so this drives the session, built with the real Qwen3.5 vocabulary, with the tokens of one directly."""

from __future__ import annotations

import json

import pytest

from ninfer.contract import ChatInput, SamplingParams
from ninfer.contract.events import GenerationResult, Timings, Usage
from ninfer.models.common.qwen.frontend import QwenFrontend
from ninfer_qwen35.testing.qwen_vocab import qwen35_frontend_resources
from ninfer_serve.responses import ChatResponse
from ninfer_serve.translate import ResponseOptions

TOOLS = ({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}},)
TURN = ("Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def frontend():
    return QwenFrontend.from_resources(qwen35_frontend_resources(), chat_template_override="builtin:qwen3_5")


def run_session(frontend):
    prompt = frontend.prepare(ChatInput(messages=({"role": "user", "content": "Weather in Oslo?"},), tools=TOOLS,
                                        template_kwargs={"enable_thinking": False}))
    session = frontend.open_session(prompt, SamplingParams(temperature=0.0))
    tokens = [*frontend.tokenizer.encode(TURN), frontend.tokenizer.token_id("<|im_end|>")]
    deltas, reason = [], None
    for t in tokens:
        preview = session.preview([t])
        deltas.append(session.commit(preview))
        if preview.finish_reason is not None:
            reason = preview.finish_reason
            break
    assert reason is not None
    deltas.append(session.finish(reason))
    result = GenerationResult(request_id="t", finish_reason=reason, timings=Timings(),
                              usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(tokens)))
    return deltas, result


def test_tool_call_turn_becomes_openai_tool_calls(frontend):
    deltas, result = run_session(frontend)
    whole = ChatResponse("t", "tiny", ResponseOptions())
    for d in deltas:
        whole.delta(d)
    body = whole.whole([result])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 3}

    stream = ChatResponse("t", "tiny", ResponseOptions(stream=True))
    frames = stream.start(len(deltas))
    for d in deltas:
        frames += stream.delta(d)
    frames += stream.finish(result)
    chunks = [json.loads(f[6:]) for f in frames]
    parts = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert parts[0]["id"] == call["id"] and parts[0]["function"]["name"] == "get_weather"
    assert all(p["index"] == 0 for p in parts)
    assert "".join(p["function"]["arguments"] for p in parts) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
