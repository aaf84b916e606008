"""``/v1/responses`` framing, translation and the response store, driven by the scripted engine in conftest.py
and parsed by the real ``openai`` SDK (its types are the shapes clients read); tests/test_serve_responses.py
drives the real engine."""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.contract.events import FinishReason, GenerationResult, OutputDelta, Timings, ToolCall, Usage
from ninfer_serve.responses_api import input_messages
from ninfer_serve.responses_store import ResponseStore, StoredResponse
from ninfer_serve.schemas import ChatMessage


def sdk(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def events_with(request_id, deltas, reason=FinishReason.STOP, prompt_tokens=5):
    from ninfer.contract.events import GenerationStart

    done = GenerationResult(request_id=request_id, finish_reason=reason, timings=Timings(),
                            usage=Usage(prompt_tokens=prompt_tokens,
                                        completion_tokens=sum(len(d.token_ids) for d in deltas)))
    return [GenerationStart(request_id=request_id, prompt_tokens=prompt_tokens), *deltas, done]


THINK_ANSWER = [OutputDelta(reasoning="hmm", token_ids=(1,)), OutputDelta(content="\n\n", token_ids=(2,)),
                OutputDelta(content="Hel", token_ids=(3,)), OutputDelta(content="lo", token_ids=(4,))]
CALL = [OutputDelta(reasoning="call it", token_ids=(1,)),
        OutputDelta(tool_calls=(ToolCall(id="call_9", name="get_weather", arguments='{"city": '),), token_ids=(2,)),
        OutputDelta(tool_calls=(ToolCall(id="", name="", arguments='"Oslo"}'),), token_ids=(3,))]
TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_whole_response_as_the_sdk_reads_it(engine, script, client):
    engine.next = lambda r: script.Handle("r1", events_with("r1", THINK_ANSWER))
    r = sdk(client(engine)).responses.create(model="tiny-test", input="hi", instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "hmm"
    assert r.output_text == "\n\nHello"  # whitespace after the thinking is kept once real text follows
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (5, 4, 9)
    assert r.usage.output_tokens_details.reasoning_tokens == 1 and r.instructions == "Be brief."
    messages = engine.submitted[0].input.messages
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == "hi"


def test_stream_events_in_order_with_sequence_numbers(engine, script, client):
    engine.next = lambda r: script.Handle("r2", events_with("r2", THINK_ANSWER))
    with sdk(client(engine)).responses.stream(model="tiny-test", input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nHello"
    assert final.output_text == "\n\nHello" and final.status == "completed"


def test_stream_frames_are_typed_events_without_done(engine, script, client):
    engine.next = lambda r: script.Handle("r6", events_with("r6", THINK_ANSWER[2:]))
    with client(engine).stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f]
    assert "data: [DONE]" not in frames
    for frame in frames:
        event, data = frame.split("\n")
        assert event == "event: " + json.loads(data.removeprefix("data: "))["type"]
    assert json.loads(frames[-1].split("\n")[1][6:])["response"]["output"][0]["content"][0]["text"] == "Hello"


def test_function_call_streamed_and_whole(engine, script, client):
    engine.next = lambda r: script.Handle("r3", events_with("r3", CALL, FinishReason.TOOL_CALLS))
    c = sdk(client(engine))
    with c.responses.stream(model="tiny-test", input="weather?", tools=[TOOL], tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(args) == '{"city": "Oslo"}'
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == '{"city": "Oslo"}'
    call = final.output[-1]
    assert (call.type, call.call_id, call.name, call.arguments) == ("function_call", "call_9", "get_weather",
                                                                    '{"city": "Oslo"}')
    # chat's tools shape reaches the engine; required constrains the output
    assert engine.submitted[0].input.tools[0]["function"]["name"] == "get_weather"
    assert engine.submitted[0].constraint is not None


def test_length_is_incomplete(engine, script, client):
    engine.next = lambda r: script.Handle("r4", events_with("r4", THINK_ANSWER[2:], FinishReason.LENGTH))
    r = sdk(client(engine)).responses.create(model="tiny-test", input="hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert engine.submitted[0].sampling.max_tokens == 2


def test_tool_loop_items_become_the_chat_history():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather in Oslo?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "cold"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "warm"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Cold and warm.", "annotations": [], "logprobs": []}]}]
    out = input_messages(items)
    assert [m.role for m in out] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c.id for c in out[1].tool_calls] == ["c1", "c2"]
    assert (out[2].content, out[2].tool_call_id, out[3].content) == ("cold", "c1", "warm")
    assert out[4].content[0].text == "Cold and warm."


def test_previous_response_id_continues_the_conversation(engine, script, client):
    engine.next = lambda r: script.Handle(r.request_id, events_with(r.request_id, THINK_ANSWER))
    c = sdk(client(engine))
    first = c.responses.create(model="tiny-test", input="hi")
    second = c.responses.create(model="tiny-test", input="again", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    turn2 = engine.submitted[1]
    assert [(m["role"], m["content"]) for m in turn2.input.messages] == [
        ("user", "hi"), ("assistant", "\n\nHello"), ("user", "again")]
    assert turn2.input.messages[1]["reasoning_content"] == "hmm"
    # one session key for the whole conversation: the context cache continues it
    assert engine.submitted[0].session_key == turn2.session_key == first.id
    assert c.responses.retrieve(first.id).output_text == "\n\nHello"
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model="tiny-test", input="more", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id" and err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


def test_store_false_keeps_nothing(engine, script, client):
    engine.next = lambda r: script.Handle(r.request_id, events_with(r.request_id, THINK_ANSWER))
    c = sdk(client(engine))
    r = c.responses.create(model="tiny-test", input="hi", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_store_is_bounded_in_count_and_bytes():
    def entry(size):
        return StoredResponse(messages=(ChatMessage(role="user", content="x"),), session_key="s", body={}, size=size)

    store = ResponseStore(max_responses=2, max_bytes=100)
    for i in range(3):
        assert store.put(None, f"r{i}", entry(10))
    assert store.get(None, "r0") is None and len(store) == 2  # the least recently used went first
    assert store.get(None, "r1") is not None  # now r2 is the least recently used
    assert store.put(None, "big", entry(95))  # over the count (r2 goes), then the bytes (r1 goes)
    assert store.get(None, "r2") is None and store.get(None, "r1") is None and store.bytes == 95
    assert not store.put(None, "huge", entry(101)) and store.get(None, "huge") is None
    assert store.get("other-key", "big") is None  # scoped per API key


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "hi", "bogus": 1}]}, "input[0].bogus"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "include": ["nonsense"]}, "include[0]"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice.name"),
    ({"input": []}, "input"),
])
def test_bad_input_is_a_400_naming_the_parameter(engine, client, body, param):
    r = client(engine).post("/v1/responses", json={"model": "tiny-test", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert engine.submitted == []


def test_unknown_previous_id_is_404(engine, client):
    r = client(engine).post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_what_clients_send_is_accepted(engine, script, client):
    """The fields the Agents SDK and LangChain send with their defaults."""
    engine.next = lambda r: script.Handle("r5", events_with("r5", THINK_ANSWER))
    body = {"model": "tiny-test", "input": [{"role": "user", "content": "hi"}], "instructions": None,
            "include": ["reasoning.encrypted_content"], "tools": [], "tool_choice": "auto",
            "parallel_tool_calls": False, "truncation": "disabled", "store": True, "stream": False,
            "metadata": {"a": "b"}, "user": "u", "reasoning": {"effort": "none", "summary": "auto"},
            "text": {"format": {"type": "text"}, "verbosity": "medium"}, "top_p": 1, "temperature": 0.7}
    r = client(engine).post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert engine.submitted[0].input.template_kwargs == {"enable_thinking": False}
    assert json.loads(r.text)["metadata"] == {"a": "b"}


def test_openapi_lists_the_responses_routes(engine, client):
    doc = client(engine).get("/openapi.json").json()
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"input", "instructions", "previous_response_id", "text", "tools"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False


def test_one_api_key_cannot_read_or_continue_anothers_responses(engine, script, client):
    engine.next = lambda r: script.Handle(r.request_id, events_with(r.request_id, THINK_ANSWER))
    http = client(engine, api_key=["key-a", "key-b"])
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    made = http.post("/v1/responses", json={"input": "hi"}, headers=a).json()
    assert http.get(f"/v1/responses/{made['id']}", headers=a).status_code == 200
    assert http.get(f"/v1/responses/{made['id']}", headers=b).status_code == 404
    r = http.post("/v1/responses", json={"input": "more", "previous_response_id": made["id"]}, headers=b)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert http.delete(f"/v1/responses/{made['id']}", headers=b).status_code == 404
    assert http.delete(f"/v1/responses/{made['id']}", headers=a).json()["deleted"] is True


def test_instructions_and_leading_system_messages_make_one_system_message(engine, script, client):
    engine.next = lambda r: script.Handle("r7", events_with("r7", THINK_ANSWER))
    body = {"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Rule one."},
        {"role": "system", "content": [{"type": "input_text", "text": "Rule two."}]},
        {"role": "user", "content": "hi"}]}
    assert client(engine).post("/v1/responses", json=body).status_code == 200
    messages = engine.submitted[0].input.messages
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "Be brief.\n\nRule one.\n\nRule two."), ("user", "hi")]


