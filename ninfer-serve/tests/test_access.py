"""Exposure: the API key on /v1 (401 in the OpenAI shape; /health, /metrics, /openapi.json open), the Host
check against DNS rebinding, JSON-only POST bodies (415) and CORS off unless origins are given."""

from __future__ import annotations

import hmac
import json

import pytest

from ninfer_serve.access import api_keys, default_allowed_hosts, host_name

CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}
KEY = "sk-test-\N{SNOWMAN}-key"


@pytest.fixture
def open_for(engine, script, client):
    """``open_for(**create_app_options)``: a started client over the scripted engine that answers 'ok'."""
    engine.next = lambda req: script.Handle("r", script.text("r", 1, ["ok"]))
    return lambda **kw: client(engine, **kw)


def test_api_key_guards_every_v1_route(open_for, engine, monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    c = open_for(api_key="secret-key")
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/tiny-test"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/completions"), ("GET", "/v1/nothing")):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic secret-key"},
                        {"authorization": "secret-key"}):
            r = c.request(method, path, json=CHAT, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert compared  # the key is compared in constant time
    assert engine.submitted == []
    ok = {"authorization": "Bearer secret-key"}
    assert c.get("/v1/models", headers=ok).status_code == 200
    assert c.post("/v1/chat/completions", json=CHAT, headers=ok).status_code == 200
    for open_path in ("/health", "/metrics", "/openapi.json"):  # open, as in vLLM
        assert c.get(open_path).status_code == 200, open_path


def test_api_key_may_hold_any_text(open_for):
    c = open_for(api_key=KEY)
    raw = ("Bearer " + KEY).encode("utf-8")
    r = c.get("/v1/models", headers=[(b"authorization", raw)])
    assert r.status_code == 200, r.text
    assert c.get("/v1/models", headers={"authorization": "Bearer sk-test"}).status_code == 401


def test_without_a_key_the_api_is_open(open_for):
    assert open_for().get("/v1/models").status_code == 200


@pytest.mark.parametrize("host,allowed", [("localhost:8000", True), ("127.0.0.1:8000", True), ("[::1]:8000", True),
                                          ("LOCALHOST", True), ("attacker.example:8000", False),
                                          ("127.0.0.1.nip.io", False), ("", False)])
def test_loopback_default_refuses_foreign_host_names(open_for, host, allowed):
    """A DNS-rebinding page reaches 127.0.0.1 under its own name: that name is refused."""
    c = open_for(allowed_hosts=default_allowed_hosts("127.0.0.1"))
    r = c.post("/v1/chat/completions", json=CHAT, headers={"host": host})
    if allowed:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        assert c.get("/metrics", headers={"host": host}).status_code == 400


def test_allowed_hosts_patterns(open_for):
    c = open_for(allowed_hosts=["api.example.com", "*.internal"])
    assert c.get("/health", headers={"host": "api.example.com"}).status_code == 200
    assert c.get("/health", headers={"host": "gpu1.internal:8000"}).status_code == 200
    assert c.get("/health", headers={"host": "example.com"}).status_code == 400


def test_default_hosts_by_bind_address():
    assert set(default_allowed_hosts("127.0.0.1")) == {"localhost", "127.0.0.1", "::1"}
    assert set(default_allowed_hosts("::1")) == {"localhost", "127.0.0.1", "::1"}
    assert default_allowed_hosts("0.0.0.0") == ("*",)
    assert [host_name(h) for h in ("a.b:80", "[::1]:80", "[::1]", "A.B")] == ["a.b", "::1", "::1", "a.b"]


@pytest.mark.parametrize("ctype", [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/jsonp"])
def test_post_bodies_must_be_declared_json(open_for, engine, ctype):
    """Cross-site "simple" requests (text/plain, forms, no type) cannot reach the engine."""
    c = open_for()
    headers = {} if ctype is None else {"content-type": ctype}
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = c.post(path, content=json.dumps(CHAT).encode(), headers=headers)
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    assert engine.submitted == []
    ok = c.post("/v1/chat/completions", content=json.dumps(CHAT).encode(),
                headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_cors_is_off_by_default(open_for):
    c = open_for()
    pre = c.options("/v1/chat/completions", headers={"origin": "https://evil.example",
                                                      "access-control-request-method": "POST",
                                                      "access-control-request-headers": "content-type"})
    assert "access-control-allow-origin" not in pre.headers
    r = c.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_opt_in_allows_only_the_given_origins(open_for):
    c = open_for(allowed_origins=["https://app.example"], api_key="k")
    pre = c.options("/v1/chat/completions", headers={"origin": "https://app.example",
                                                      "access-control-request-method": "POST",
                                                      "access-control-request-headers": "authorization, content-type"})
    assert pre.status_code == 200  # a preflight needs no key
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    r = c.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://app.example", "authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = c.options("/v1/chat/completions", headers={"origin": "https://evil.example",
                                                        "access-control-request-method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_several_keys_are_each_compared_in_constant_time(open_for, monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    c = open_for(api_key=["k-1", "k-2", "k-3"])
    for key in ("k-1", "k-3"):
        compared.clear()
        assert c.get("/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200
        assert len(compared) == 3  # every key, whichever matched
    assert c.get("/v1/models", headers={"authorization": "Bearer k-4"}).status_code == 401


def test_api_keys_are_normalized():
    assert api_keys(None) == api_keys("") == () and api_keys("k") == ("k",)
    assert api_keys(["b", "a", "b"]) == ("b", "a")  # a repeated key counts once
    with pytest.raises(ValueError, match="must not be empty"):
        api_keys(["a", ""])
