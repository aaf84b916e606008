"""Request parsing and translation: strict types, unknown keys, ranges, each answered as a 400 naming the field."""

import pytest

from ninfer.contract import ChatInput, TextInput
from ninfer_serve.errors import APIError
from ninfer_serve.json_body import parse_json
from ninfer_serve.schemas import ChatCompletionRequest, CompletionRequest, structure
from ninfer_serve.translate import chat_request, choices, completion_request, completion_requests

USER = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return chat_request(structure({"messages": USER, **kw}, ChatCompletionRequest))


def err(fn, *a, **kw) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*a, **kw)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body,param,words", [
    ({}, "messages", "missing required parameter"),
    ({"messages": 3}, "messages", "expected an array"),
    ({"messages": [{"role": "usr", "content": "x"}]}, "messages[0].role", '"user"'),
    ({"messages": USER, "temperature": "hot"}, "temperature", "expected a number"),
    ({"messages": USER, "max_tokens": 1.5}, "max_tokens", "expected an integer"),
    ({"messages": USER, "max_tokens": True}, "max_tokens", "got a boolean"),
    ({"messages": USER, "stream": "yes"}, "stream", "expected a boolean"),
    ({"messages": USER, "stop": ["a", 3]}, "stop[1]", "expected a string"),
    ({"messages": USER, "bogus": 1}, "bogus", "Unrecognized request argument supplied: bogus"),
    ({"messages": USER, "stream_options": {"zz": 1}}, "stream_options.zz", "Unrecognized"),
    ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"description": "d"}}]},
     "tools[0].function.name", "missing required parameter"),
    ({"messages": USER, "temperature": float("nan")}, "temperature", "finite"),
])
def test_type_errors_name_the_field(body, param, words):
    e = err(structure, body, ChatCompletionRequest)
    assert e.param == param
    assert words in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_an_object_and_json():
    assert "JSON object" in err(structure, [1], ChatCompletionRequest).message
    assert "not valid JSON" in err(parse_json, b"{nope").message
    assert "not valid JSON" in err(parse_json, b"\xff\xfe").message
    assert "nested more than 64 levels" in err(parse_json, b"[" * 100000 + b"]" * 100000).message


