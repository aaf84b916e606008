"""benchmarks/serve_abuse.py on the CPU: its table from a result set, and its cheapest scenario (``traps``: item 8
of issue 42) against a real ``ninfer serve`` of the embedded model, whose answers are the fixed ones."""

from __future__ import annotations

import pytest

pytest.importorskip("ninfer_serve")

from benchmarks import serve_abuse  # noqa: E402


def test_the_table_sets_each_scenario_against_its_idle_pinger():
    results = {
        "idle": {"ping_idle_worst_s": 0.2, "ping_idle_median_s": 0.1, "rss_idle_mb": 400},
        "schema_10k": {"requests": [{"status": 400, "s": 1.2, "code": "invalid_constraint", "message": "m"},
                                    {"status": 400, "s": 3.5, "code": "invalid_constraint", "message": "m"},
                                    {"status": 200, "s": 9.0, "code": None, "message": None}],
                       "ping_worst_s": 0.3, "pings": 9, "ping_failures": 0, "rss_peak_mb": 450, "rss_end_mb": 440,
                    "ping_worst_preparing_s": 0.25,
                       "health_after": 200, "plain_after": 200},
        "media_idle": {"ping_idle_worst_s": 0.5},
        "png_bomb": {"request": {"status": 400, "s": 0.01, "code": "media_too_large", "message": "m"},
                     "ping_worst_s": 0.5, "pings": 3, "ping_failures": 1, "rss_peak_mb": 500, "rss_end_mb": 500,
                     "health_after": 200, "plain_after": 200},
        "traps": {"max_tokens_null": {"status": 200, "completion_tokens": 16}},
    }
    lines = serve_abuse.table(results).splitlines()
    assert lines[0].startswith("| scenario | outcome | ping worst (s) | x idle worst | while preparing (s) |")
    assert lines[2] == ("| schema_10k | 2 x 400 invalid_constraint in 1.2-3.5 s, 200 in 9.0 s | 0.3 | 1.50 | 0.25 | 0 | "
                        "450 | 200 |")
    assert lines[3].startswith("| png_bomb | 400 media_too_large in 0.01 s | 0.5 | 1.00 | - | 1 | 500 | 200 |")
    assert len(lines) == 4  # scenarios without pinger figures (traps, cache) are in the JSON only


def test_the_traps_are_answered_as_documented(tmp_path):
    """Item 8: ``max_tokens: null`` on completions is the default 16, a remote ``$ref`` and a grammar that
    derives no sentence answer 400."""
    out = serve_abuse.run(["traps"], tmp_path, idle_s=0.5)
    traps = out["traps"]
    assert traps["max_tokens_null"] == {"status": 200, "completion_tokens": 16}
    assert traps["ref_url"]["status"] == 400 and traps["ref_url"]["code"] == "invalid_constraint"
    assert "remote" in traps["ref_url"]["message"]
    assert traps["no_sentence"]["status"] == 400 and "no sentence" in traps["no_sentence"]["message"]
    assert out["idle"]["ping_idle_worst_s"] > 0
