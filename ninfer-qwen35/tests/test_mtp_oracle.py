"""Qwen35MTP against the MTP block the embedded model was trained with (``tools/train_tiny/model.py``: the
Qwen3.5 structure built from transformers' own Qwen3.5 decoder layer and norm), fp32 on a tiny random config.

Our draft logits for x_{t+2} must match the oracle's at every position: run over a whole sequence at once
(the first pass after a prefill) and one position at a time over the block's paged KV (chained decode).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ninfer.core.batch_assembly import RowInput, build_forward_batch  # noqa: E402
from ninfer.models.common.weights import WeightSet  # noqa: E402
from ninfer_qwen35.config import parse_config  # noqa: E402
from ninfer_qwen35.execution.model import Qwen35Model  # noqa: E402
from ninfer_qwen35.execution.mtp import Qwen35MTP  # noqa: E402
from ninfer_qwen35.execution.parameters import MTPParams, Qwen35Parameters, WeightsError  # noqa: E402
from ninfer_qwen35.source_mapping import fused_parents  # noqa: E402

TRAIN_TINY = Path(__file__).resolve().parents[2] / "tools" / "train_tiny"
PAGE = 4
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def oracle():
    sys.path.insert(0, str(TRAIN_TINY))
    try:
        from model import TinyQwen35
    finally:
        sys.path.remove(str(TRAIN_TINY))
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = TinyQwen35(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) weights: the block's output depends on every part of it
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    raw = cfg.to_dict()
    raw["mtp_num_hidden_layers"] = 1
    config = parse_config(raw)
    weights = WeightSet.from_tensors(model.export_state_dict(), fused_parents(config))
    ours = Qwen35Model(Qwen35Parameters.from_weights(config, weights, torch.float32))
    mtp = Qwen35MTP(MTPParams.from_weights(config, weights, torch.float32, "cpu"), ours)
    return model, mtp, config


def kv_caches(config, pages: int):
    shape = (pages, PAGE, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape))]


def target(model, length: int, seed: int):
    """Random ids, the oracle's MTP logits at each position t < length-1, the target's normed hidden h_t there,
    and the pages the block's KV needs."""
    ids = torch.randint(0, 96, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = model.lm.model(input_ids=ids).last_hidden_state[0, :-1]
        _, want = model.forward_all(ids)
    return ids, want[0].float(), hidden, list(range(math.ceil((length - 1) / PAGE)))


def test_a_whole_sequence_at_once_matches(oracle):
    model, mtp, config = oracle
    ids, want, hidden, pages = target(model, 13, seed=1)
    batch = build_forward_batch([RowInput(tokens=ids[0, 1:].tolist(), start=0, slot=0, pages=pages, want_logits=True)],
                                PAGE, torch.device("cpu"))
    got = mtp.logits(mtp.forward(batch, hidden, kv_caches(config, len(pages))))
    torch.testing.assert_close(got, want, **TOL)


def test_one_position_at_a_time_over_its_kv_matches(oracle):
    model, mtp, config = oracle
    ids, want, hidden, pages = target(model, 11, seed=2)
    kv = kv_caches(config, len(pages))
    for t in range(ids.shape[1] - 1):  # the entry at t is written by this step; later steps read it
        batch = build_forward_batch([RowInput(tokens=[int(ids[0, t + 1])], start=t, slot=0, pages=pages,
                                              want_logits=True)], PAGE, torch.device("cpu"))
        got = mtp.logits(mtp.forward(batch, hidden[t:t + 1], kv))
        torch.testing.assert_close(got[0], want[t], **TOL)


def test_missing_mtp_weights_are_named(oracle):
    model, _, config = oracle
    state = {k: v for k, v in model.export_state_dict().items() if k != "mtp.fc.weight"}
    weights = WeightSet.from_tensors(state, fused_parents(config))
    with pytest.raises(WeightsError, match="mtp.fc.weight"):
        MTPParams.from_weights(config, weights, torch.float32, "cpu")
