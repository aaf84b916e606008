"""The Qwen4Exp model over a converted artifact (the real converter on a tiny checkpoint transformers wrote) vs
transformers loading that checkpoint: prefill logits, and a prompt in chunks then decode steps (fp32, CPU). The
"full" variant: 4 streams, sigmoid GDN gate, selecting QSA, PLE on two GDN layers (sharded n-gram tables), MoE."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ninfer.artifact.materializer import load_weights
from ninfer.artifact.reader import open_artifact
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.execution.model import Qwen4ExpModel
from ninfer_qwen4exp.execution.parameters import Qwen4ExpParameters

transformers = pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")

_spec = importlib.util.spec_from_file_location("_oracle", Path(__file__).with_name("test_model_oracle.py"))
_oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_oracle)
Runner, logit_error = _oracle.Runner, _oracle.logit_error


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ninfer_qwen4exp.testing import convert_tiny, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("q4")
    ckpt = make_tiny_checkpoint(root / "ckpt", variant="full", mtp=False, seed=3)
    art = open_artifact(convert_tiny(ckpt, root / "tiny.ninfer"))
    weights, _ = load_weights(art, features=("text",))
    config = parse_config(art.config)
    model = Qwen4ExpModel(Qwen4ExpParameters.from_weights(config, weights, torch.float32))
    hf = transformers.Qwen4ExpForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return hf, model


def _prompt(n: int, vocab: int, eos: int) -> list[int]:
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
    ids[9::31] = eos
    return ids.tolist()


@pytest.mark.parametrize("length", [1, 37, 100])
def test_artifact_prefill_matches_transformers(tiny, length):
    hf, model = tiny
    ids = _prompt(length, model.config.base.vocab_size, model.config.eos_token_id)
    runner = Runner(model)
    ours = runner.step([(runner.new(), ids)])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert logit_error(ours, ref) <= 1e-4


def test_artifact_chunks_then_decode_match_transformers(tiny):
    hf, model = tiny
    ids = _prompt(30, model.config.base.vocab_size, model.config.eos_token_id)
    runner = Runner(model)
    seq, parts, lo = runner.new(), [], 0
    for size in (11, 3, 1, 1, 6, 1, 1, 1, 1, 1, 1, 1, 1):
        parts += runner.step([(seq, ids[lo:lo + size])])
        lo += size
    with torch.no_grad():
        ref = hf(torch.tensor([ids[:lo]])).logits[0].float()
    assert logit_error(torch.cat(parts), ref) <= 1e-4