@pytest.mark.parametrize("kw,param", [
    ({"temperature": 2.5}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": 2.0}, "min_p"),
    ({"top_k": -2}, "top_k"), ({"seed": -5}, "seed"), ({"seed": 2**63}, "seed"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"stop": [""]}, "stop"), ({"stop": ["x"] * 17}, "stop"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"logit_bias": {"1": 101.0}}, "logit_bias"), ({"logit_bias": {"x1": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"), ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_out_of_range_is_400_naming_the_parameter(kw, param):
    assert err(chat, **kw).param == param


def test_penalties_logit_bias_and_min_tokens_reach_the_sampling_params():
    s = chat(presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.1, min_tokens=3, max_tokens=5,
             logit_bias={"151645": -100, "7": 100})[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens) == (-2, 1.5, 1.1, 3)
    assert dict(s.logit_bias) == {151645: -100, 7: 100}
    gen, _ = completion_request(structure({"prompt": "x", "repetition_penalty": 1.2, "min_tokens": 2},
                                          CompletionRequest))
    assert gen.sampling.repetition_penalty == 1.2 and gen.sampling.min_tokens == 2
    assert chat()[0].sampling.presence_penalty is None and chat()[0].sampling.logit_bias == ()


def test_n_choices_are_separate_requests_seeded_apart():
    gen, opts = chat(n=3, seed=5, temperature=0.7)
    assert opts.n == 3
    seeds = [g.sampling.seed for g in choices(gen, opts.n)]
    assert seeds == [5, 6, 7]
    gen, opts = chat(n=2)
    assert [g.sampling.seed for g in choices(gen, 2)] == [None, None]
    assert choices(gen, 1) == [gen]


def test_image_parts_become_media_parts_of_the_chat_input():
    """Translation marks where the media sit; their bytes are acquired later (test_media.py)."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    gen, _ = chat_request(structure({"messages": msgs}, ChatCompletionRequest))
    assert gen.input.messages[0]["content"] == [{"type": "text", "text": "see"}, {"type": "image"}]
    assert gen.input.media == ()


def test_chat_translation():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    gen, opts = chat_request(structure({
        "messages": msgs, "tools": tools, "tool_choice": "auto", "max_completion_tokens": 7, "max_tokens": 99,
        "temperature": 0, "top_k": -1, "seed": 3, "stop": "END", "logprobs": True, "top_logprobs": 2,
        "stream": True, "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False}}, ChatCompletionRequest))
    assert isinstance(gen.input, ChatInput)
    m = gen.input.messages
    assert m[0] == {"role": "system", "content": "be brief"}
    assert m[1]["content"] == "a\nb"
    assert m[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert m[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert gen.input.tools[0]["function"] == {"name": "get_weather", "parameters": {"type": "object"}}
    assert gen.input.template_kwargs == {"enable_thinking": False}
    s = gen.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.seed, s.stop, s.logprobs, s.top_logprobs) == \
        (7, 0.0, 0, 3, ("END",), True, 2)
    assert opts.stream and opts.include_usage and opts.logprobs and opts.tools_enabled


def test_tool_choice_none_keeps_tools_out_of_the_prompt():
    gen, opts = chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert gen.input.tools == () and not opts.tools_enabled


def test_bad_tool_call_arguments():
    msgs = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    e = err(chat_request, structure({"messages": msgs}, ChatCompletionRequest))
    assert e.param == "messages[1].tool_calls[0].function.arguments"


def test_completion_translation():
    gen, opts = completion_request(structure({"prompt": [1, 2, 3], "logprobs": 2}, CompletionRequest))
    assert gen.input == TextInput(token_ids=(1, 2, 3))
    assert gen.sampling.max_tokens == 16 and gen.sampling.logprobs and gen.sampling.top_logprobs == 2
    gen, opts = completion_request(structure({"prompt": ["once"], "max_tokens": 5}, CompletionRequest))
    assert gen.input == TextInput(text="once") and not opts.logprobs


def test_batched_prompts_translate_to_one_request_per_prompt_and_choice():
    gens, opts = completion_requests(structure({"prompt": [[1, 2], [3]], "n": 2, "seed": 5}, CompletionRequest),
                                     request_id="r")
    assert [g.input for g in gens] == [TextInput(token_ids=(1, 2)), TextInput(token_ids=(3,))] and opts.n == 4
    laid = choices(gens, opts.n)  # prompt i's choice j at i * n + j
    assert [c.input.token_ids for c in laid] == [(1, 2), (1, 2), (3,), (3,)]
    assert [c.request_id for c in laid] == ["r", "r-1", "r-2", "r-3"]
    assert [c.sampling.seed for c in laid] == [5, 6, 5, 6]
    gens, opts = completion_requests(structure({"prompt": ["a", "b", "c"]}, CompletionRequest))
    assert [g.input.text for g in gens] == ["a", "b", "c"] and opts.n == 3


def test_echo_and_prompt_logprobs_translation():
    _, opts = completion_request(structure({"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0},
                                           CompletionRequest))
    assert opts.echo and opts.prompt_only and opts.logprobs and opts.prompt_logprobs is None
    gen, opts = completion_request(structure({"prompt": "x", "prompt_logprobs": 3, "max_tokens": 2},
                                             CompletionRequest))
    assert opts.prompt_logprobs == 3 and not opts.prompt_only and gen.sampling.max_tokens == 2


@pytest.mark.parametrize("body,param", [
    ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"), ({"prompt": [[1]] * 65}, "prompt"), ({"prompt": [[1]] * 33, "n": 2}, "n"),
    ({"prompt": [1, -2]}, "prompt"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt": "x", "prompt_logprobs": -1},
                                                                  "prompt_logprobs"),
    ({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": 5}, "prompt"), ({"prompt": [1, "a"]}, "prompt[1]"),
])
def test_completion_errors(body, param):
    def run():
        return completion_requests(structure(body, CompletionRequest))
    assert err(run).param == param
