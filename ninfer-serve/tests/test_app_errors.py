"""Valid JSON never answers 5xx: lone surrogates and deep nesting are 400s naming the parameter, error bodies
always encode, and a 500 carries a request id instead of internal text. Also the OpenAI message shape
(no ``tool_calls`` when there are none) and the served ``/openapi.json``."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

from ninfer_serve.app import create_app
from ninfer_serve.errors import APIError
from ninfer_serve.json_body import MAX_JSON_DEPTH
from ninfer_serve.schemas import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}
JSON_HEADERS = {"content-type": "application/json"}


@pytest.fixture
def app_client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


def post(c, raw: bytes, path: str = "/v1/chat/completions"):
    return c.post(path, content=raw, headers=JSON_HEADERS)


@pytest.mark.parametrize("raw,param", [
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "tiny-test", "messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages[0].content"),
    (b'{"\\udc80": 1, "model": "tiny-test", "messages": []}', "\\udc80"),
    (b'{"model": "tiny-test", "messages": [{"role": "user", "content": "hi", "\\ud800x": 1}]}', "messages[0].\\ud800x"),
    (b'{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udbff"]}', "stop[0]"),
    # a surrogate in UTF-8 form rather than as an escape (json.loads lets it through)
    (b'{"model": "tiny-test", "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}', "messages[0].content"),
    (b'{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\uDC00x"]}', "stop[0]"),
])
def test_lone_surrogates_are_a_400_naming_the_parameter(engine, app_client, raw, param):
    r = post(app_client, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_unicode"
    assert "lone surrogate" in err["message"]
    assert engine.submitted == []


def test_lone_surrogate_in_a_completion_prompt(engine, app_client):
    r = post(app_client, b'{"prompt": "x\\ud800"}', "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_valid_surrogate_pair_is_text(engine, app_client, script):
    engine.next = lambda req: script.Handle("r", script.text("r", 1, ["ok"]))
    r = post(app_client, b'{"model": "tiny-test", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert r.status_code == 200, r.text
    assert engine.submitted[0].input.messages[0]["content"] == "\N{GRINNING FACE}"


def _nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


@pytest.mark.parametrize("depth,status", [(MAX_JSON_DEPTH - 1, 200), (MAX_JSON_DEPTH, 400)])
def test_the_nesting_bound_is_exact(engine, app_client, script, depth, status):
    """The body and then ``depth`` nested lists: depth + 1 levels in all (anything but the nesting may be
    refused otherwise)."""
    engine.next = lambda req: script.Handle("r", script.text("r", 1, ["ok"]))
    content: list = ["x"]
    for _ in range(depth - 1):
        content = [content]
    raw = json.dumps({"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "metadata": content})
    r = post(app_client, raw.encode())
    if status == 400:
        assert r.status_code == 400 and r.json()["error"]["code"] == "nesting_too_deep", r.text
    else:
        assert r.json().get("error", {}).get("code") != "nesting_too_deep", r.text


def test_deep_tool_parameters_are_a_400_naming_the_limit(engine, app_client):
    deep = '{"p": ' * 500 + "1" + "}" * 500  # 500 levels, as the fuzzer sent
    raw = json.dumps({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "@"}}]})
    r = post(app_client, raw.replace('"@"', deep).encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "nesting_too_deep" and f"more than {MAX_JSON_DEPTH} levels" in err["message"]
    assert err["param"].startswith("tools[0].function.parameters.p.p")
    assert engine.submitted == []


def test_nesting_within_the_limit_reaches_the_engine(engine, app_client, script):
    engine.next = lambda req: script.Handle("r", script.text("r", 1, ["ok"]))
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(20)}}]
    r = post(app_client, json.dumps({**CHAT, "tools": tools}).encode())
    assert r.status_code == 200, r.text


def test_error_bodies_always_encode():
    r = APIError(400, "bad text \ud800 and \N{SNOWMAN}", param="x\udc80").response()
    body = json.loads(r.body)
    assert body["error"]["message"] == "bad text \ud800 and \N{SNOWMAN}"
    assert r.body.isascii()
    assert APIError(400, "\ud800").sse().isascii()


def test_a_500_names_a_request_id_and_logs_the_details(engine, app_client, caplog):
    def explode(req):
        raise RuntimeError("secret internal detail /opt/ninfer/x.py")
    engine.next = explode
    with caplog.at_level(logging.ERROR, logger="ninfer_serve"):
        r = post(app_client, json.dumps(CHAT).encode())
    assert r.status_code == 500
    err = r.json()["error"]
    assert "secret" not in r.text and "RuntimeError" not in r.text
    assert err["type"] == "internal_server_error" and "request id" in err["message"]
    rid = err["message"].split("request id ", 1)[1].split(";", 1)[0]
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and "secret internal detail" in logged[0].getMessage()


def test_an_unexpected_error_in_the_gateway_is_a_500_with_a_request_id(engine, app_client, caplog, monkeypatch):
    gw = app_client.app.state.gateway

    def broken(*a, **k):
        raise ValueError("internal bookkeeping broke")
    monkeypatch.setattr(gw, "_check_budget", broken)
    with caplog.at_level(logging.ERROR, logger="ninfer_serve"):
        r = post(app_client, json.dumps(CHAT).encode())
    assert r.status_code == 500 and "bookkeeping" not in r.text and "request id" in r.json()["error"]["message"]
    assert any("bookkeeping" in (rec.exc_text or "") or rec.exc_info for rec in caplog.records)


def test_whole_message_has_no_tool_calls_when_there_are_none(engine, app_client, script):
    engine.next = lambda req: script.Handle("r", script.text("r", 2, ["Hel", "lo"]))
    r = post(app_client, json.dumps(CHAT).encode())
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == "Hello"


def test_openapi_document_describes_the_request_bodies(app_client):
    doc = app_client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/tokenize",
                                 "/detokenize", "/tokenizer_info"}
    schemas = doc["components"]["schemas"]
    for path, cls in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest)):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        schema = schemas[name]
        import attrs
        assert set(schema["properties"]) == {f.name for f in attrs.fields(cls)}
        assert schema["additionalProperties"] is False
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["n"] == {"type": "integer", "default": 1}
    message = schemas["ChatMessage"]
    assert message["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool", "function"]
    assert message["additionalProperties"] is True  # vendor fields inside messages are ignored
    # every reference resolves
    refs = [v for v in json.dumps(doc).split('"$ref": "')[1:]]
    for ref in refs:
        assert ref.split('"', 1)[0].rsplit("/", 1)[1] in schemas
