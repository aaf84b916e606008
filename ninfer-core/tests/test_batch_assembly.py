"""build_forward_batch: the packed geometry of one unit's rows (CPU)."""

import pytest
import torch

from ninfer.core.batch_assembly import RowInput, build_forward_batch

CPU = torch.device("cpu")


def test_rows_are_packed_back_to_back():
    rows = [RowInput(tokens=[5, 6, 7], start=0, slot=2, pages=[9, 4], want_logits=True),
            RowInput(tokens=[8], start=5, slot=0, pages=[3, 1], want_logits=False),
            RowInput(tokens=[1], start=3, slot=1, pages=[7], want_logits=True)]
    b = build_forward_batch(rows, page_size=4, device=CPU)
    assert b.input_ids.tolist() == [5, 6, 7, 8, 1]
    assert b.positions.tolist() == [0, 1, 2, 5, 3]
    assert b.query_start_loc.tolist() == [0, 3, 4, 5] and b.query_start_loc.dtype == torch.int32
    assert b.seq_lens.tolist() == [3, 6, 4] and b.seq_lens.dtype == torch.int32
    assert b.state_slots.tolist() == [2, 0, 1]
    assert b.has_initial_state.tolist() == [False, True, True] and b.all_initial_state is False
    # position p of a row goes to page pages[p // 4], offset p % 4; short tables are padded with the first page
    assert b.block_tables.tolist() == [[9, 4], [3, 1], [7, 7]] and b.block_tables.dtype == torch.int32
    assert b.slot_mapping.tolist() == [36, 37, 38, 1 * 4 + 1, 7 * 4 + 3]
    assert b.logits_indices.tolist() == [2, 4]  # the last new token of each row that wants logits
    assert (b.max_query_len, b.max_seq_len, b.num_seqs, b.is_decode) == (3, 6, 3, False)


def test_decode_rows_continue_their_state():
    rows = [RowInput(tokens=[t], start=s, slot=i, pages=[i], want_logits=True)
            for i, (t, s) in enumerate([(3, 1), (4, 2)])]
    b = build_forward_batch(rows, page_size=4, device=CPU)
    assert b.is_decode and b.all_initial_state is True and b.logits_indices.tolist() == [0, 1]


@pytest.mark.parametrize("rows, match", [
    ([], "at least one row"),
    ([RowInput(tokens=[], start=0, slot=0, pages=[0], want_logits=False)], "one token per row"),
    ([RowInput(tokens=[1, 2, 3], start=3, slot=0, pages=[0], want_logits=False)], "block table shorter"),
])
def test_malformed_units_are_refused(rows, match):
    with pytest.raises(ValueError, match=match):
        build_forward_batch(rows, page_size=4, device=CPU)
