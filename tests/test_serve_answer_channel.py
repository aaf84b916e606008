"""Through the engine and the HTTP app on the embedded model (CPU): stop strings cut the answer, never the
reasoning, and logprob entries travel with the text they produce (chat: exactly the content tokens;
completions: ``text_offset`` and tokens line up with the text, streamed and whole alike)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from ninfer.contract import EngineConfig
from ninfer_serve.app import create_app

QUESTION = [{"role": "user", "content": "What says the king?"}]


@pytest.fixture(scope="module")
def engine(embedded_model, one_cpu_thread):
    from ninfer import Engine

    with Engine(embedded_model, EngineConfig(device="cpu", max_concurrency=2, max_model_len=512)) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, model_id="default", http_threads=2)) as c:
        yield c


def generate(engine, text, **sampling):
    from ninfer.contract import GenerationRequest, SamplingParams, TextInput
    from ninfer.contract.events import GenerationResult

    handle = engine.submit(GenerationRequest(input=TextInput(text=text), sampling=SamplingParams(**sampling)))
    return next(e for e in handle if isinstance(e, GenerationResult))


def test_stop_strings_leave_generated_reasoning_whole(engine):
    # An open thinking block the model fills (a seeded sample; greedy, it closes the block at once).
    prompt = ("<|im_start|>user\nWhat say you of war, my lord?<|im_end|>\n<|im_start|>assistant\n"
              "<think>\nKING.\n")
    sampling = {"max_tokens": 60, "temperature": 1.0, "seed": 104}
    full = generate(engine, prompt, **sampling)
    assert full.reasoning and "\n" in full.content, (full.reasoning, full.content)  # the sample still thinks
    # the raw output has "</think>\n\n": that never stops the output; each stop string the answer holds cuts it
    for stop in [s for s in ("\n\n", "\n") if s in full.content]:
        cut = generate(engine, prompt, stop=[stop], **sampling)
        assert (cut.reasoning, cut.content) == (full.reasoning, full.content.split(stop, 1)[0])
        assert cut.finish_reason.value == "stop"


def post(client, path, **body):
    r = client.post(path, json={"model": "default", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(client, path, **body):
    with client.stream("POST", path, json={"model": "default", "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.fixture(scope="module")
def thinking(client):
    """The greedy answer with thinking on: the model closes an empty block ("\n</think>\n\n"), then answers."""
    r = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=60)
    assert r["choices"][0]["message"]["content"], r
    return r


def test_stop_string_cuts_the_answer_not_the_think_block(client, thinking):
    full = thinking["choices"][0]["message"]["content"]
    for stop in ("\n\n", " "):  # lm-eval's chat tasks send "\n\n": the answer used to come back empty
        r = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=60, stop=[stop])
        assert r["choices"][0]["message"]["content"] == full.split(stop, 1)[0]
        assert r["choices"][0]["finish_reason"] == "stop"


def test_chat_logprobs_cover_exactly_the_content(client, thinking):
    whole = post(client, "/v1/chat/completions", messages=QUESTION, max_tokens=60, logprobs=True, top_logprobs=2)
    choice = whole["choices"][0]
    entries = choice["logprobs"]["content"]
    content = thinking["choices"][0]["message"]["content"]
    assert choice["message"]["content"] == content
    assert "".join(e["token"] for e in entries) == content
    # not "\n", "</think>", "\n\n" before the answer, nor the end of turn after it
    assert len(entries) <= whole["usage"]["completion_tokens"] - 4
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in entries)
    chunks = sse(client, "/v1/chat/completions", messages=QUESTION, max_tokens=60, logprobs=True, top_logprobs=2)
    streamed = []
    for chunk in chunks:
        for c in chunk["choices"]:
            got = (c.get("logprobs") or {}).get("content") or []
            assert "".join(e["token"] for e in got) == (c["delta"].get("content") or "")  # chunk by chunk
            streamed.extend(got)
    assert streamed == entries


def test_streamed_completion_logprobs_line_up_with_the_text(client):
    body = {"prompt": "KING.\n", "max_tokens": 24, "logprobs": 1, "stop": ["\n\n"]}
    whole = post(client, "/v1/completions", **body)["choices"][0]
    lp = whole["logprobs"]
    assert "".join(lp["tokens"]) == whole["text"] and lp["text_offset"][0] == 0
    for i, tok in enumerate(lp["tokens"]):
        assert whole["text"][lp["text_offset"][i]:].startswith(tok)
    text, tokens, offsets, lps = "", [], [], []
    for chunk in sse(client, "/v1/completions", **body):
        for c in chunk["choices"]:
            if c["logprobs"] is None:
                continue
            assert "".join(c["logprobs"]["tokens"]) == c["text"]
            assert c["logprobs"]["text_offset"][:1] in ([], [len(text)])
            text += c["text"]
            tokens += c["logprobs"]["tokens"]
            offsets += c["logprobs"]["text_offset"]
            lps += c["logprobs"]["token_logprobs"]
    assert (text, tokens, offsets) == (whole["text"], lp["tokens"], lp["text_offset"])
    assert lps == pytest.approx(lp["token_logprobs"], abs=1e-4)
