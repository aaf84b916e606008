"""Quantized artifacts through the user's commands on the CPU: ``ninfer generate`` gives the Engine's greedy text,
and a real ``ninfer serve`` process answers an OpenAI chat completion over HTTP for an FP8 and an NVFP4 artifact
(published Qwen fine-grained FP8, dense; ModelOpt NVFP4, MoE), every gauge back at zero afterwards."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")
openai = pytest.importorskip("openai")

from ninfer.cli import main as ninfer_main  # noqa: E402
from ninfer.contract import EngineConfig  # noqa: E402
from ninfer.contract.prompt import TextInput  # noqa: E402
from ninfer.contract.request import GenerationRequest, SamplingParams  # noqa: E402
from ninfer_convert.convert import convert_checkpoint  # noqa: E402
from ninfer_qwen35.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from ninfer_qwen35.testing.quantized_checkpoints import quantize_tiny_checkpoint  # noqa: E402
from ninfer_serve.testing import ServerProcess, scrape, wait_idle  # noqa: E402

DIMS128 = dict(hidden_size=128, head_dim=32, num_key_value_heads=4, intermediate_size=256)  # whole FP8 blocks
ARTIFACTS = {"fp8": ("fp8", DIMS128), "nvfp4-moe": ("modelopt_nvfp4", dict(moe=True))}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qserve")
    out = {}
    for name, (scheme, dims) in ARTIFACTS.items():
        ckpt = quantize_tiny_checkpoint(make_tiny_checkpoint(root / name, mtp=False, seed=2, **dims), scheme)
        out[name] = root / f"{name}.ninfer"
        convert_checkpoint(ckpt, out[name])
    return out


def test_generate_prints_the_engines_greedy_text(artifacts, capsys, one_cpu_thread):
    import ninfer

    path = artifacts["nvfp4-moe"]
    assert ninfer_main(["generate", str(path), "--prompt", "The quick", "--max-tokens", "8", "--temperature", "0",
                        "--ignore-eos", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "8 generated tokens" in err
    with ninfer.Engine(path, EngineConfig(device="cpu", max_concurrency=1)) as eng:
        result = eng.generate(GenerationRequest(input=TextInput(text="The quick"), sampling=SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True)), timeout=120)
        assert eng.usage().idle
        eng.clear_context_cache()  # the prompt's checkpoints are the cache's until dropped
        assert eng.usage().all_free
    assert out.rstrip("\n") == result.content


@pytest.mark.parametrize("name", sorted(ARTIFACTS))
def test_serve_answers_a_chat_completion(artifacts, name):
    with ServerProcess(artifacts[name], "--model-id", "q", "--device", "cpu", "--max-concurrency", "2",
                       "--max-model-len", "512") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="q", messages=[{"role": "user", "content": "Say hello."}],
                                               max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
        assert reply.choices[0].message.role == "assistant"
        wait_idle(lambda: scrape(srv.url))