KEYS = ["model", "input", "instructions", "previous_response_id", "max_output_tokens", "temperature", "top_p",
        "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning", "stream", "store", "metadata", "include",
        "truncation", "top_logprobs", "max_tool_calls", "background", "conversation", "prompt", "bogus"]
ITEM_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "output", "id", "status", "summary"]
VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False),
                                st.sampled_from(["", "x", "user", "function_call", "message", "input_text",
                                                 "function_call_output", "json_schema", "function", "auto"])),
                      lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
                          st.sampled_from([*ITEM_KEYS, "format", "schema", "effort"]), inner, max_size=3)),
                      max_leaves=6)


def test_fuzzed_bodies_answer_200_or_an_openai_shaped_4xx(engine, script, client):
    engine.next = lambda r: script.Handle(r.request_id, events_with(r.request_id, THINK_ANSWER))
    http = client(engine)

    @settings(max_examples=80, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(edits=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3),
           item=st.dictionaries(st.sampled_from(ITEM_KEYS), VALUES, max_size=4))
    def one(edits, item):
        body = {"input": [{"role": "user", "content": "hi"}, item], **dict(edits)}
        r = http.post("/v1/responses", json=body)
        assert r.status_code in (200, 400, 404), (body, r.text)
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error

    one()


def test_an_image_for_a_model_without_vision_names_the_input(engine, client):
    part = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    r = client(engine).post("/v1/responses", json={"input": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert engine.submitted == []
