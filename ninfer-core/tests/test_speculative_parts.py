"""The speculative core's small parts: its contracts, greedy verification, and the verify / chained batches."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.batch import PendingBatchError, PendingRow
from ninfer.contract.config import StartupFeatures
from ninfer.models.common.speculative.batches import block_table, chained_batch, verify_batch
from ninfer.ops.speculative import verify, verify_greedy


def test_startup_features_validate_the_draft_count():
    assert StartupFeatures().draft_tokens == 0
    assert StartupFeatures(speculative="mtp").draft_tokens == 2
    assert StartupFeatures(speculative="mtp", num_draft_tokens=3).draft_tokens == 3
    for bad in (0, 4, True, 2.0):
        with pytest.raises(ValueError, match="num_draft_tokens must be"):
            StartupFeatures(speculative="mtp", num_draft_tokens=bad)
    with pytest.raises(ValueError, match="speculative must be one of mtp, dflash, dflash2"):
        StartupFeatures(speculative="eagle")


def test_a_row_cannot_produce_more_than_its_drafts_allow():
    assert PendingRow(sequence_id=1, tokens=(1, 2, 3), drafted=2).produced == 3
    with pytest.raises(PendingBatchError, match="3 tokens from 1 drafts"):
        PendingRow(sequence_id=1, tokens=(1, 2, 3), drafted=1)


def test_greedy_verification_equals_the_general_rule():
    g = torch.Generator().manual_seed(0)
    B, R, V = 6, 4, 11
    logits = torch.randn(B, R, V, generator=g)
    best = logits.argmax(-1)
    drafts = best[:, :-1].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % V   # rejected at once
    drafts[2, 1] = (drafts[2, 1] + 1) % V   # one accepted
    drafts[3, 2] = (drafts[3, 2] + 1) % V   # two accepted
    tokens, accepted = verify_greedy(logits, drafts)
    assert accepted.tolist() == [3, 0, 1, 2, 3, 3]
    zeros = torch.zeros(B)
    ref = verify(logits, drafts, torch.full((B,), R - 1), zeros, zeros.long(), zeros + 1, zeros,
                 torch.zeros(B, R, V), torch.zeros(B, R))
    assert torch.equal(tokens, ref[0]) and torch.equal(accepted, ref[1])
    assert tokens[1].tolist() == [best[1, 0].item(), -1, -1, -1]
    with pytest.raises(ValueError, match="drafts"):
        verify_greedy(logits, drafts[:, :1])


def test_verify_batch_points_positions_past_the_held_pages_at_the_scratch_page():
    page, scratch = 4, 99
    batch = verify_batch([[1, 2, 3], [4, 5, 6]], [5, 10], [0, 1], [[7, 8], [3, 4, 5]], span=4, page_size=page,
                         scratch_page=scratch, device=torch.device("cpu"))
    assert batch.positions.tolist() == [5, 6, 7, 10, 11, 12]
    # row 0 holds pages 7, 8 (positions 0..7); row 1 holds 3, 4, 5 (0..11): position 12 is past them
    assert batch.slot_mapping.tolist() == [8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 5 * 4 + 2, 5 * 4 + 3, scratch * 4 + 0]
    assert batch.query_start_loc.tolist() == [0, 3, 6] and batch.seq_lens.tolist() == [8, 13]
    assert batch.block_tables.tolist() == [[7, 8, scratch, scratch], [3, 4, 5, scratch]]
    assert batch.max_query_len == 3 and batch.logits_indices.tolist() == list(range(6))
    step = chained_batch(torch.tensor([6, 11]), 1, torch.tensor([9, 9]), batch.block_tables, batch.state_slots, page)
    assert step.positions.tolist() == [7, 12] and step.seq_lens.tolist() == [8, 13]
    assert step.slot_mapping.tolist() == [8 * 4 + 3, scratch * 4]
    assert block_table([[1]], 9, page_size=4, scratch_page=0).tolist() == [[1, 0, 0]]
