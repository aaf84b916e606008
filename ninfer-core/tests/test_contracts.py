"""Contract data: validation and invariants that every consumer relies on."""

import pytest

from ninfer.contract import (
    GenerationRequest,
    KVPoolSpec,
    PendingBatch,
    PendingRow,
    PreparedPrompt,
    RowDecision,
    SamplingParams,
    StateField,
    StateImageLayout,
    TextInput,
)
from ninfer.contract.batch import PendingBatchError


def test_sampling_params_reject_out_of_range():
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 2.0}, {"max_tokens": 0},
                {"top_logprobs": 21}, {"temperature": float("nan")}, {"stop": ("",)}):
        with pytest.raises((ValueError, TypeError)):
            SamplingParams(**bad)
    s = SamplingParams(temperature=0.7, top_p=0.9, stop=["x"], stop_token_ids=[1, 2])
    assert s.stop == ("x",) and s.stop_token_ids == (1, 2)


def test_prompt_and_request_inputs():
    with pytest.raises(ValueError):
        PreparedPrompt(token_ids=())
    with pytest.raises(ValueError):
        PreparedPrompt(token_ids=(1, -2))
    with pytest.raises(ValueError):
        TextInput()
    req = GenerationRequest(input=TextInput(token_ids=[1, 2, 3]))
    assert req.input.token_ids == (1, 2, 3)


def test_state_layout_is_contiguous_and_aligned():
    layout = StateImageLayout(fields=[
        StateField(name="conv", dtype="bfloat16", shape=(3, 100), layers=3),
        StateField(name="recurrent", dtype="float32", shape=(4, 8, 8), layers=3, per_step=True),
    ], steps=2)
    offs = layout.offsets()
    assert offs["conv"] == 0 and offs["recurrent"] % 256 == 0
    assert offs["recurrent"] >= 3 * 3 * 100 * 2
    assert layout.nbytes_per_slot == offs["recurrent"] + 2 * 3 * 4 * 8 * 8 * 4
    with pytest.raises(ValueError):
        StateImageLayout(fields=[StateField(name="a", dtype="float32", shape=(1,), layers=1)] * 2)


def test_kv_pool_bytes():
    pool = KVPoolSpec(name="main", layers=8, kv_heads=4, head_dim=256, page_size=16)
    assert pool.nbytes_per_token == 2 * 8 * 4 * 256 * 2
    assert pool.nbytes_per_page == pool.nbytes_per_token * 16


def test_pending_batch_invariants():
    rows = [PendingRow(sequence_id=1, tokens=[5, 6, 7]), PendingRow(sequence_id=2, tokens=[9])]
    for bad in ([RowDecision(accepted=2), RowDecision(accepted=1)],          # non-terminal partial accept
                [RowDecision(accepted=0, terminal=True), RowDecision(accepted=1)],
                [RowDecision(accepted=4, terminal=True), RowDecision(accepted=1)],
                [RowDecision(accepted=1, cancelled=True), RowDecision(accepted=1)],
                [RowDecision(accepted=3)]):
        with pytest.raises(PendingBatchError):
            PendingBatch(kind="decode", rows=rows).take(bad)
    batch = PendingBatch(kind="decode", rows=rows)
    batch.take([RowDecision(accepted=2, terminal=True), RowDecision(accepted=0, cancelled=True)])
    with pytest.raises(PendingBatchError, match="twice"):
        batch.take(None)
    with pytest.raises(PendingBatchError):
        PendingRow(sequence_id=3, tokens=[])
