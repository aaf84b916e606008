"""Who shares the context cache over HTTP: vLLM's ``cache_salt`` becomes the engine's ``cache_salt``; with
several API keys every request is scoped by the key that authenticated it (scope = key, salt), so one
tenant's prompts never come back as another's ``cached_tokens`` (the timing side channel of issue 42).
Also ``max_tokens: null``: absent on completions (16), no limit on chat, as in OpenAI.

The pass-through runs against the scripted engine (conftest.py); the isolation itself through the real
engine on the embedded model, in process."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.contract.request import MAX_CACHE_SALT_CHARS
from ninfer_serve.translate import MAX_CLIENT_CACHE_SALT_CHARS
from ninfer_serve.warmup import warmup

CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny-test", "prompt": "hi"}
ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
KEYS = ("sk-tenant-a", "sk-tenant-b")


def bearer(key):
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def answering(engine, script, client):
    engine.next = lambda r: script.Handle(r.request_id, script.text(r.request_id, 2, ["x"]))
    return lambda **kw: client(engine, **kw)


def test_the_engine_bound_leaves_room_for_a_key_scope():
    assert MAX_CLIENT_CACHE_SALT_CHARS + 64 <= MAX_CACHE_SALT_CHARS


# -- cache_salt ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", ENDPOINTS)
@pytest.mark.parametrize("salt,words", [
    (5, "expected a string or null, got an integer"), (["a"], "got an array"), (True, "got a boolean"),
    ("", "must be a non-empty string"),
    ("s" * (MAX_CLIENT_CACHE_SALT_CHARS + 1), f"at most {MAX_CLIENT_CACHE_SALT_CHARS} characters"),
])
def test_a_bad_cache_salt_is_400_naming_it(engine, answering, path, body, salt, words):
    r = answering().post(path, json={**body, "cache_salt": salt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
    assert words in error["message"] and "cache_salt" in error["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_cache_salt_reaches_the_engine(engine, answering, path, body):
    c = answering()
    longest = "s" * MAX_CLIENT_CACHE_SALT_CHARS
    for sent in ("tenant-7", longest):
        assert c.post(path, json={**body, "cache_salt": sent}).status_code == 200
    assert c.post(path, json=body).status_code == 200
    two = {**body, "cache_salt": "t", "n": 2, "seed": 1, "temperature": 0.5}
    assert c.post(path, json=two).status_code == 200
    assert [r.cache_salt for r in engine.submitted] == ["tenant-7", longest, None, "t", "t"]


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_one_key_leaves_the_scope_to_the_client(engine, answering, path, body):
    c = answering(api_key="only-key")
    assert c.post(path, json=body, headers=bearer("only-key")).status_code == 200
    assert c.post(path, json={**body, "cache_salt": "s"}, headers=bearer("only-key")).status_code == 200
    assert [r.cache_salt for r in engine.submitted] == [None, "s"]


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_several_keys_scope_every_request_by_its_key(engine, answering, path, body):
    c = answering(api_key=KEYS)
    for key in (*KEYS, KEYS[0]):
        assert c.post(path, json=body, headers=bearer(key)).status_code == 200
        assert c.post(path, json={**body, "cache_salt": "s"}, headers=bearer(key)).status_code == 200
    assert c.post(path, json=body, headers=bearer("sk-tenant-c")).status_code == 401
    a, a_s, b, b_s, a2, a2_s = [r.cache_salt for r in engine.submitted]
    assert a is not None and b is not None and a != b and (a, a_s) == (a2, a2_s)  # same key, same scope
    assert a_s == f"{a}:s" and b_s == f"{b}:s"  # scope = (key, salt)
    assert not any(k in s for s in (a, b) for k in KEYS)  # a digest, never the key


# -- max_tokens: null -------------------------------------------------------------------------------------
def test_null_max_tokens_means_absent(engine, answering):
    c = answering()
    for body in (COMPLETION, {**COMPLETION, "max_tokens": None}, {**COMPLETION, "max_tokens": 3}):
        assert c.post("/v1/completions", json=body).status_code == 200
    assert [r.sampling.max_tokens for r in engine.submitted] == [16, 16, 3]  # OpenAI's completions default
    engine.submitted.clear()
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}, {"max_tokens": 5},
                  {"max_tokens": 5, "max_completion_tokens": None},
                  {"max_tokens": None, "max_completion_tokens": 4}):
        assert c.post("/v1/chat/completions", json={**CHAT, **extra}).status_code == 200
    assert [r.sampling.max_tokens for r in engine.submitted] == [None, None, None, 5, 5, 4]  # chat: no limit


# -- the real engine on the embedded model, in process -----------------------------------------------------
@pytest.fixture(scope="module")
def real_engine(embedded_model, one_cpu_thread):
    with ninfer.Engine(embedded_model, ninfer.EngineConfig(device="cpu", max_concurrency=2,
                                                           max_model_len=256)) as engine:
        warmup(engine, concurrency=2)
        yield engine


def cached(c, path, body, **kw):
    r = c.post(path, json=body, **kw)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_real_engine_salts_and_keys_do_not_share(real_engine, client, path, body):
    real_engine.clear_context_cache()
    text = f"Tell me about the salt of {path}, please, in a few words."
    body = {**body, "model": real_engine.model_name, "max_tokens": 2, "temperature": 0}
    body = {**body, "messages": [{"role": "user", "content": text}]} if "messages" in body \
        else {**body, "prompt": text}
    c = client(real_engine, api_key=KEYS)
    a, b = bearer(KEYS[0]), bearer(KEYS[1])
    assert cached(c, path, body, headers=a) == 0
    assert cached(c, path, body, headers=b) == 0  # another key: nothing of the first's is restored
    assert cached(c, path, {**body, "cache_salt": "x"}, headers=a) == 0  # another salt under the same key
    assert cached(c, path, body, headers=a) > 0 and cached(c, path, body, headers=b) > 0  # each key its own
    assert cached(c, path, {**body, "cache_salt": "x"}, headers=a) > 0
    assert cached(c, path, {**body, "cache_salt": "x"}, headers=b) == 0
    open_server = client(real_engine)
    assert cached(open_server, path, body) == 0  # a keyless request reaches none of the tenants' entries
    assert cached(open_server, path, {**body, "cache_salt": "y"}) == 0
    assert cached(open_server, path, {**body, "cache_salt": "y"}) > 0
    assert real_engine.usage().idle
    real_engine.clear_context_cache()
    assert real_engine.usage().all_free
