"""HTTP framing, status mapping and endpoints of the app, driven by the scripted engine in conftest.py
(a stand-in used only for these framing / error-mapping unit tests; tests/test_serve_*.py use the real engine)."""

import json

from ninfer.contract.events import (
    FinishReason,
    GenerationResult,
    OutputDelta,
    Timings,
    TokenLogprob,
    ToolCall,
    Usage,
)
from ninfer.engine.errors import InputTooLong, Overloaded, QueueTimeout

CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}


def sse_events(text):
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in frames[:-1]]


def test_chat_whole(engine, script, client):
    engine.next = lambda r: script.Handle("r1", script.text("r1", 5, ["Hel", "lo"]))
    r = client(engine).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-r1"
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.handles[0].closed


def test_chat_stream_framing_reasoning_tools_usage(engine, script, client):
    lp = (TokenLogprob(token_id=10, token="x", logprob=-0.5, top=((10, "x", -0.5), (11, "y", -1.5))),)
    events = script.text("r2", 3, [])[:1] + [
        OutputDelta(reasoning="think", token_ids=(1,), logprobs=lp),
        OutputDelta(content="ans", token_ids=(2,), logprobs=lp),
        OutputDelta(tool_calls=(ToolCall(id="call_1", name="f", arguments='{"a": 1}'),), token_ids=(3, 4)),
        GenerationResult(request_id="r2", finish_reason=FinishReason.TOOL_CALLS, timings=Timings(),
                         usage=Usage(prompt_tokens=3, completion_tokens=4))]
    engine.next = lambda r: script.Handle("r2", events)
    body = dict(CHAT, stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2)
    with client(engine).stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(r.read().decode())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[1]["choices"][0]["delta"] == {"reasoning_content": "think", "reasoning": "think"}
    top = chunks[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["token"] for t in top] == ["x", "y"]
    assert chunks[2]["choices"][0]["delta"] == {"content": "ans"}
    call = chunks[3]["choices"][0]["delta"]["tool_calls"][0]
    assert call == {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert chunks[4]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[5]["choices"] == [] and chunks[5]["usage"]["total_tokens"] == 7
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-r2" for c in chunks)


def test_completion_stream_and_logprobs(engine, script, client):
    lp = (TokenLogprob(token_id=10, token="a", logprob=-0.25, top=((10, "a", -0.25),)),)
    engine.next = lambda r: script.Handle("r3", script.text("r3", 2, ["a", "a"], logprobs=lp))
    c = client(engine)
    r = c.post("/v1/completions", json={"prompt": "x", "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == "aa"
    assert choice["logprobs"]["tokens"] == ["a", "a"] and choice["logprobs"]["text_offset"] == [0, 1]
    assert choice["logprobs"]["top_logprobs"] == [{"a": -0.25}, {"a": -0.25}]
    with c.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        chunks = sse_events(r.read().decode())
    assert [ch["choices"][0]["text"] for ch in chunks] == ["a", "a", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_rejections_map_to_status(engine, script, client):
    c = client(engine)
    engine.next = Overloaded("queue full")
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overload"
    engine.next = InputTooLong("prompt of 500 tokens leaves no room")
    r = c.post("/v1/chat/completions", json=dict(CHAT, stream=True))
    assert r.status_code == 400 and "500 tokens" in r.json()["error"]["message"]

    def timed_out(req):
        res = GenerationResult(request_id="q", finish_reason=FinishReason.ERROR, usage=Usage(
            prompt_tokens=0, completion_tokens=0), timings=Timings(), error="waited 1 s",
            extra={"error_kind": "queue_timeout"})
        return script.Handle("q", [res], error=QueueTimeout("waited 1 s"))
    engine.next = timed_out
    for body in (CHAT, dict(CHAT, stream=True)):
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and "retry-after" in r.headers, r.text
        assert r.json()["error"]["code"] == "queue_timeout"
    assert all(h.closed for h in engine.handles)


def test_bad_input_never_reaches_the_engine(engine, client):
    c = client(engine)
    cases = [(b"{not json", 400), (json.dumps({**CHAT, "temperature": 9}).encode(), 400),
             (json.dumps({**CHAT, "surprise": 1}).encode(), 400), (json.dumps({**CHAT, "n": 40}).encode(), 400),
             (json.dumps({**CHAT, "model": "other"}).encode(), 404),
             (json.dumps({**CHAT, "max_tokens": 128}).encode(), 400)]
    for raw, status in cases:
        r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert c.get("/v1/nothing").status_code == 404
    assert c.get("/v1/chat/completions").status_code == 405
    assert engine.submitted == []


def test_models_health_metrics(engine, script, client):
    c = client(engine, model_id="alias")
    data = c.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["alias"] and data[0]["max_model_len"] == 128
    assert c.get("/v1/models/alias").status_code == 200
    assert c.get("/health").json() == {"status": "ok"}
    engine.next = lambda r: script.Handle("r", script.text("r", 1, ["z"]))
    assert c.post("/v1/chat/completions", json=dict(CHAT, model="tiny-test")).status_code == 200
    text = c.get("/metrics").text
    for name in ("ninfer:num_requests_running", "ninfer:num_requests_waiting", "ninfer:kv_cache_usage_perc",
                 "ninfer:time_to_first_token_seconds_bucket", "ninfer:generation_tokens_total",
                 'ninfer:http_requests_total{endpoint="chat",status="200"} 1.0'):
        assert name in text, name


def test_n_choices_whole_and_streamed(engine, script, client):
    pieces = {0: ["a", "b"], 1: ["c"]}
    counter = iter(range(100))

    def next_handle(req):
        i = next(counter) % 2
        return script.Handle(f"r{i}", script.text(f"r{i}", 4, pieces[i]), delay_s=0.01)
    engine.next = next_handle
    c = client(engine)
    body = c.post("/v1/chat/completions", json=dict(CHAT, n=2, seed=1, temperature=0.5)).json()
    assert [ch["message"]["content"] for ch in body["choices"]] == ["ab", "c"]
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert [r.sampling.seed for r in engine.submitted] == [1, 2]
    with c.stream("POST", "/v1/chat/completions", json=dict(CHAT, n=2, stream=True,
                                                           stream_options={"include_usage": True})) as r:
        chunks = sse_events(r.read().decode())
    text = {0: "", 1: ""}
    for ch in chunks[:-1]:
        (choice,) = ch["choices"]
        text[choice["index"]] += choice["delta"].get("content") or ""
    assert text == {0: "ab", 1: "c"}
    assert sorted(ch["choices"][0]["index"] for ch in chunks[:-1] if ch["choices"][0]["finish_reason"]) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_n_choices_all_or_none(engine, script, client):
    calls = []

    def next_handle(req):
        if calls:
            raise Overloaded("queue full")
        calls.append(script.Handle("r0", script.text("r0", 1, ["x"])))
        return calls[0]
    engine.next = next_handle
    r = client(engine).post("/v1/chat/completions", json=dict(CHAT, n=2))
    assert r.status_code == 429
    assert calls[0].closed  # the admitted first choice is closed, which cancels it in the engine
