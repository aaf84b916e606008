"""lm-evaluation-harness against a real ``ninfer serve`` app (the embedded model on the CPU, in-process on a
loopback port): its ``local-completions`` model with the remote tokenizer runs a loglikelihood task
(multiple choice) and a generate_until task on local JSONL files, and every loglikelihood it computed equals
``ninfer score`` of the same text; its ``local-chat-completions`` model runs a generate_until task against the
shared ``ninfer serve`` process (data/). The hub stays offline: datasets reads the local files only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

lm_eval = pytest.importorskip("lm_eval")

import datasets.config  # noqa: E402
import huggingface_hub.constants  # noqa: E402

from ninfer.contract import EngineConfig  # noqa: E402
from ninfer_serve.app import create_app  # noqa: E402
from ninfer_serve.testing import ThreadServer  # noqa: E402

from .conftest import MODEL_ID  # noqa: E402

DATA = Path(__file__).parent / "data"

DOCS = [{"question": "The capital of France is", "choices": [" Paris", " Rome", " a dog"], "answer": 0},
        {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
        {"question": "The sky on a clear day is", "choices": [" blue", " green", " made of cheese"], "answer": 0}]

MC_TASK = """task: ninfer_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GEN_TASK = """task: ninfer_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def served(embedded_model, one_cpu_thread):
    from ninfer import Engine

    with Engine(embedded_model, EngineConfig(device="cpu", max_concurrency=4, max_model_len=512)) as engine:
        with ThreadServer(create_app(engine, model_id="tiny", http_threads=2)) as server:
            yield server


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    (root / "mc.yaml").write_text(MC_TASK.format(data=data), encoding="utf-8")
    (root / "gen.yaml").write_text(GEN_TASK.format(data=data), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def reference():
    """``ninfer score``'s own path (ninfer.cli.score): the embedded model started for scoring alone."""
    import ninfer
    from ninfer.contract.config import StartupOptions
    from ninfer.contract.prompt import TextInput
    from ninfer.engine.scoring import DEFAULT_WINDOW, CausalScoreCore
    from ninfer.engine.startup import build_instance

    options = StartupOptions(device="cpu", max_concurrency=1, cuda_graphs=False)
    instance, _, artifact = build_instance(ninfer.default_model_path(), options)
    program = instance.program
    core = CausalScoreCore(program, window=min(DEFAULT_WINDOW, program.max_model_len))

    def score(context: str, continuation: str) -> float:
        """log p(continuation | context), the continuation's tokens as lm-eval splits them (a context's
        trailing spaces go with the continuation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ids = instance.frontend.prepare(TextInput(text=context + continuation)).token_ids
        ctx = len(instance.frontend.prepare(TextInput(text=context)).token_ids)
        return math.fsum(core.score(ids).logprobs[ctx - 1:])

    yield score
    instance.frontend.close()
    artifact.close()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub: the variables for anything that reads them later, the flags for what read them at import."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def evaluate(served, tasks, task):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = {"model": "tiny", "base_url": f"{served.url}/v1/completions", "tokenizer_backend": "auto",
            "num_concurrent": 1, "batch_size": 4, "max_retries": 1, "timeout": 120, "max_length": 512}
    return simple_evaluate(model="local-completions", model_args=args, tasks=[task],
                           task_manager=TaskManager(include_path=str(tasks), include_defaults=False), log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def test_loglikelihood_task_equals_ninfer_score(served, tasks, reference):
    out = evaluate(served, tasks, "ninfer_tiny_mc")
    samples = out["samples"]["ninfer_tiny_mc"]
    assert len(samples) == len(DOCS) and 0.0 <= out["results"]["ninfer_tiny_mc"]["acc,none"] <= 1.0
    compared = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            logprob, _greedy = resp[0]
            assert logprob == pytest.approx(reference(context, continuation), abs=1e-4)
            compared += 1
    assert compared == sum(len(d["choices"]) for d in DOCS)
    metrics = httpx.get(f"{served.url}/metrics").text  # lm-eval found and used the tokenizer routes
    assert 'endpoint="tokenizer_info"' in metrics and 'endpoint="tokenize",status="200"' in metrics


def test_generate_until_task_runs(served, tasks):
    out = evaluate(served, tasks, "ninfer_tiny_gen")
    samples = out["samples"]["ninfer_tiny_gen"]
    assert len(samples) == len(DOCS)
    assert all(isinstance(s["resps"][0][0], str) and "\n" not in s["resps"][0][0] for s in samples)
    assert "exact_match,none" in out["results"]["ninfer_tiny_gen"]


def test_chat_generate_until_task(monkeypatch, base_url):
    """``local-chat-completions`` with lm-eval's chat template on: a generate_until task through the chat route."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(DATA)  # the task's data_files are relative to its folder
    out = simple_evaluate(model="local-chat-completions", model_args={
        "model": MODEL_ID, "base_url": base_url + "/chat/completions", "num_concurrent": 1, "max_retries": 1},
        tasks=["ninfer_gen"], apply_chat_template=True, log_samples=True,
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False))
    assert 0.0 <= out["results"]["ninfer_gen"]["exact_match,none"] <= 1.0
    samples = out["samples"]["ninfer_gen"]
    assert len(samples) == 2 and all(isinstance(s["resps"][0][0], str) for s in samples)
