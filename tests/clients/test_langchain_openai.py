"""langchain-openai's ChatOpenAI: ``bind_tools`` (a forced tool call) and ``with_structured_output`` (its
default method, a strict `json_schema` response format)."""

from __future__ import annotations

from typing import Literal

import jsonschema
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from .conftest import MODEL_ID, NO_THINK, WEATHER


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Weather for a city."""
    return f"sunny in {city}"


class Weather(BaseModel):
    """A weather report."""
    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def llm(base_url):
    return ChatOpenAI(model=MODEL_ID, base_url=base_url, api_key="unused", max_retries=0, timeout=120,
                      temperature=0, max_tokens=160, extra_body=NO_THINK)


def test_bind_tools_forced_call(llm):
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Mantua?")
    assert not message.invalid_tool_calls and len(message.tool_calls) >= 1
    for call in message.tool_calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], WEATHER)
    assert get_weather.invoke(message.tool_calls[0]).content.startswith("sunny in ")


def test_with_structured_output(llm):
    weather = llm.with_structured_output(Weather).invoke("What is the weather in Mantua?")
    assert isinstance(weather, Weather)
