"""tools/train_tiny/mtp_chain.py: chained MTP drafts of every origin in one masked pass, and their acceptance.

The masked pass must give, for every origin t, what drafting from t alone gives: the block run causally over
the step-1 entries 0..t followed by the chain's own entries at t+1, t+2 (ninfer's Qwen35MTP drafts this way).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOOL = Path(__file__).resolve().parents[1] / "tools/train_tiny"
NAMES = ("tokenizer", "model", "mtp_chain")


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(TOOL))
    try:
        modules = {name: importlib.import_module(name) for name in NAMES}
    finally:  # the tool's modules have generic names: keep them out of everyone else's imports
        sys.path.remove(str(TOOL))
        for name in NAMES:
            sys.modules.pop(name, None)
    return modules


def _draft_from_one_origin(model, ids, hidden, t: int, depth: int) -> list[torch.Tensor]:
    """The block's outputs for the chain from origin t, one causal pass per step over a plain sequence."""
    mtp, head, embed = model.mtp, model.lm.lm_head, model.lm.model.embed_tokens
    seq = mtp.fuse(embed(ids[:, 1:t + 2]), hidden[:, :t + 1])
    outputs = []
    for _ in range(depth):
        positions = torch.arange(seq.shape[1])[None]
        out = mtp.decode(seq, model.rope(seq, positions))[:, -1:]
        outputs.append(out[0, 0])
        seq = torch.cat([seq, mtp.fuse(embed(head(out).argmax(-1)), out)], dim=1)
    return outputs


def test_masked_chain_equals_drafting_from_each_origin_alone(tool):
    torch.manual_seed(0)
    config = tool["model"].tiny_config(eos_ids=[4065, 4063], pad_id=4063)
    config._attn_implementation = "sdpa"
    model = tool["model"].TinyQwen35(config, init_std=0.2).eval()
    ids = torch.randint(0, 4063, (1, 14))
    with torch.no_grad():
        hidden = model.lm.model(input_ids=ids).last_hidden_state
        drafts, outputs = tool["mtp_chain"].chain_drafts(model, ids, hidden, depth=3)
        assert drafts.shape == (3, 13) and outputs.shape == (3, 13, config.hidden_size)
        for t in (0, 5, 12):
            alone = _draft_from_one_origin(model, ids, hidden, t, depth=3)
            for j in range(3):
                torch.testing.assert_close(outputs[j, t], alone[j], atol=2e-5, rtol=1e-4)
        # The first step is the training-time MTP pass.
        torch.testing.assert_close(outputs[0], model.mtp_hidden(ids, hidden)[0], atol=2e-5, rtol=1e-4)
    assert torch.equal(drafts, model.lm.lm_head(outputs).argmax(-1))


def test_chain_mask_sees_step_one_up_to_the_origin_and_its_own_chain(tool):
    mask = tool["mtp_chain"].chain_mask(3, 2, "cpu")
    # rows/columns: step 1 at origins 0, 1, 2, then step 2 at origins 0, 1, 2
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [1, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_acceptance_counts_leading_matches(tool):
    matches = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    stats = tool["mtp_chain"].acceptance(matches)
    assert stats["positions"] == 4
    assert stats["step_agreement"] == [0.75, 0.75, 0.75]
    assert stats["conditional_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert stats["k1"]["mean_accepted_drafts"] == pytest.approx(0.75)
    assert stats["k2"]["mean_accepted_drafts"] == pytest.approx((2 + 1 + 0 + 2) / 4)
    assert stats["k3"]["mean_tokens_per_step"] == pytest.approx(1 + (2 + 1 + 0 + 3) / 4)
