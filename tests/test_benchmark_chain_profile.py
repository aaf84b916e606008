"""benchmarks/chain_profile.py on made-up device events: each kernel's advance of the chain's end, overlapping
(PDL) kernels and a gap between graph replays included, and the advances adding up to the traced span."""

from __future__ import annotations

import pytest

from benchmarks import chain_profile


def test_advances_count_only_what_moves_the_chain_end():
    events = [
        ("proj", 0.0, 10.0),
        ("norm", 8.0, 11.0),     # starts early (PDL), ends 1 us after proj: advance 1
        ("moe", 9.0, 20.0),      # advance 9
        ("tiny", 12.0, 15.0),    # ends inside the span: advance 0
        ("proj", 25.0, 35.0),    # after a 5 us gap (the next replay): advance 15
    ]
    per = chain_profile.advances(reversed(events))  # sorted by start inside
    assert per["proj"] == {"advance_us": 15.0, "busy_us": 20.0, "count": 2}
    assert per["norm"]["advance_us"] == 1.0 and per["moe"]["advance_us"] == 9.0
    assert per["tiny"] == {"advance_us": 0.0, "busy_us": 3.0, "count": 1}
    assert sum(r["advance_us"] for r in per.values()) == 35.0 - 10.0  # the span after the first event


def test_table_is_per_step_with_a_total_row():
    per = chain_profile.advances([("a", 0, 2), ("b", 1, 5), ("a", 5, 7), ("b", 6, 9)])
    rows = chain_profile.table(per, steps=2, top=1)
    assert [r["name"] for r in rows] == ["b", "(all)"]
    assert rows[0]["advance_us"] == pytest.approx(2.5) and rows[0]["calls"] == 1.0  # b: 3 + 2 over 2 steps
    assert rows[-1]["advance_us"] == pytest.approx(3.5) and rows[-1]["busy_us"] == pytest.approx(5.5)
