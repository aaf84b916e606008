"""What evaluation harnesses send to ``/v1/completions`` (``echo`` with ``logprobs``, ``max_tokens`` 0 or 1,
batched prompts, vLLM's ``prompt_logprobs``) and the tokenizer routes, against the embedded model on the CPU.
The echoed prompt logprobs are ``ninfer score``'s, exactly."""

from __future__ import annotations

import json
import math
import time

import pytest
from starlette.testclient import TestClient

from ninfer.contract import EngineConfig
from ninfer_serve.app import create_app

TEXT = "The quick brown fox jumps over the lazy dog. It was not amused."
OTHER = "Paris is the capital of"


@pytest.fixture(scope="module")
def engine(embedded_model, one_cpu_thread):
    from ninfer import Engine

    with Engine(embedded_model, EngineConfig(device="cpu", max_concurrency=4, max_model_len=512)) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, model_id="tiny", http_threads=2)) as client:
        yield client


def post(client, path, body, status=200):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def tokenize(client, text):
    return post(client, "/tokenize", {"prompt": text})["tokens"]


@pytest.fixture(scope="module")
def scored():
    """``ninfer score --json TEXT`` on the embedded model, as a user runs it."""
    import contextlib
    import io

    from ninfer.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["score", "--json", "--device", "cpu", TEXT]) == 0
    return json.loads(out.getvalue())


def test_echo_logprobs_are_ninfer_score_exactly(client, scored):
    body = post(client, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 0})
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    ids = tokenize(client, TEXT)
    assert ids == scored["token_ids"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"] == scored["token_logprobs"]  # the same windows, the same numbers
    assert "".join(lp["tokens"]) == TEXT and len(lp["tokens"]) == len(ids)
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
    for got, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert len(top) == 2 and max(top.values()) >= got
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_lm_eval_loglikelihood_payload(client):
    """lm-eval's local-completions: token prompts in a batch, echo, logprobs 1, max_tokens 1, temperature 0."""
    prompts = [tokenize(client, TEXT), tokenize(client, OTHER), tokenize(client, OTHER + " France")]
    body = post(client, "/v1/completions", {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1,
                                            "logprobs": 1, "seed": 1234, "echo": True})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for ids, choice in zip(prompts, body["choices"], strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
        alone = post(client, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0})
        assert lp["token_logprobs"][:-1] == alone["choices"][0]["logprobs"]["token_logprobs"]
        assert choice["text"].startswith(alone["choices"][0]["text"])
        # lm-eval's is_greedy: a token equal to its top-1 logprob was the argmax
        for tok, top in zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1], strict=True):
            assert len(top) == 1 and tok <= max(top.values())
        assert lp["text_offset"][-1] == len(alone["choices"][0]["text"])
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 3


