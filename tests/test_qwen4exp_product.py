"""Qwen4Exp through the user's commands on the CPU, on a tiny random checkpoint written by transformers' own classes
(every part on: hyper-connections, a selecting QSA, PLE, MoE, MTP): the plugin conforms, ``ninfer generate`` prints
the Engine's greedy text, and a real ``ninfer serve`` answers the official ``openai`` client with a forced tool call
whose arguments fit the tool's schema and a ``json_schema`` response that is an instance of its schema, every gauge
back at zero afterwards. Its numerics against transformers are ninfer-qwen4exp/tests'."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from ninfer.cli import main as ninfer_main  # noqa: E402
from ninfer.contract import EngineConfig  # noqa: E402
from ninfer.contract.prompt import TextInput  # noqa: E402
from ninfer.contract.request import GenerationRequest, SamplingParams  # noqa: E402
from ninfer.testing import check_architecture, check_plugin_module  # noqa: E402
from ninfer_qwen4exp.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402
from ninfer_serve.testing import ServerProcess, scrape, wait_idle  # noqa: E402

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# The tiny tokenizer spells the tool prompt in about 900 tokens and a call in about 120.
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "metric": {"type": "boolean"}},
        "required": ["days", "metric"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for some days.",
                                           "parameters": DAYS}}]
RATING = {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "colour": {"enum": ["red", "green"]}},
          "required": ["stars", "colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4")
    ckpt = make_tiny_checkpoint(root / "ckpt", seed=3, variant="full", dtype="float32")
    return convert_tiny(ckpt, root / "q4.ninfer")


def test_the_plugin_conforms():
    check_plugin_module("ninfer_qwen4exp.plugin")
    check_architecture("qwen4exp")


def test_generate_prints_the_engines_greedy_text(artifact, capsys, one_cpu_thread):
    import ninfer

    assert ninfer_main(["generate", str(artifact), "--prompt", "The quick", "--max-tokens", "8", "--temperature",
                        "0", "--ignore-eos", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "8 generated tokens" in err
    with ninfer.Engine(artifact, EngineConfig(device="cpu", max_concurrency=1)) as eng:
        result = eng.generate(GenerationRequest(input=TextInput(text="The quick"), sampling=SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True)), timeout=120)
        eng.clear_context_cache()
        assert eng.usage().all_free
    assert out.rstrip("\n") == result.content


def test_serve_answers_tool_calls_and_json_schema(artifact):
    with ServerProcess(artifact, "--model-id", "q4", "--device", "cpu", "--max-concurrency", "2",
                       "--max-model-len", "2048") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = [{"role": "user", "content": "What is the weather?"}]
        reply = client.chat.completions.create(model="q4", messages=ask, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=400, temperature=0,
                                               extra_body=NO_THINK)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), DAYS)
        reply = client.chat.completions.create(
            model="q4", messages=ask, max_tokens=400, temperature=0, extra_body=NO_THINK,
            response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": RATING}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), RATING)
        wait_idle(lambda: scrape(srv.url))
