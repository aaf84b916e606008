"""Response schema pieces: tool-call fragment accumulation, logprob shapes, finish reasons."""

import math

from ninfer.contract.events import FinishReason, TokenLogprob, ToolCall
from ninfer_serve.responses import ToolCallIndexer, chat_logprobs, completion_logprobs, finish_reason, sse


def frag(index, id="", name="", arguments=""):
    return ToolCall(index=index, id=id, name=name, arguments=arguments)


def test_fragments_by_index_concatenate_to_the_arguments():
    tc = ToolCallIndexer()
    first = tc.add(frag(0, id="call_a", name="get_weather"))
    assert first == {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert tc.add(frag(0, arguments='{"city": "Oslo"')) == {"index": 0, "function": {"arguments": '{"city": "Oslo"'}}
    tc.add(frag(0, arguments="}"))
    tc.add(frag(1, id="call_b", name="noop", arguments="{}"))
    assert [c["function"] for c in tc.calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                                                 {"name": "noop", "arguments": "{}"}]


def test_whole_calls():
    tc = ToolCallIndexer()
    tc.add(ToolCall(index=0, id="x", name="f", arguments='{"a": 1}'))
    tc.add(ToolCall(index=1, id="y", name="g", arguments="{}"))
    assert [c["id"] for c in tc.calls] == ["x", "y"]


def test_logprob_shapes_and_infinities():
    lp = [TokenLogprob(token_id=1, token="é", logprob=-math.inf, top=((1, "é", -math.inf),))]
    c = chat_logprobs(lp)["content"][0]
    assert c["logprob"] == -9999.0 and c["bytes"] == [195, 169] and c["top_logprobs"][0]["token"] == "é"
    legacy = completion_logprobs(lp * 2, 5)
    assert legacy["text_offset"] == [5, 6] and legacy["top_logprobs"] == [{"é": -9999.0}] * 2
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'


def test_finish_reasons():
    assert [finish_reason(r) for r in FinishReason] == ["stop", "length", "tool_calls", "abort", "length", "error",
                                                            "grammar"]
