"""Qwen4Exp's Triton kernels inside the whole model, on the CPU through Triton's interpreter: the engine on the
tiny ``full`` checkpoint (4 streams, sigmoid GDN gate, a QSA budget that selects, PLE, 8 experts) with the
hyper-connection, sigmoid-gated norm and QSA kernels standing in for their references where CUDA would call them
gives the references' greedy tokens and logits close to theirs. What this proves is the wiring (arguments, strides,
shapes of the model's real calls); the kernels' numbers on a device are their GPU tests."""

from __future__ import annotations

import os

import pytest

from ninfer.contract.config import EngineConfig
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernels through Triton's interpreter (TRITON_INTERPRET=1, CPU only)", allow_module_level=True)
pytest.importorskip("transformers")
from ninfer_qwen4exp.testing import convert_tiny, make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# module -> the kernels of it the model's CUDA path would call (the rest of the module keeps its references)
KERNELS = {"hyper_connection": ("grouped_rms_norm", "stream_mix", "hyper_connection_inject", "hyper_connection_gates"),
           "norm": ("rms_norm_gated_sigmoid",), "qsa": ("qsa_block_scores", "qsa_attention_static")}


def _with_kernels(monkeypatch) -> list[str]:
    """Dispatch each listed op to its Triton kernel for CPU tensors too; returns the ops called, in order."""
    import importlib

    from ninfer.ops.dispatch import _load

    called: list[str] = []
    for module, names in KERNELS.items():
        def pick(mod, name, tensor, names=names, module=module):
            if mod == module and name in names:
                called.append(f"{mod}.{name}")
                return _load(mod, name)
            return None
        monkeypatch.setattr(importlib.import_module(f"ninfer.ops.{module}"), "triton_kernel", pick)
    return called


def _run(artifact, prompts, steps=6) -> list[tuple[int, ...]]:
    with Engine(str(artifact), EngineConfig(device="cpu", dtype="float32", max_concurrency=2,
                                            context_cache=False, prefill_chunk=16)) as eng:
        hs = [eng.submit(GenerationRequest(input=TextInput(token_ids=p), sampling=SamplingParams(
            temperature=0.0, max_tokens=steps, ignore_eos=True))) for p in prompts]
        out = [tuple(h.result(timeout=300).token_ids) for h in hs]
        assert eng.usage().all_free
    return out


def test_the_kernels_give_the_references_tokens(tmp_path, monkeypatch):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", variant="full", mtp=False, seed=5)
    art = convert_tiny(ckpt, tmp_path / "tiny.ninfer")
    prompts = [tuple(range(7, 40)), tuple(range(100, 111))]  # 33 and 11 tokens: 8 and 2 blocks, a budget of 2
    want = _run(art, prompts)
    called = _with_kernels(monkeypatch)
    assert _run(art, prompts) == want
    for op in ("hyper_connection.grouped_rms_norm", "hyper_connection.stream_mix", "hyper_connection.hyper_connection_gates",
               "hyper_connection.hyper_connection_inject", "norm.rms_norm_gated_sigmoid", "qsa.qsa_block_scores",
               "qsa.qsa_attention_static"):
        assert op in called, op
