"""A stop string longer than MAX_STOP_CHARS is a 400 naming the parameter and the limit, before any engine work."""

import pytest
from starlette.testclient import TestClient

from ninfer.contract.request import MAX_STOP_CHARS
from ninfer_serve.app import create_app

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "tiny-test", "messages": USER}),
    ("/v1/completions", {"model": "tiny-test", "prompt": "hi"}),
])
def test_megabyte_stop_string_is_rejected_with_400(engine, path, body):
    r = TestClient(create_app(engine)).post(path, json={**body, "stop": ["x", "s" * (1 << 20)]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stop" and error["type"] == "invalid_request_error"
    assert f"at most {MAX_STOP_CHARS} characters" in error["message"]
    assert engine.submitted == []


def test_stop_string_at_the_limit_is_accepted(engine, script):
    engine.next = lambda r: script.Handle("r1", script.text("r1", 3, ["ok"]))
    body = {"model": "tiny-test", "messages": USER, "stop": "s" * MAX_STOP_CHARS}
    r = TestClient(create_app(engine)).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert engine.submitted[0].sampling.stop == ("s" * MAX_STOP_CHARS,)
