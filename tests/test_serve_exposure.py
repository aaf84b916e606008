"""Exposure defaults of a real ``ninfer serve`` process: the API key from ``NINFER_API_KEY`` guards /v1 (the
official client works with it), /health and /metrics stay open, a foreign Host is refused on a loopback
bind, and a text/plain body (a browser's cross-site simple request) never reaches the engine."""

from __future__ import annotations

import http.client
import json

import httpx
import openai
import pytest

from ninfer import env
from ninfer_serve.testing import ServerProcess, scrape, tiny_model

DEVICE = env.get("NINFER_SERVE_TEST_DEVICE")
KEY = "sk-local-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tiny_model(tmp_path_factory.getbasetemp()), "--model-id", "tiny", "--device", DEVICE,
                       "--no-warmup", env={"NINFER_API_KEY": KEY}) as srv:
        yield srv


def test_key_from_the_environment_guards_v1(server):
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.choices[0].message.role == "assistant"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_a_rebinding_host_name_is_refused_on_loopback(server):
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=30)
    try:
        conn.request("GET", "/health", headers={"Host": "attacker.example"})
        r = conn.getresponse()
        assert r.status == 400 and json.loads(r.read())["error"]["code"] == "host_not_allowed"
    finally:
        conn.close()


def test_a_text_plain_post_never_reaches_the_engine(server):
    before = scrape(server.url).get("ninfer:prompt_tokens_total", 0)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    r = httpx.post(server.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "text/plain", "authorization": f"Bearer {KEY}"})
    assert r.status_code == 415
    assert scrape(server.url).get("ninfer:prompt_tokens_total", 0) == before
