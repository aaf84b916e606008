"""``/v1/responses`` on the embedded model (the real engine in process), driven by the real ``openai`` SDK:
text whole and streamed, a function-tool loop, ``text.format`` json_schema, and ``previous_response_id``
continuing through the context cache (and 404 once evicted from the bounded store).

Greedy throughout; schemas are small (enums, bounded integers) so any valid output fits the token budget."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import ninfer
from ninfer.contract.prompt import TextInput

OFF = {"effort": "none"}  # thinking off through the template, as chat's enable_thinking: false
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather for some days.", "parameters": WEATHER,
        "strict": True}


@pytest.fixture(scope="module")
def engine(embedded_model, one_cpu_thread):
    with ninfer.Engine(embedded_model, ninfer.EngineConfig(device="cpu", max_concurrency=2,
                                                           max_model_len=1024)) as eng:
        yield eng


class Api:
    """The SDK over an in-process app on the engine; ``create`` greedy, thinking off, a few tokens."""

    def __init__(self, http, model: str) -> None:
        self.c = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        self.model = model

    def create(self, **kw):
        kw.setdefault("reasoning", OFF)
        kw.setdefault("temperature", 0)
        kw.setdefault("max_output_tokens", 12)
        return self.c.responses.create(model=self.model, **kw)


@pytest.fixture
def sdk(engine, client):
    return lambda **app_options: Api(client(engine, **app_options), engine.model_name)


def test_text_whole_and_streamed_agree(sdk):
    c = sdk()
    whole = c.create(input="Say hello.", instructions="Answer briefly.")
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 5 and whole.usage.output_tokens > 0
    with c.c.responses.stream(model=c.model, input="Say hello.", instructions="Answer briefly.", reasoning=OFF,
                              temperature=0, max_output_tokens=12) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # the last event carries the response: completed, or incomplete when the 12 tokens ran out first
    (final,) = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    assert final.status == whole.status
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_text_format_json_schema(sdk):
    # the first constraint of the module: it pays for starting the grammar compile workers
    r = sdk().create(input="Is the sky blue?", max_output_tokens=100,
                     text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}})
    assert r.status == "completed", r.output
    jsonschema.validate(json.loads(r.output_text), ANSWER)


def test_function_tool_loop(sdk):
    c = sdk()
    first = c.create(input="What is the weather for the next days?", tools=[TOOL], tool_choice="required",
                     parallel_tool_calls=False, max_output_tokens=80)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed", first.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls]
    # the client's loop, stateless: the whole history as items (what the Agents SDK sends by default)
    history = [{"role": "user", "content": "What is the weather for the next days?"},
               *[item.model_dump(exclude_none=True) for item in first.output], *outputs]
    second = c.create(input=history, tools=[TOOL])
    assert second.status in ("completed", "incomplete") and second.usage.output_tokens > 0
    # the same through previous_response_id: the same prompt, so the same answer
    chained = c.create(input=outputs, tools=[TOOL], previous_response_id=first.id)
    assert chained.output_text == second.output_text
    assert chained.usage.input_tokens == second.usage.input_tokens


def test_previous_response_id_restores_the_cached_conversation(engine, sdk):
    c = sdk()
    first = c.create(input="Name three colours.", max_output_tokens=16)
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = c.create(input="Which is the warmest?", previous_response_id=first.id, max_output_tokens=8)
    cached = second.usage.input_tokens_details.cached_tokens
    assert 0 < cached < second.usage.input_tokens
    # the first turn's prompt through its assistant opening: the template keeps "<|im_start|>assistant\n" and
    # the answer in history but drops the empty thinking block after it (as in chat, test_prompt_cache_chat.py)
    preamble = len(engine.frontend.prepare(TextInput(text="<think>\n\n</think>\n\n")).token_ids)
    assert cached == first.usage.input_tokens - preamble


def test_evicted_response_is_a_404(sdk):
    c = sdk(responses_max=1)
    first = c.create(input="One.", max_output_tokens=4)
    c.create(input="Two.", max_output_tokens=4)  # the store holds one response: the first is evicted
    with pytest.raises(openai.NotFoundError) as err:
        c.create(input="Three.", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