def test_vllm_prompt_logprobs(client):
    body = post(client, "/v1/completions", {"prompt": OTHER, "prompt_logprobs": 3, "max_tokens": 0, "echo": True,
                                            "logprobs": 3})
    choice = body["choices"][0]
    ids = tokenize(client, OTHER)
    plp, lp = choice["prompt_logprobs"], choice["logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        entry = plp[i]
        mine = entry[str(ids[i])]
        assert mine["logprob"] == lp["token_logprobs"][i] and mine["decoded_token"] == lp["tokens"][i]
        assert mine["rank"] >= 1 and 3 <= len(entry) <= 4
        ranked = sorted((e for k, e in entry.items() if k != str(ids[i]) or e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:3] == [1, 2, 3]
        assert sorted(e["logprob"] for e in ranked[:3]) == sorted(lp["top_logprobs"][i].values())
        assert (mine["rank"] == 1) == math.isclose(mine["logprob"], ranked[0]["logprob"])


def test_batched_prompts_equal_single_requests(client):
    prompts = [OTHER, TEXT]
    body = post(client, "/v1/completions", {"prompt": prompts, "max_tokens": 4, "temperature": 0, "n": 2})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert body["choices"][2 * i]["text"] == body["choices"][2 * i + 1]["text"] == alone["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == sum(len(tokenize(client, p)) for p in prompts)
    err = post(client, "/v1/completions", {"prompt": [OTHER] * 65}, status=400)["error"]
    assert err["param"] == "prompt" and "64" in err["message"]


def test_streamed_echo_starts_with_the_prompt(client):
    with client.stream("POST", "/v1/completions", json={"prompt": OTHER, "echo": True, "logprobs": 1, "stream": True,
                                                        "max_tokens": 2, "temperature": 0}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == OTHER and first["logprobs"]["token_logprobs"][0] is None
    whole = post(client, "/v1/completions", {"prompt": OTHER, "echo": True, "logprobs": 1, "max_tokens": 2,
                                             "temperature": 0})["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets[:len(whole["logprobs"]["text_offset"])] == whole["logprobs"]["text_offset"]


def test_tokenizer_routes(client, engine):
    out = post(client, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
    assert "".join(out["token_strs"]) == TEXT
    assert post(client, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": TEXT}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] and info["bos_token"] is None
    assert tokenize(client, info["eos_token"]) == [engine.frontend.eos_token_ids[0]]  # lm-eval's eos_token_id
    messages = [{"role": "user", "content": "Say hello."}]
    chat = post(client, "/tokenize", {"messages": messages})
    usage = post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    bare = post(client, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
    ("/tokenize", {"prompt": "a", "extra": 1}, "extra"), ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/tokenize", {"messages": [{"role": "x"}]}, "messages[0].role"),
])
def test_tokenizer_routes_refuse_bad_input(client, path, body, param):
    assert post(client, path, body, status=400)["error"]["param"] == param


def test_tokenizer_routes_need_the_api_key(engine):
    with TestClient(create_app(engine, model_id="tiny", http_threads=1, api_key="k")) as guarded:
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info")):
            assert guarded.request(method, path, json={"prompt": "a"}).status_code == 401
        ok = guarded.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["count"] == 1


def test_echo_while_every_slot_generates_scores_alike(client, engine):
    """Scoring waits for a slot and pages generation holds, and gives the numbers it gives on an idle engine."""
    from ninfer.contract import GenerationRequest, SamplingParams, TextInput

    idle = post(client, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 0})
    busy = [engine.submit(GenerationRequest(input=TextInput(text=OTHER),
                                            sampling=SamplingParams(max_tokens=48, ignore_eos=True)))
            for _ in range(4)]
    try:
        deadline = time.monotonic() + 60
        while engine.metrics().running < 4 and time.monotonic() < deadline:  # every slot taken
            time.sleep(0.01)
        during = post(client, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 0})
    finally:
        results = [h.result(120) for h in busy]
    assert during["choices"][0]["logprobs"] == idle["choices"][0]["logprobs"]
    assert all(r.usage.completion_tokens == 48 for r in results)


@pytest.mark.gpu
def test_scoring_between_pipelined_cuda_steps_changes_nothing(embedded_model):
    """On CUDA (decode graphs, pipelined steps) a prompt scored while every slot generates gets the numbers it
    gets on an idle engine, and the generating requests get the tokens they get without it."""
    from ninfer import Engine
    from ninfer.contract import GenerationRequest, SamplingParams, TextInput

    def busy_requests(engine):
        return [engine.submit(GenerationRequest(input=TextInput(text=OTHER + " " * i),
                                                sampling=SamplingParams(max_tokens=64, ignore_eos=True,
                                                                        temperature=0)))
                for i in range(4)]

    # a fifth lane: scoring need not wait for a slot (the CPU test covers that), so it runs between steps
    with Engine(embedded_model, EngineConfig(device="cuda", max_concurrency=5, max_model_len=512)) as engine:
        ids = engine.instance.frontend.prepare(TextInput(text=TEXT)).token_ids
        idle = engine.score(ids, top=2)
        alone = [h.result(120).token_ids for h in busy_requests(engine)]
        handles = busy_requests(engine)
        during = []
        while len(during) < 8:
            during.append(engine.score(ids, top=2))
        assert [h.result(120).token_ids for h in handles] == alone
    assert all(d.logprobs == idle.logprobs and d.top == idle.top for d in during)
    assert all(math.isfinite(x) for x in idle.logprobs)
