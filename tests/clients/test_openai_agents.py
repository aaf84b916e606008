"""The OpenAI Agents SDK: an Agent with a function tool, run through Chat Completions
(``OpenAIChatCompletionsModel``) and through the Responses API (``OpenAIResponsesModel``, the SDK's default)."""

from __future__ import annotations

from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from openai.types.shared import Reasoning

from .conftest import MODEL_ID

set_tracing_disabled(True)  # the SDK would otherwise export traces to api.openai.com

CALLS: list[tuple[str, str]] = []


@function_tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Weather for a city.

    Args:
        city: the city's name.
        unit: the temperature unit.
    """
    CALLS.append((city, unit))
    return f"sunny in {city}"


def run_agent(model) -> None:
    CALLS.clear()
    agent = Agent(name="weather", instructions="Answer with the weather tool.", model=model, tools=[get_weather],
                  tool_use_behavior="stop_on_first_tool",
                  # effort "minimal" turns Qwen's thinking off, through either API (reasoning_effort in chat)
                  model_settings=ModelSettings(tool_choice="required", max_tokens=96, temperature=0,
                                               reasoning=Reasoning(effort="minimal")))
    result = Runner.run_sync(agent, "What is the weather in Mantua?", max_turns=2)
    assert len(CALLS) == 1 and CALLS[0][1] in ("celsius", "fahrenheit")
    assert result.final_output == f"sunny in {CALLS[0][0]}"


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_agent_tool_through_chat_completions(base_url):
    run_agent(OpenAIChatCompletionsModel(MODEL_ID, client(base_url)))


def test_agent_tool_through_responses(base_url):
    run_agent(OpenAIResponsesModel(MODEL_ID, client(base_url)))
