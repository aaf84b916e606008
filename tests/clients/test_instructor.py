"""instructor over the ``openai`` SDK: a pydantic response model through JSON modes and TOOLS mode."""

from __future__ import annotations

from typing import Literal

import instructor
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from .conftest import MODEL_ID, NO_THINK

ASK = [{"role": "user", "content": "What is the weather in Mantua?"}]


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class AnyObject(BaseModel):
    """Mode.JSON sends `json_object` (the schema only in the prompt, which a tiny model does not follow): any
    JSON object the server returns must still reach the client as a parsed model."""
    model_config = ConfigDict(extra="allow")


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def extract(client, mode, model, max_tokens=160):
    patched = instructor.from_openai(client, mode=mode)
    return patched.chat.completions.create_with_completion(
        model=MODEL_ID, response_model=model, messages=ASK, max_tokens=max_tokens, temperature=0, max_retries=0,
        extra_body=NO_THINK)


def test_json_schema_mode(client):
    weather, completion = extract(client, instructor.Mode.JSON_SCHEMA, Weather)
    assert isinstance(weather, Weather) and completion.choices[0].finish_reason == "stop"


def test_json_mode(client):
    # the embedded model answers json_object with a tool definition from its training chats: ~230 tokens
    obj, completion = extract(client, instructor.Mode.JSON, AnyObject, max_tokens=400)
    assert isinstance(obj, AnyObject) and completion.choices[0].finish_reason == "stop"


def test_tools_mode(client):
    weather, completion = extract(client, instructor.Mode.TOOLS, Weather)
    assert isinstance(weather, Weather) and completion.choices[0].finish_reason == "tool_calls"
