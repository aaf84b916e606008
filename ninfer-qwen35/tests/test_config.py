import pytest

from ninfer_qwen35.config import ConfigError, parse_config

FLAT = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "tie_word_embeddings": True}


def test_flat_config_builds_3_to_1_pattern():
    cfg = parse_config(FLAT)
    assert cfg.attention_layers == (3, 7) and cfg.gdn_layers == (0, 1, 2, 4, 5, 6)
    assert cfg.conv_dim == 2 * 16 + 32 and cfg.rotary_dim == 4 and cfg.tie_word_embeddings


def test_vl_config_reads_text_config_and_vision_ids():
    cfg = parse_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": FLAT,
                        "image_token_id": 248056, "tie_word_embeddings": False, "vision_config": {"depth": 2}})
    assert cfg.image_token_id == 248056 and not cfg.tie_word_embeddings and cfg.vision == {"depth": 2}


@pytest.mark.parametrize("change,match", [
    ({"num_hidden_layers": None}, "missing"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"hidden_size": -4}, "hidden_size"),
])
def test_bad_configs_name_the_field(change, match):
    raw = {**FLAT, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)
