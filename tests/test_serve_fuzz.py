"""A bounded fuzz of the chat and completions bodies against the gateway over the real engine and a real tiny
model (in process): random JSON values in every field, wrong types, lone surrogates, deep nesting, huge
numbers, unknown keys. Whatever the body, the answer is never a 5xx, and every error has the OpenAI shape.

Derandomized (the same examples every run) and small enough for CI: a few seconds."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from ninfer.contract import EngineConfig
from ninfer_serve.app import create_app
from ninfer_serve.testing import parse_metrics, tiny_model, wait_idle

MAX_EXAMPLES = 120  # per endpoint: a few seconds on the CPU
DEEP = "@@deep@@"  # replaced in the encoded body by a nested value too deep for json.dumps to write

SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc80", "\udfff", "a\ud834b"])
TEXT = st.one_of(st.text(max_size=12), SURROGATES, st.sampled_from(["", "<|im_end|>", "\x00", "tiny", "default"]))
NUMBERS = st.one_of(st.integers(), st.integers(min_value=2**62, max_value=2**200), st.floats(),
                    st.sampled_from([0, -1, 1, 2**31, 2**63, -2**63, 1e308, 10**4000 // 10**3990, 0.5]))
INTS = st.one_of(st.integers(-2, 80), st.integers(min_value=-2**70, max_value=2**70))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(TEXT, inner, max_size=3)),
                           max_leaves=8)

CHAT_KEYS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
             "seed", "stop", "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "logprobs",
             "top_logprobs", "tools", "tool_choice", "chat_template_kwargs", "response_format", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens", "user", "metadata",
             "parallel_tool_calls"]
COMPLETION_KEYS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "logprobs", "echo", "suffix",
                   "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens"]
MESSAGE_KEYS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"]


def chat_base() -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def completion_base() -> dict:
    return {"model": "tiny", "prompt": "Once", "max_tokens": 2}


@st.composite
def mutated(draw, endpoint: str) -> bytes:
    """A valid body with one to three random edits, encoded the way a client would send it."""
    chat = endpoint == "chat"
    body = chat_base() if chat else completion_base()
    keys = CHAT_KEYS if chat else COMPLETION_KEYS
    deep = None
    for _ in range(draw(st.integers(1, 3))):
        edit = draw(st.sampled_from(["value", "unknown", "drop", "message", "deep", "sensible", "typed"]))
        if edit == "value":
            body[draw(st.sampled_from(keys))] = draw(JSON_VALUES)
        elif edit == "unknown":
            body[draw(TEXT)] = draw(JSON_VALUES)
        elif edit == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif edit == "message" and chat:
            msgs = body.get("messages")
            if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
                msgs[0][draw(st.one_of(st.sampled_from(MESSAGE_KEYS), TEXT))] = draw(JSON_VALUES)
        elif edit == "deep":
            deep = draw(st.integers(1, 400))
            where = draw(st.sampled_from(["tools", "chat_template_kwargs", "prompt", "metadata", "stop"]))
            if where == "tools":
                body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]
            else:
                body[where] = DEEP
        elif edit == "sensible":  # valid values, so generation runs too (bounded by the context limit)
            body[draw(st.sampled_from(["temperature", "top_k", "seed", "n", "stream", "logprobs", "stop"]))] = draw(
                st.sampled_from([0.7, 5, 123, 2, True, 3, ["\n", "the"]]))
        elif edit == "typed":  # the right type, any magnitude: these reach the engine's own checks
            name, value = draw(st.one_of(
                st.tuples(st.sampled_from(["max_tokens", "top_k", "seed", "n", "top_logprobs"]), INTS),
                st.tuples(st.sampled_from(["temperature", "top_p", "min_p"]), st.floats(allow_nan=False)),
                st.tuples(st.just("stop_token_ids"), st.lists(INTS, max_size=3)),
                st.tuples(st.just("prompt" if not chat else "stop"),
                          st.lists(INTS, min_size=1, max_size=4) if not chat else st.lists(TEXT, max_size=3))))
            body[name] = value
    raw = json.dumps(body, ensure_ascii=True)  # a lone surrogate travels as a \udXXX escape
    if deep is not None:
        nested = draw(st.sampled_from(['{"a": ', "["]))
        close = "}" if nested.startswith("{") else "]"
        raw = raw.replace(json.dumps(DEEP), nested * deep + "1" + close * deep)
    return raw.encode()


@pytest.fixture(scope="module")
def fuzz_client(tmp_path_factory, one_cpu_thread):
    from ninfer import Engine

    model = tiny_model(tmp_path_factory.getbasetemp())
    with Engine(model, EngineConfig(device="cpu", max_concurrency=2, max_model_len=64)) as engine:
        with TestClient(create_app(engine, model_id="tiny", http_threads=2)) as client:
            yield client


def _check(client, path: str, raw: bytes) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (raw[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text[:500]


FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@FUZZ
@given(raw=mutated("chat"))
def test_fuzz_chat_bodies_never_5xx(fuzz_client, raw):
    _check(fuzz_client, "/v1/chat/completions", raw)


@FUZZ
@given(raw=mutated("completions"))
def test_fuzz_completion_bodies_never_5xx(fuzz_client, raw):
    _check(fuzz_client, "/v1/completions", raw)


def test_fuzz_left_the_engine_idle_and_healthy(fuzz_client):
    assert fuzz_client.get("/health").json() == {"status": "ok"}
    m = wait_idle(lambda: parse_metrics(fuzz_client.get("/metrics").text))
    assert m["ninfer:engine_failed"] == 0
    assert m["ninfer:http_requests_total"] >= 2 * MAX_EXAMPLES
