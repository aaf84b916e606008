"""One real ``ninfer serve`` on the embedded model, shared by every client module of this folder (a server
start is the costly part; the clients only talk to it over loopback).

The embedded model is tiny and writes verse, not answers: these tests check the protocol and the structure the
clients parse (and, under a constraint, that the structure holds), never the quality of an answer.
"""

from __future__ import annotations

import pytest

from ninfer import env
from ninfer_serve.testing import ServerProcess

MODEL_ID = "tiny"
DEVICE = env.get("NINFER_SERVE_TEST_DEVICE")  # "cuda" to run these on the GPU machine
# Qwen3.5 thinks by default and the tiny model rarely closes </think> in a small budget; clients that serve
# Qwen with vLLM pass this through their extra_body to get an answer from the first token.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="session")
def server():
    with ServerProcess(None, "--model-id", MODEL_ID, "--max-concurrency", "4", "--device", DEVICE,
                       "--max-model-len", "2048", "--no-warmup") as srv:
        yield srv


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url + "/v1"
