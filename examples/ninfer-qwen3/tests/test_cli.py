"""The plugin through the normal CLI: ``ninfer convert`` a Hugging Face Qwen3 checkpoint, then ``ninfer
generate``, ``ninfer score`` and ``ninfer serve`` the artifact (a real server process on loopback answering
a chat completion). Greedy tokens are transformers'; scored logprobs agree within LOGPROB_ATOL."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

import ninfer  # noqa: E402
from ninfer.cli import main  # noqa: E402
from ninfer.contract import ChatInput, GenerationRequest, SamplingParams, TextInput  # noqa: E402
from ninfer_serve.testing import ServerProcess, scrape, wait_idle  # noqa: E402

LOGPROB_ATOL = 1e-4
TEXT = "Hello world, this is a test of the tiny model."
HI = [{"role": "user", "content": "Say hello."}]
NO_THINK = {"enable_thinking": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory, make_qwen3_checkpoint):
    """(transformers model, path of the artifact ``ninfer convert`` wrote)."""
    root = tmp_path_factory.mktemp("qwen3_cli")
    hf = make_qwen3_checkpoint(root / "ckpt")
    assert main(["convert", str(root / "ckpt"), str(root / "tiny.ninfer")]) == 0
    return hf, str(root / "tiny.ninfer")


def engine(path: str) -> ninfer.Engine:
    return ninfer.Engine(path, ninfer.EngineConfig(device="cpu", max_concurrency=1))


def test_generate_streams_transformers_greedy_continuation(model, capsys):
    hf, path = model
    assert main(["generate", path, "--prompt", TEXT, "--temperature", "0", "--ignore-eos", "--max-tokens", "24",
                 "--device", "cpu", "--prefill-chunk", "4"]) == 0
    printed = capsys.readouterr()
    with engine(path) as eng:
        prompt = eng.frontend.prepare(TextInput(text=TEXT)).token_ids
        result = eng.generate(GenerationRequest(input=TextInput(text=TEXT), sampling=GREEDY), timeout=120)
    assert f"finish: length | {len(prompt)} prompt + 24 generated tokens" in printed.err
    assert printed.out.rstrip("\n") == result.content
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):]
    assert result.token_ids == tuple(want.tolist())


def test_score_gives_transformers_logprobs(model, capsys):
    hf, path = model
    assert main(["score", path, TEXT, "--json", "--device", "cpu"]) == 0
    scored = json.loads(capsys.readouterr().out)
    ids = torch.tensor(scored["token_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
    want = logprobs[:-1].gather(1, ids[1:, None])[:, 0]
    assert scored["token_logprobs"][0] is None
    assert scored["token_logprobs"][1:] == pytest.approx(want.tolist(), abs=LOGPROB_ATOL)
    assert scored["total_nll"] == pytest.approx(-float(want.sum()), abs=len(want) * LOGPROB_ATOL)


def test_serve_answers_a_chat_completion(model):
    _, path = model
    with ServerProcess(path, "--model-id", "tiny-qwen3", "--max-concurrency", "2", "--device", "cpu") as server:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]] == ["tiny-qwen3"]
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny-qwen3", "messages": HI, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": NO_THINK})
        assert reply.status_code == 200, reply.text
        wait_idle(lambda: scrape(server.url))  # every slot, page and host byte back
    body = reply.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 8
    with engine(path) as eng:
        want = eng.generate(GenerationRequest(input=ChatInput(messages=HI, template_kwargs=NO_THINK),
                                              sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    assert body["usage"]["prompt_tokens"] == want.usage.prompt_tokens
    assert (choice["message"].get("content") or "") == want.content
