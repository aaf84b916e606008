"""End to end: a real ``ninfer serve`` process on loopback with a real tiny Qwen3.5 model (random weights,
converted with the real converter), driven by the official ``openai`` client and raw httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ninfer import env
from ninfer_serve.testing import ServerProcess, scrape, tiny_model

MODEL_ID = "tiny"
DEVICE = env.get("NINFER_SERVE_TEST_DEVICE")  # "cuda" to run these on the GPU machine
HI = [{"role": "user", "content": "Say hello."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tiny_model(tmp_path_factory.getbasetemp()), "--model-id", MODEL_ID, "--max-concurrency", "4",
                       "--device", DEVICE, "--max-model-len", "2048") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kw):
    kw.setdefault("messages", HI)
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_ID, **kw)


def test_warmup_ran_through_the_engine_and_left_nothing(server):
    m = scrape(server.url)  # first test of the module: only warmup has run
    assert m["ninfer:request_success_total"] == 4 and m["ninfer:generation_tokens_total"] == 16  # 4 x 4 tokens
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_paused", "num_requests_outstanding",
                  "kv_cache_pages_used", "kv_cache_pages_reserved", "state_slots_used", "host_bytes_used"):
        assert m[f"ninfer:{gauge}"] == 0, gauge
    assert "warmup done" in server.log()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_whole_and_streamed_agree(client):
    whole = chat(client, extra_body={**NO_THINK, "ignore_eos": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    stream = chat(client, stream=True, stream_options={"include_usage": True},
                  extra_body={**NO_THINK, "ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    streamed, first = chunks[-1].usage.model_dump(), whole.usage.model_dump()
    # the repeated prompt restores the first run's prompt-end checkpoint: all of it but its last token
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert streamed.pop("prompt_tokens_details")["cached_tokens"] == whole.usage.prompt_tokens - 1
    first.pop("prompt_tokens_details")
    assert streamed == first


def test_thinking_on_and_off(server):
    def run(enable):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL_ID, "messages": HI, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": enable}})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]
    off, on = run(False), run(True)
    assert off["reasoning_content"] is None and off["reasoning"] is None
    assert off["content"]
    # With thinking on the prompt opens <think>: generation starts in the reasoning channel.
    assert on["reasoning_content"] and on["reasoning"] == on["reasoning_content"]


def test_chat_logprobs(client):
    r = chat(client, logprobs=True, top_logprobs=3, extra_body={**NO_THINK, "ignore_eos": True})
    content = r.choices[0].logprobs.content
    # the content's tokens: those that added no text (special tokens of random weights) have no entry
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert 0 < len(content) <= r.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # greedy: the sampled token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_n_choices(client):
    one = chat(client, extra_body={**NO_THINK, "ignore_eos": True})
    three = chat(client, n=3, extra_body={**NO_THINK, "ignore_eos": True})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in three.choices)  # greedy
    assert three.usage.completion_tokens == 24 and three.usage.prompt_tokens == one.usage.prompt_tokens
    stream = chat(client, n=2, temperature=1.0, seed=99, stream=True, extra_body=NO_THINK)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    whole = chat(client, n=2, temperature=1.0, seed=99, extra_body=NO_THINK)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]


def test_stop_string_ends_the_output(client):
    full = chat(client, max_tokens=16, extra_body={**NO_THINK, "ignore_eos": True}).choices[0].message.content
    cut = next(i for i in range(len(full) // 2, len(full)) if full[i].strip())  # a visible character past the middle
    stopped = chat(client, max_tokens=16, stop=[full[cut:cut + 1]], extra_body={**NO_THINK, "ignore_eos": True})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert full.startswith(choice.message.content) and full[cut:cut + 1] not in choice.message.content
    assert len(choice.message.content) <= cut


def test_seeded_sampling_is_reproducible(client):
    a = chat(client, temperature=1.0, seed=1234, extra_body=NO_THINK)
    b = chat(client, temperature=1.0, seed=1234, extra_body=NO_THINK)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_text_tokens_stream(client):
    whole = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    c = whole.choices[0]
    assert c.finish_reason == "length" and whole.usage.completion_tokens == 6 and c.logprobs is None
    streamed = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=6, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text
    ids = client.completions.create(model=MODEL_ID, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_completions_logprobs(client):
    r = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(v, abs=1e-4)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))


def test_sampling_adjustments_through_the_client(client):
    """logit_bias (as the SDK sends it), penalties and min_tokens reach the sampler; an id outside the vocabulary
    is a 400 naming logit_bias."""
    kw = dict(model=MODEL_ID, prompt="Once upon a time", max_tokens=4, temperature=0)
    forced = client.completions.create(**kw, logit_bias={"100": 100}, presence_penalty=1.0, frequency_penalty=0.5,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_tokens": 2})
    assert forced.usage.completion_tokens == 4
    assert client.completions.create(**kw, logit_bias={"100": 100}, extra_body={"ignore_eos": True}
                                     ).choices[0].text == forced.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kw, logit_bias={"99999999": 5})
    assert "logit_bias" in info.value.body["message"]


def test_tools_are_rendered_and_tool_turns_accepted(client):
    plain = chat(client, extra_body=NO_THINK)
    with_tools = chat(client, tools=TOOLS, tool_choice="auto", extra_body=NO_THINK)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tool schema is in the prompt
    none = chat(client, tools=TOOLS, tool_choice="none", extra_body=NO_THINK)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    turns = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    follow = chat(client, messages=turns, tools=TOOLS, extra_body=NO_THINK)
    assert follow.usage.prompt_tokens > with_tools.usage.prompt_tokens
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_the_sdks_reply_goes_back_in_as_dumped(client):
    """"Append the reply and continue": the SDK's ``message.model_dump()`` (refusal, audio, function_call and
    annotations as nulls, the reasoning as an extra field) and a LiteLLM-shaped copy are accepted back."""
    weather = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}]
    first = chat(client, tools=weather, tool_choice="required", max_tokens=64)
    reply = first.choices[0].message
    assert {"refusal", "audio", "function_call", "annotations"} <= reply.model_dump().keys()
    results = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in reply.tool_calls or []]
    litellm = {**reply.model_dump(exclude_none=True), "provider_specific_fields": {"refusal": None}}
    for sent in (reply.model_dump(), reply.model_dump(exclude_none=True), litellm):
        again = chat(client, messages=[*HI, sent, *results, {"role": "user", "content": "And tomorrow?"}],
                     tools=weather)
        assert again.choices[0].message.role == "assistant"


def test_reasoning_effort_turns_thinking_off_or_keeps_it(client):
    off = chat(client, reasoning_effort="none", max_tokens=6, extra_body={"ignore_eos": True}).choices[0].message
    on = chat(client, reasoning_effort="high", max_tokens=6, extra_body={"ignore_eos": True}).choices[0].message
    assert off.model_dump()["reasoning_content"] is None and off.content
    assert on.model_dump()["reasoning_content"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, reasoning_effort="maximal")
    assert info.value.body["param"] == "reasoning_effort"


def test_raw_sse_framing(server):
    body = {"model": MODEL_ID, "messages": HI, "max_tokens": 5, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **NO_THINK}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")
    assert frames[-1] == "" and all(f.startswith("data: ") and "\n" not in f for f in frames[:-1])
    events = [json.loads(f[6:]) for f in frames[:-2]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    assert events[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("body,status,param", [
    (b'{"model": "tiny", "messages": [', 400, None),
    (b'[1, 2]', 400, None),
    ({"model": MODEL_ID}, 400, "messages"),
    ({"model": MODEL_ID, "messages": HI, "temperature": "warm"}, 400, "temperature"),
    ({"model": MODEL_ID, "messages": HI, "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": MODEL_ID, "messages": HI, "frobnicate": 1}, 400, "frobnicate"),
    ({"model": MODEL_ID, "messages": HI, "temperature": 3}, 400, "temperature"),
    ({"model": MODEL_ID, "messages": HI, "top_p": 0}, 400, "top_p"),
    ({"model": MODEL_ID, "messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_ID, "messages": HI, "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": MODEL_ID, "messages": HI, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    ({"model": MODEL_ID, "messages": HI, "n": 0}, 400, "n"),
    ({"model": MODEL_ID, "messages": HI, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": MODEL_ID, "messages": HI, "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, "messages[0].content[0]"),
    ({"model": "nope", "messages": HI}, 404, "model"),
])
def test_bad_input_answers_openai_errors(server, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_over_long_prompt_is_400(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt=[7] * 2100, max_tokens=4)
    assert "context limit" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        chat(client, messages=[{"role": "user", "content": "word " * 2500}])


def test_bad_input_left_the_engine_healthy(server, client):
    # after every rejection above the engine still serves and holds nothing
    assert chat(client, extra_body=NO_THINK).choices[0].message is not None
    m = scrape(server.url)
    assert m["ninfer:engine_failed"] == 0
    assert m["ninfer:num_requests_running"] == m["ninfer:num_requests_waiting"] == 0


def test_chat_template_flag_replaces_the_artifacts_template(tmp_path_factory, tmp_path):
    from ninfer.artifact import open_artifact
    from ninfer.contract import ChatInput
    from ninfer.models.common.qwen import QwenFrontend

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "<|im_start|>assistant\n")
    model = tiny_model(tmp_path_factory.getbasetemp())
    with open_artifact(model) as art:
        resources = art.frontend

    def prompt_tokens(override: str | None) -> int:
        frontend = QwenFrontend.from_resources(resources, chat_template_override=override)
        return len(frontend.prepare(ChatInput(messages=HI)).token_ids)

    expected = prompt_tokens(template.read_text())
    assert expected != prompt_tokens(None)  # the artifact's own template opens a <think> block
    with ServerProcess(model, "--model-id", MODEL_ID, "--device", DEVICE, "--no-warmup",
                       "--chat-template", str(template)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                       json={"model": MODEL_ID, "messages": HI, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == expected
