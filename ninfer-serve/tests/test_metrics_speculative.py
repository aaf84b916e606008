"""/metrics exports speculative decoding's counters under vLLM's spec_decode_* names (ninfer's prefix, as every
engine metric here), per draft position, and the mean acceptance length."""

from ninfer_serve.testing import parse_metrics


def test_metrics_export_the_speculative_counters(engine, client):
    for drafted, accepted in ((3, 3), (3, 0), (3, 1)):
        engine.recorder.drafts_verified(drafted, accepted)
    text = client(engine).get("/metrics").text
    lines = text.splitlines()
    for line in ('ninfer:spec_decode_num_drafts_total{model_name="tiny-test"} 3.0',
                 'ninfer:spec_decode_num_draft_tokens_total{model_name="tiny-test"} 9.0',
                 'ninfer:spec_decode_num_accepted_tokens_total{model_name="tiny-test"} 4.0',
                 'ninfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-test",position="0"} 2.0',
                 'ninfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-test",position="1"} 1.0',
                 'ninfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-test",position="2"} 1.0'):
        assert line in lines, line
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos"):
        assert f"# TYPE ninfer:{name}_total counter" in text and f"vLLM's {name})" in text, name
    assert "# TYPE ninfer:spec_decode_mean_acceptance_length gauge" in text
    assert parse_metrics(text)["ninfer:spec_decode_mean_acceptance_length"] == 1 + 4 / 3


def test_speculative_metrics_read_zero_without_drafts(engine, client):
    m = parse_metrics(client(engine).get("/metrics").text)
    for name in ("ninfer:spec_decode_num_drafts_total", "ninfer:spec_decode_num_draft_tokens_total",
                 "ninfer:spec_decode_num_accepted_tokens_total", "ninfer:spec_decode_num_accepted_tokens_per_pos_total",
                 "ninfer:spec_decode_mean_acceptance_length"):
        assert m[name] == 0, name
