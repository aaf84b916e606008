"""A 3-turn chat over HTTP on the embedded model: with the context cache, turns 2 and 3 report
``usage.prompt_tokens_details.cached_tokens`` > 0 and answer exactly what a cache-off server answers."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.contract.prompt import TextInput

QUESTIONS = ("Name three colours.", "Which of them is the warmest?", "And the coolest one?")


@pytest.fixture(scope="module")
def engines(embedded_model, one_cpu_thread):
    with ninfer.Engine(embedded_model, ninfer.EngineConfig(device="cpu", max_concurrency=2,
                                                           max_model_len=512)) as on, \
            ninfer.Engine(embedded_model, ninfer.EngineConfig(device="cpu", max_concurrency=2, max_model_len=512,
                                                              context_cache=False)) as off:
        yield on, off


def converse(c, model: str, *, key: str | None) -> list[dict]:
    """Three turns, each with the whole history so far; returns each turn's response body."""
    messages, bodies = [], []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}
        if key is not None:
            body["prompt_cache_key"] = key
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        bodies.append(r.json())
        messages = [*messages, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
    return bodies


def test_three_turn_chat_reuses_the_history_and_answers_the_same(engines, client):
    on, off = engines
    cached = converse(client(on), on.model_name, key="conversation-1")
    plain = converse(client(off), off.model_name, key=None)
    for a, b in zip(cached, plain, strict=True):
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reused = [t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in cached]
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1], reused
    # Each turn restores the previous prompt through its assistant opening: the template keeps
    # "<|im_start|>assistant\n" and the answer in history but drops the empty thinking block after it.
    preamble = len(on.frontend.prepare(TextInput(text="<think>\n\n</think>\n\n")).token_ids)
    assert reused[1:] == [t["usage"]["prompt_tokens"] - preamble for t in cached[:2]]
    assert on.usage().idle
